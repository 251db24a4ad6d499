"""TransformerLens call conventions on a HookedModel: the Hugging Face forward stays untouched, TL keywords get
TransformerLens' semantics and return types, stop_at_layer really stops, unknown TL keywords are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lensadapters import HookedModel, NotCausalError, Output, TransformerLensKeywordError
from lensadapters.testing import assert_close, assert_refuses_causal_operations, is_causal
from lensadapters.testing.tiny_models import ARCH_NAMES, first_causal, tiny
from lensadapters.tokens import NoTokenizerError
from lensadapters.utils import lm_cross_entropy_loss

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def each_drawn_arch(test: Any) -> Any:
    """``test(arch, data)`` run for each architecture, with Hypothesis' ``data`` under ``SETTINGS``."""
    return pytest.mark.parametrize("arch", ARCH_NAMES)(SETTINGS(given(data=st.data())(test)))


def _drawn(arch: str, data: st.DataObject) -> tuple[Any, HookedModel]:
    """The tiny model of ``arch`` with a drawn seed, and it wrapped."""
    model = tiny(arch, data.draw(st.integers(0, 50), label="seed"))
    return model, HookedModel.wrap(model)


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_a_call_without_transformer_lens_keywords_is_the_hugging_face_forward(arch: str) -> None:
    model = tiny(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        reference, masked = model(ids), model(ids, attention_mask=mask)
        hm = HookedModel.wrap(model)
        out = hm(ids)
        assert type(out) is type(reference) and torch.equal(out.logits, reference.logits)
        assert torch.equal(hm(input_ids=ids, attention_mask=mask).logits, masked.logits)
        # a TransformerLens-style call on unpadded tokens: the same numbers, as a tensor
        logits = hm(ids, return_type="logits")
        assert isinstance(logits, torch.Tensor) and torch.equal(logits, reference.logits)
        assert torch.equal(hm.run_with_hooks(ids, return_type="logits"), reference.logits)
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_return_types(arch: str) -> None:
    model = tiny(arch)
    hm = HookedModel.wrap(model)
    ids = torch.randint(0, hm.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = hm(ids).logits
        assert torch.equal(hm(ids, return_type="logits"), logits)
        assert hm(ids, return_type=None) is None
        with pytest.raises(ValueError, match="return_type"):
            hm(ids, return_type="probabilities")
        if not is_causal(hm):  # an encoder has no next-token loss: "loss" and "both" are refused by name
            assert_refuses_causal_operations(hm, ids)
            hm.unwrap()
            return
        expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss = hm(ids, return_type="loss")
        assert loss.shape == () and torch.allclose(loss, expected, atol=1e-5)
        per_token = hm(ids, return_type="loss", loss_per_token=True)
        assert per_token.shape == (2, 4) and torch.allclose(per_token.mean(), expected, atol=1e-5)
        both = hm(ids, return_type="both")
        assert isinstance(both, Output) and torch.equal(both.logits, logits) and torch.equal(both.loss, loss)
        out, cache = hm.run_with_cache(ids, return_type="both")
        # (caching patterns computes the hooked layers' attention explicitly: equal up to rounding)
        assert isinstance(out, Output) and torch.allclose(out.loss, loss, atol=1e-5)
        assert "blocks.0.hook_resid_pre" in cache
        assert hm.run_with_hooks(ids, return_type="loss").shape == ()
    hm.unwrap()


def test_return_type_none_skips_the_unembedding() -> None:
    model = tiny(first_causal())
    hm = HookedModel.wrap(model)
    calls: list[str] = []
    head = hm.hf_model.get_submodule(hm.layout.unembed)
    handle = head.register_forward_pre_hook(lambda m, a: calls.append("unembed"))
    with hm.hooks([("ln_final.hook_normalized", lambda t, hook: calls.append(hook.name))]):
        assert hm(torch.zeros(1, 3, dtype=torch.long), return_type=None) is None
    handle.remove()
    assert calls == ["ln_final.hook_normalized"]
    hm.unwrap()


@each_drawn_arch
def test_stop_at_layer_really_stops(arch: str, data: st.DataObject) -> None:
    model, hm = _drawn(arch, data)
    n = hm.cfg.n_layers
    stop = data.draw(st.integers(-n, n), label="stop_at_layer")
    resolved = stop % n if stop < 0 else stop
    ids = torch.randint(0, hm.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(resolved))
    ran: list[int] = []
    counters = [
        block.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, block in enumerate(hm.block_modules)
    ]
    hooks_before = hook_count(model)
    fired: list[str] = []
    later = [f"blocks.{i}.hook_resid_pre" for i in range(resolved, n)] + ["ln_final.hook_scale"] * (
        "ln_final.hook_scale" in hm.hook_names
    )
    with torch.no_grad():
        _, full = hm.run_with_cache(ids)
        ran.clear()
        with hm.hooks([(name, lambda t, hook: fired.append(hook.name)) for name in later]):
            residual, cache = hm.run_with_cache(ids, stop_at_layer=stop)
    assert ran == list(range(resolved)), f"blocks that ran with stop_at_layer={stop}: {ran}"
    assert fired == [], f"hooks after the stop fired: {fired}"
    # the stream at block `resolved`'s input (the last block's output for n: its hook_normalized_resid_post in a
    # post-LN block, whose hook_resid_post is its last norm's input)
    expected = full.accumulated_resid()[resolved]
    assert torch.equal(residual, expected)
    assert all(not name.startswith(tuple(f"blocks.{i}." for i in range(resolved, n))) for name in cache)
    # nothing left behind: no PyTorch hook, no forward state, no hook on any point
    for handle in counters:
        handle.remove()
    assert hook_count(model) == hooks_before - n
    assert hm.wiring.forward_state.depth is None, "a forward's frame stayed open after the stop"
    assert not hm.has_hooks
    assert torch.equal(hm(ids).logits, full_logits(model, ids))
    hm.unwrap()


def full_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@each_drawn_arch
def test_start_at_layer_runs_from_the_given_residual(arch: str, data: st.DataObject) -> None:
    model, hm = _drawn(arch, data)
    n = hm.cfg.n_layers
    start = data.draw(st.integers(0, n), label="start_at_layer")
    ids = torch.randint(0, hm.cfg.d_vocab, (1, 6), generator=torch.Generator().manual_seed(start))
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids, return_type="logits")
        residual = cache.accumulated_resid()[start]  # block start's input; the last block's output for n
        fired: list[str] = []
        earlier = [
            name for name in hm.hook_names if name.startswith(("hook_", *(f"blocks.{i}." for i in range(start))))
        ]
        # the token ids the residual came from: what blocks reading side inputs computed from them need
        with hm.hooks([(name, lambda t, hook: fired.append(hook.name)) for name in earlier]):
            again = hm(residual, start_at_layer=start, tokens=ids)
        assert fired == [], f"hooks before start_at_layer={start} fired: {fired}"
        assert_close(again, logits, f"logits from layer {start}")
        if hm.layout.side_inputs and start < n:  # without the token ids those inputs are unknown: refused
            with pytest.raises(ValueError, match="tokens="):
                hm(residual, start_at_layer=start)
        else:  # the residual alone determines the run
            assert_close(hm(residual, start_at_layer=start), logits, f"logits from layer {start} without tokens")
        if is_causal(hm):
            loss = hm(residual, start_at_layer=start, tokens=ids, return_type="loss")
            assert_close(loss, lm_cross_entropy_loss(logits, ids), "loss from a layer")
            with pytest.raises(ValueError, match="tokens="):
                hm(residual, start_at_layer=start, return_type="loss")
        else:  # an encoder has no next-token loss, from a layer either
            with pytest.raises(NotCausalError, match="next-token loss"):
                hm(residual, start_at_layer=start, tokens=ids, return_type="loss")
        with pytest.raises(ValueError, match="residual stream"):
            hm(ids, start_at_layer=start)
        if start < n:  # an edit at the start layer's input sees the given residual
            seen: list[torch.Tensor] = []
            with hm.hooks([(f"blocks.{start}.hook_resid_pre", lambda t, hook: seen.append(t.clone()))]):
                hm(residual, start_at_layer=start, tokens=ids)
            assert torch.equal(seen[0], residual)
    hm.unwrap()


def test_transformer_lens_keywords_never_vanish() -> None:
    model = tiny(first_causal())
    hm = HookedModel.wrap(model)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad():
        for kwargs, match in [
            (dict(shortformer_pos_embed=torch.zeros(1, 4, hm.cfg.d_model)), "shortformer"),
            (dict(past_kv_cache=object()), "past_kv_cache"),
            (dict(return_type="logits", labels=ids), "'labels' is not a keyword"),
            (dict(stop_at_layer=1, output_hidden_states=True), "output_hidden_states"),
            (dict(pos_slice=2), "pos_slice=2"),
            (dict(return_cache_object=False), "return_cache_object=False"),
            (dict(clear_contexts=True), "clear_contexts=True"),
        ]:
            with pytest.raises(TransformerLensKeywordError, match=match):
                hm(ids, **kwargs)
        with pytest.raises(TransformerLensKeywordError, match="pos_slice"):
            hm.run_with_cache(ids, pos_slice=-1)
        # TransformerLens keywords asking for what lensadapters does anyway are accepted
        logits, _ = hm.run_with_cache(ids, reset_hooks_end=True, clear_contexts=False, return_cache_object=True)
        assert isinstance(logits, torch.Tensor)
        with pytest.raises(TypeError, match="stop_at_layer must be an int"):
            hm(ids, stop_at_layer="2")
    assert not hm.has_hooks
    hm.unwrap()


def test_text_needs_a_tokenizer() -> None:
    hm = HookedModel.wrap(tiny(first_causal()))
    with pytest.raises(NoTokenizerError, match="tokenizer"):
        hm("some text")
    with pytest.raises(NoTokenizerError, match="tokenizer"):
        hm.to_tokens("some text")
    hm.unwrap()


@each_drawn_arch
def test_left_padded_rows_give_their_unpadded_values(arch: str, data: st.DataObject) -> None:
    """On every architecture (GPT-2 and OPT with learned positions, rotary models): a TransformerLens-style call
    with an attention mask gives each padded row's real tokens the values of the row alone. A causal LM's rows are
    padded on the left (TransformerLens counts their positions from the first real token). An encoder's positions
    are 0, 1, ... whatever the mask (TransformerLens' HookedEncoder, and Hugging Face's forward): its rows are padded
    on the right, and left-padded rows get exactly Hugging Face's values."""
    model, hm = _drawn(arch, data)
    causal = is_causal(hm)
    length = data.draw(st.integers(2, 7), label="length")
    pads = data.draw(st.lists(st.integers(0, length - 1), min_size=1, max_size=3), label="pads")
    ids = torch.randint(0, hm.cfg.d_vocab, (len(pads), length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    real = [slice(pad, None) if causal else slice(0, length - pad) for pad in pads]  # each row's real tokens
    for row, tokens in enumerate(real):
        mask[row] = 0
        mask[row, tokens] = 1
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids, attention_mask=mask, return_type="logits")
        for row, (pad, tokens) in enumerate(zip(pads, real)):
            alone, alone_cache = hm.run_with_cache(ids[row : row + 1, tokens], return_type="logits")
            assert_close(logits[row, tokens], alone[0], f"row {row} ({pad} pads) vs alone")
            alone_resid = alone_cache.accumulated_resid()[-1, 0]  # float rounding relative to the stream's size (a
            scale = 1 + alone_resid.abs().max().item()  # MoE's experts run batched: a batch rounds apart from a row)
            resid = cache.accumulated_resid()[-1, row, tokens]
            assert_close(resid, alone_resid, "the last block's output", atol=1e-4 * scale)
        if not causal:  # left padding: the encoder's own positions, as its Hugging Face forward computes them
            left = mask.flip(1)
            expected = model(ids, attention_mask=left).logits
            assert torch.equal(hm(ids, attention_mask=left, return_type="logits"), expected)
    hm.unwrap()


def test_nn_module_conveniences_act_on_the_model() -> None:
    model = tiny(first_causal())
    hm = HookedModel.wrap(model)
    assert hm.train() is hm and model.training
    assert hm.eval() is hm and not model.training
    assert list(hm.parameters()) == list(model.parameters())
    assert [n for n, _ in hm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert hm.state_dict().keys() == model.state_dict().keys()
    assert hm.cfg.device == torch.device("cpu") and hm.cfg.dtype == torch.float32
    assert hm.to(torch.float64) is hm
    assert next(model.parameters()).dtype == torch.float64 and hm.cfg.dtype == torch.float64
    assert hm.cpu() is hm and hm.requires_grad_(False) is hm
    assert not any(p.requires_grad for p in model.parameters())
    hm.unwrap()


def test_incl_bwd_backpropagates_a_transformer_lens_loss() -> None:
    hm = HookedModel.wrap(tiny(first_causal()))
    ids = torch.randint(0, hm.cfg.d_vocab, (1, 5), generator=torch.Generator().manual_seed(3))
    loss, cache = hm.run_with_cache(ids, return_type="loss", incl_bwd=True, names_filter="blocks.0.hook_resid_pre")
    assert loss.shape == () and cache["blocks.0.hook_resid_pre_grad"].abs().sum() > 0
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_errors_inside_a_stopped_forward_leave_nothing(arch: str) -> None:
    model = tiny(arch)
    hm = HookedModel.wrap(model)
    before = hook_count(model)

    def boom(t: torch.Tensor, hook: Any) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hm.run_with_hooks(
            torch.zeros(1, 3, dtype=torch.long),
            stop_at_layer=hm.cfg.n_layers,
            fwd_hooks=[("blocks.0.hook_resid_post", boom)],
        )
    assert hook_count(model) == before and not hm.has_hooks
    hm.unwrap()
