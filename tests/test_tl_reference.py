"""The analysis layer against TransformerLens 2.x on the same weights (values within 1e-4, labels identical).

Each architecture plugin installed here that TransformerLens also converts (gpt2, gpt_neox, opt, llama) gets a
tiny model drawn by hypothesis, and TransformerLens' ``HookedTransformer`` with its weights, no processing
(``lensadapters.testing.tl_reference``). Skipped where TransformerLens is not installed: CI runs these in its
transformers-4.57 environment (``scripts/setup-reference.sh``).

Deliberate differences, checked as such: ``apply_ln_to_stack`` multiplies by the norm's weight (TransformerLens
folds it into the next matrix instead), so its values are TransformerLens' times the weight and
``logit_attrs`` equals TransformerLens' on a ``fold_ln=True`` model; and the loss of right-padded text ignores
the padding (TransformerLens, computing no mask then, counts it), so the loss is compared with an explicit mask.
"""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lensadapters import HookedModel, get_registry
from lensadapters import patching as la_patching
from lensadapters import utils as la_utils
from lensadapters.demo import reinit
from lensadapters.head_detector import detect_head
from lensadapters.testing.tl_reference import (
    REFERENCE_MODEL_TYPES,
    hooked_transformer,
    reference_configs,
    transformer_lens_available,
    word_tokenizer,
)

pytestmark = pytest.mark.skipif(
    not transformer_lens_available(),
    reason="TransformerLens 2.x is not installed (CI's transformers-4.57 environment has it: "
    "scripts/setup-reference.sh)",
)

_installed = {
    mt for info in get_registry().architecture_plugins() for arch in info.architectures for mt in arch.model_types
}
MODEL_TYPES = [mt for mt in REFERENCE_MODEL_TYPES if mt in _installed]
EXAMPLES = settings.default.max_examples
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# the sweeps run hundreds of forwards in both libraries: fewer examples
HEAVY = settings(SETTINGS, max_examples=max(1, EXAMPLES // 6))
TOL = 1e-4


def check(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Within 1e-4 (absolute and relative); NaN where both are NaN (a loss over no tokens) counts as equal."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if not torch.allclose(a, b, atol=TOL, rtol=TOL, equal_nan=True):
        finite = torch.isfinite(a) & torch.isfinite(b)
        worst = (a - b)[finite].abs().max().item() if finite.any() else float("nan")
        raise AssertionError(f"{what}: max abs difference {worst:.3g} (tolerance {TOL})")


@functools.lru_cache(maxsize=None)
def tokenizer(vocab: int, adds_bos: bool = False) -> Any:
    """One saved tokenizer per kind for the whole session (TransformerLens reloads it from its folder)."""
    return word_tokenizer(vocab, adds_bos=adds_bos)


@contextlib.contextmanager
def pair(data: st.DataObject, model_type: str, tokenizer: Any = None, max_layers: int = 2, **tl_fields: Any):
    """A tiny model wrapped by lensadapters and the TransformerLens model with its weights."""
    config = data.draw(reference_configs(model_type, max_layers=max_layers), label="config")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    reinit(model, seed)  # unit-scale weights: tiny models with 0.02 init compute almost nothing
    tl = hooked_transformer(model, tokenizer=tokenizer, **tl_fields)
    hm = HookedModel.wrap(model, tokenizer=tokenizer)
    try:
        yield hm, tl
    finally:
        hm.unwrap()


def draw_tokens(data: st.DataObject, vocab: int, max_batch: int = 2, max_len: int = 7) -> torch.Tensor:
    batch = data.draw(st.integers(1, max_batch), label="batch")
    length = data.draw(st.integers(2, max_len), label="length")
    seed = data.draw(st.integers(0, 2**16), label="token seed")
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_mask(data: st.DataObject, tokens: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(tokens)
    for row in range(tokens.shape[0]):
        mask[row, : data.draw(st.integers(0, tokens.shape[1] - 1), label="pads")] = 0
    return mask


def quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args, **kwargs)


# --- the forward: return types, loss, stop/start -----------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@SETTINGS
@given(data=st.data())
def test_return_types_and_loss_match(model_type: str, data: st.DataObject) -> None:
    with pair(data, model_type) as (hm, tl), torch.no_grad():
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        padded = data.draw(st.booleans(), label="left padding")
        kw = {"attention_mask": left_mask(data, tokens)} if padded else {}
        real = kw["attention_mask"].bool() if padded else torch.ones_like(tokens, dtype=torch.bool)
        logits = hm(tokens, return_type="logits", **kw)
        check(logits[real], tl(tokens, return_type="logits", **kw)[real], "logits")
        check(hm(tokens, return_type="loss", **kw), tl(tokens, return_type="loss", **kw), "loss")
        per_token = hm(tokens, return_type="loss", loss_per_token=True, **kw)
        assert per_token.shape == (tokens.shape[0], tokens.shape[1] - 1)
        check(per_token, tl(tokens, return_type="loss", loss_per_token=True, **kw), "per-token loss")
        both, tl_both = hm(tokens, return_type="both", **kw), tl(tokens, return_type="both", **kw)
        assert type(both).__name__ == "Output" and both._fields == tl_both._fields == ("logits", "loss")
        check(both.loss, tl_both.loss, "both.loss")
        assert hm(tokens, return_type=None) is None and tl(tokens, return_type=None) is None


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@SETTINGS
@given(data=st.data())
def test_stop_and_start_at_layer_match(model_type: str, data: st.DataObject) -> None:
    with pair(data, model_type, max_layers=3) as (hm, tl), torch.no_grad():
        n = hm.cfg.n_layers
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        stop = data.draw(st.integers(-n, n), label="stop_at_layer")
        check(hm(tokens, stop_at_layer=stop), tl(tokens, stop_at_layer=stop), f"stop_at_layer={stop}")
        start = data.draw(st.integers(0, n), label="start_at_layer")
        residual = torch.randn(tokens.shape + (hm.cfg.d_model,), generator=torch.Generator().manual_seed(start))
        check(hm(residual, start_at_layer=start), tl(residual, start_at_layer=start), f"start_at_layer={start}")
        check(
            hm(residual, start_at_layer=start, tokens=tokens, return_type="loss"),
            tl(residual, start_at_layer=start, tokens=tokens, return_type="loss"),
            "loss from a layer",
        )
        check(
            hm(residual, start_at_layer=start, stop_at_layer=stop),
            tl(residual, start_at_layer=start, stop_at_layer=stop),
            f"start {start} stop {stop}",
        )


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@SETTINGS
@given(data=st.data())
def test_hook_values_match_head_inputs_included(model_type: str, data: st.DataObject) -> None:
    """Every hook point both have, TransformerLens' optional ones switched on (results, mlp_in; head inputs in
    a second model: with split inputs TransformerLens normalizes each head's copy, so its ln1 points change)."""
    with pair(data, model_type, use_attn_result=True, use_hook_mlp_in=True) as (hm, tl):
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        with torch.no_grad():
            _, ours = hm.run_with_cache(tokens, names_filter=lambda n: True)
            _, theirs = tl.run_with_cache(tokens)
            common = [name for name in ours if name in theirs.cache_dict]
            for name in (
                "blocks.0.attn.hook_result",
                "blocks.0.hook_mlp_in",
                "blocks.0.hook_resid_pre",
                "blocks.0.ln1.hook_scale",
                "blocks.0.attn.hook_pattern",
                "ln_final.hook_normalized",
            ):
                assert name in common, name
            for name in common:
                check(ours[name], theirs[name], name)
            split = hooked_transformer(hm.hf_model, use_split_qkv_input=True)
            _, theirs = split.run_with_cache(tokens)
            names = [f"blocks.{i}.hook_{x}_input" for i in range(hm.cfg.n_layers) for x in "qkv"]
            if "blocks.0.hook_attn_in" in hm.hook_names:
                _, attn_in = hooked_transformer(hm.hf_model, use_attn_in=True).run_with_cache(tokens)
                theirs.cache_dict.update({k: v for k, v in attn_in.cache_dict.items() if k.endswith("attn_in")})
                names += [f"blocks.{i}.hook_attn_in" for i in range(hm.cfg.n_layers)]
            for name in names:
                check(ours[name], theirs[name], name)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@SETTINGS
@given(data=st.data())
def test_head_input_edits_match(model_type: str, data: st.DataObject) -> None:
    """Editing one head's copy of the attention input changes the logits exactly as in TransformerLens."""
    point = data.draw(st.sampled_from(["q_input", "k_input", "v_input", "attn_in"]), label="point")
    fields = {"use_attn_in": True} if point == "attn_in" else {"use_split_qkv_input": True}
    with pair(data, model_type, **fields) as (hm, tl):
        if f"blocks.0.hook_{point}" not in hm.hook_names:
            assert point == "attn_in" and hm.cfg.n_key_value_heads != hm.cfg.n_heads
            return
        layer = data.draw(st.integers(0, hm.cfg.n_layers - 1), label="layer")
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        g = torch.Generator().manual_seed(layer)

        def edit(x: torch.Tensor, hook: Any) -> torch.Tensor:
            head = x.shape[2] - 1
            x = x.clone()
            x[:, :, head] = x[:, :, head] * 1.5 + torch.randn(x.shape[-1], generator=g)
            return x

        name = f"blocks.{layer}.hook_{point}"
        with torch.no_grad():
            g.manual_seed(layer)
            ours = hm.run_with_hooks(tokens, fwd_hooks=[(name, edit)], return_type="logits")
            g.manual_seed(layer)
            theirs = tl.run_with_hooks(tokens, fwd_hooks=[(name, edit)])
            assert (ours - hm(tokens, return_type="logits")).abs().max() > 1e-4
        check(ours, theirs, f"logits after editing {name}")


# --- text -------------------------------------------------------------------------------------------------


def draw_texts(data: st.DataObject, vocab: int) -> list[str]:
    n = data.draw(st.integers(1, 3), label="texts")
    return [
        " ".join(f"w{i}" for i in data.draw(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=6), label="words"))
        for _ in range(n)
    ]


@pytest.mark.parametrize("adds_bos", [False, True], ids=["gpt2-style tokenizer", "llama-style tokenizer"])
@SETTINGS
@given(data=st.data())
def test_tokenizer_methods_match(adds_bos: bool, data: st.DataObject) -> None:
    model_type = data.draw(st.sampled_from(MODEL_TYPES), label="model type")
    vocab = 40
    tok = tokenizer(vocab, adds_bos)
    with pair(data, model_type, tokenizer=tok) as (hm, tl):
        if hm.cfg.d_vocab < vocab:
            return
        texts = draw_texts(data, vocab)
        prepend_bos = data.draw(st.sampled_from([None, True, False]), label="prepend_bos")
        padding_side = data.draw(st.sampled_from([None, "left", "right"]), label="padding_side")
        kw = dict(prepend_bos=prepend_bos, padding_side=padding_side)
        tokens = hm.to_tokens(texts, **kw)
        assert torch.equal(tokens, tl.to_tokens(texts, **kw))
        assert torch.equal(hm.to_tokens(texts[0], **kw), tl.to_tokens(texts[0], **kw))
        assert hm.to_str_tokens(texts, **kw) == tl.to_str_tokens(texts, **kw)
        assert hm.to_str_tokens(texts[0], **kw) == tl.to_str_tokens(texts[0], **kw)
        assert hm.to_str_tokens(tokens[0]) == tl.to_str_tokens(tokens[0])
        assert hm.to_string(tokens) == tl.to_string(tokens)
        assert hm.to_string(tokens[0]) == tl.to_string(tokens[0])
        word = texts[0].split()[-1]
        assert hm.to_single_token(word) == tl.to_single_token(word)
        assert hm.to_single_str_token(5) == tl.to_single_str_token(5)
        for mode in ("first", "last"):
            assert hm.get_token_position(word, texts[0], mode=mode, **kw) == tl.get_token_position(
                word, texts[0], mode=mode, **kw
            )


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@SETTINGS
@given(data=st.data())
def test_text_inputs_match(model_type: str, data: st.DataObject) -> None:
    """Text through the forward: left-padded batches (TransformerLens derives positions from the mask, as
    lensadapters does for every architecture), losses, caches."""
    vocab = 40
    tok = tokenizer(vocab, data.draw(st.booleans(), label="tokenizer adds BOS"))
    with pair(data, model_type, tokenizer=tok) as (hm, tl), torch.no_grad():
        if hm.cfg.d_vocab < vocab:
            return
        texts = draw_texts(data, vocab)
        side = data.draw(st.sampled_from(["left", "right"]), label="padding_side")
        _, mask = la_tokens(hm, texts, side)
        real = mask.bool()
        ours, theirs = hm(texts, padding_side=side), tl(texts, padding_side=side)
        check(ours[real], theirs[real], f"logits of {side}-padded text")
        for i, text in enumerate(texts):  # each padded row gives its unpadded values
            check(ours[i][real[i]], hm(text)[0], f"row {i} padded vs alone")
        tokens = hm.to_tokens(texts, padding_side=side)
        check(
            hm(texts, padding_side=side, return_type="loss"),
            tl(tokens, return_type="loss", attention_mask=mask),
            "loss of padded text",
        )
        _, cache = hm.run_with_cache(texts, padding_side=side)
        _, tl_cache = tl.run_with_cache(texts, padding_side=side)
        check(cache["resid_post", -1][real], tl_cache["resid_post", -1][real], "cached resid_post")


def la_tokens(hm: HookedModel, texts: list[str], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    from lensadapters.tokens import tokenize

    return tokenize(hm, texts, padding_side=side)


# --- ActivationCache methods ----------------------------------------------------------------------------------


def _both(ours: Any, theirs: Any, method: str, **kw: Any) -> tuple:
    """``method`` of both caches with ``kw`` (and the labels, which must agree, as the shapes must)."""
    a, la = getattr(ours, method)(return_labels=True, **kw)
    b, lb = quiet(getattr(theirs, method), return_labels=True, **kw)
    assert la == lb, f"labels differ for {kw}: {la} vs {lb}"
    assert a.shape == b.shape, f"shapes differ for {kw}: {tuple(a.shape)} vs {tuple(b.shape)}"
    return a, b


def _norm_weight(hm: HookedModel, layer: int, mlp_input: bool) -> torch.Tensor:
    n = hm.cfg.n_layers
    prefix = "ln_final" if layer == n else f"blocks.{layer}.ln{2 if mlp_input else 1}"
    spec = hm.norm_spec(hm.norm_module(prefix))
    return spec.weight.float() + spec.weight_offset


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@SETTINGS
@given(data=st.data())
def test_cache_methods_match(model_type: str, data: st.DataObject) -> None:
    with pair(data, model_type) as (hm, tl), torch.no_grad():
        n = hm.cfg.n_layers
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        _, ours = hm.run_with_cache(tokens)
        _, theirs = tl.run_with_cache(tokens)
        parallel = hm.cfg.parallel_attn_mlp
        layer = data.draw(st.integers(0, n), label="layer")
        below = data.draw(st.integers(0, n - 1), label="block")
        pos = data.draw(st.sampled_from([None, -1, (0, 2), [0, tokens.shape[1] - 1]]), label="pos_slice")
        mid = data.draw(st.booleans(), label="incl_mid") and not parallel

        # accumulated_resid: identical; apply_ln at the final layer recomputes the final norm (as TransformerLens)
        a, b = _both(ours, theirs, "accumulated_resid", layer=layer, incl_mid=mid, pos_slice=pos)
        check(a, b, "accumulated_resid")
        a, b = _both(ours, theirs, "accumulated_resid", apply_ln=True, pos_slice=pos)
        check(a, b, "accumulated_resid(apply_ln) at the unembed")
        if not parallel:
            a, b = _both(ours, theirs, "accumulated_resid", layer=below, mlp_input=True, apply_ln=True)
            check(a, b * _norm_weight(hm, below, True), "accumulated_resid(mlp_input, apply_ln)")

        # decompose_resid; with apply_ln: TransformerLens' values times the norm's weight
        mode = data.draw(st.sampled_from(["all", "attn", "mlp"]), label="mode")
        a, b = _both(ours, theirs, "decompose_resid", layer=layer, mode=mode, pos_slice=pos)
        check(a, b, "decompose_resid")
        a, b = _both(ours, theirs, "decompose_resid", layer=layer, apply_ln=True, pos_slice=pos)
        check(a, b * _norm_weight(hm, layer, False), "decompose_resid(apply_ln)")
        if not parallel:  # a parallel block's MLP does not read its attention output (TransformerLens adds it)
            a, b = _both(ours, theirs, "decompose_resid", layer=below, mlp_input=True)
            check(a, b, "decompose_resid(mlp_input)")

        # heads
        a, b = _both(
            ours,
            theirs,
            "stack_head_results",
            layer=layer,
            pos_slice=pos,
            incl_remainder=data.draw(st.booleans(), label="incl_remainder"),
        )
        check(a, b, "stack_head_results")
        a, b = _both(ours, theirs, "stack_head_results", layer=layer, apply_ln=True)
        check(a, b * _norm_weight(hm, layer, False), "stack_head_results(apply_ln)")
        check(ours.stack_activation("pattern"), theirs.stack_activation("pattern"), "stack_activation")

        # neurons
        one = data.draw(st.sampled_from([None, 1, (0, 3), [0, 2]]), label="neuron_slice of one layer")
        check(
            ours.get_neuron_results(below, neuron_slice=one, pos_slice=pos),
            theirs.get_neuron_results(below, neuron_slice=one, pos_slice=pos),
            "get_neuron_results",
        )
        # (an int neuron_slice breaks TransformerLens' stack_neuron_results: it labels and stacks by iterating it)
        neurons = data.draw(st.sampled_from([None, (0, 3), [0, 2]]), label="neuron_slice")
        a, b = _both(
            ours,
            theirs,
            "stack_neuron_results",
            layer=layer,
            neuron_slice=neurons,
            pos_slice=pos,
            incl_remainder=True,
        )
        check(a, b, "stack_neuron_results")

        # full decomposition
        expand = data.draw(st.booleans(), label="expand_neurons")
        a, b = _both(
            ours,
            theirs,
            "get_full_resid_decomposition",
            layer=layer,
            expand_neurons=expand,
            pos_slice=pos,
        )
        check(a, b, "get_full_resid_decomposition")
        if not parallel:
            a, b = _both(
                ours,
                theirs,
                "get_full_resid_decomposition",
                layer=below,
                mlp_input=True,
                expand_neurons=expand,
                apply_ln=True,
            )
            check(a, b * _norm_weight(hm, below, True), "get_full_resid_decomposition(mlp_input, apply_ln)")

        # batch slices
        batch = data.draw(st.sampled_from([0, (0, 1), [0]]), label="batch_slice")
        sliced_ours, sliced_theirs = ours.apply_slice_to_batch_dim(batch), theirs.apply_slice_to_batch_dim(batch)
        assert sliced_ours.has_batch_dim == sliced_theirs.has_batch_dim
        check(sliced_ours["resid_post", n - 1], sliced_theirs["resid_post", n - 1], "batch slice")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@SETTINGS
@given(data=st.data())
def test_logit_attrs_match_transformer_lens_with_folded_norms(model_type: str, data: st.DataObject) -> None:
    """TransformerLens' own recipe for direct logit attribution is a ``fold_ln=True`` model: lensadapters gives
    its numbers on the unfolded Hugging Face weights."""
    with pair(data, model_type) as (hm, _), torch.no_grad():
        folded = hooked_transformer(hm.hf_model, fold_ln=True)
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        _, ours = hm.run_with_cache(tokens)
        _, theirs = folded.run_with_cache(tokens)
        stack, labels = ours.get_full_resid_decomposition(pos_slice=-1, expand_neurons=False, return_labels=True)
        answer = tokens[:, -1]
        wrong = (answer + 1) % hm.cfg.d_vocab
        check(
            ours.logit_attrs(stack, answer, wrong, pos_slice=-1),
            theirs.logit_attrs(stack, answer, wrong, pos_slice=-1),
            "logit_attrs",
        )
        attrs = ours.logit_attrs(stack, answer, pos_slice=-1)
        # the attributions add up to the logit, less the final norm's and the unembedding's biases
        logits = hm(tokens, return_type="logits")[:, -1]
        spec = hm.norm_spec(hm.norm_module("ln_final")) if "ln_final.hook_scale" in hm.hook_names else None
        bias = hm.b_U[answer]
        if spec is not None and spec.bias is not None:
            bias = bias + spec.bias.float() @ hm.W_U[:, answer]
        check(attrs.sum(0), logits.gather(-1, answer[:, None])[:, 0] - bias, "attributions add up")


# --- patching, head detection, circuits --------------------------------------------------------------------

_SWEEPS = [name for name in la_patching.__all__ if name.startswith("get_act_patch_")]
_GROUPS = 3  # every sweep in every run, a third of them per test


@pytest.mark.parametrize("group", range(_GROUPS))
@pytest.mark.parametrize("model_type", MODEL_TYPES)
@HEAVY
@given(data=st.data())
def test_patching_matches(model_type: str, group: int, data: st.DataObject) -> None:
    import transformer_lens.patching as tl_patching

    with pair(data, model_type) as (hm, tl):
        length = data.draw(st.integers(2, 4), label="length")
        clean = torch.randint(3, hm.cfg.d_vocab, (1, length), generator=torch.Generator().manual_seed(length))
        corrupted = clean.clone()
        corrupted[0, 0] = (clean[0, 0] + 1) % hm.cfg.d_vocab
        _, ours = hm.run_with_cache(clean)
        _, theirs = tl.run_with_cache(clean)
        answer, other = int(clean[0, -1]), int(corrupted[0, 0])

        def metric(logits: torch.Tensor) -> torch.Tensor:
            return logits[0, -1, answer] - logits[0, -1, other]

        for name in _SWEEPS[group::_GROUPS]:
            if hm.cfg.parallel_attn_mlp and name.endswith("resid_mid"):
                continue  # parallel blocks have no resid_mid (in either library)
            a = quiet(getattr(la_patching, name), hm, corrupted, ours, metric)
            b = quiet(getattr(tl_patching, name), tl, corrupted, theirs, metric)
            assert a.shape == b.shape, name
            check(a, b, name)
        if group:
            return
        rows = [[0, 0], [hm.cfg.n_layers - 1, length - 1]]
        a = quiet(
            la_patching.generic_activation_patch,
            hm,
            corrupted,
            ours,
            metric,
            la_patching.layer_pos_patch_setter,
            "resid_pre",
            index_df=rows,
        )
        pandas = pytest.importorskip("pandas")
        b = quiet(
            tl_patching.generic_activation_patch,
            tl,
            corrupted,
            theirs,
            metric,
            tl_patching.layer_pos_patch_setter,
            "resid_pre",
            index_df=pandas.DataFrame(rows, columns=["layer", "pos"]),
        )
        check(a, b, "generic_activation_patch(index_df=...)")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@SETTINGS
@given(data=st.data())
def test_detect_head_matches(model_type: str, data: st.DataObject) -> None:
    from transformer_lens.head_detector import detect_head as tl_detect_head

    tok = tokenizer(40)
    with pair(data, model_type, tokenizer=tok) as (hm, tl):
        if hm.cfg.d_vocab < 40:
            return
        words = data.draw(st.lists(st.integers(3, 39), min_size=2, max_size=5), label="words")
        text = " ".join(f"w{i}" for i in words * 2)
        pattern = data.draw(st.sampled_from(["previous_token_head", "duplicate_token_head", "induction_head"]))
        kw = dict(
            exclude_bos=data.draw(st.booleans(), label="exclude_bos"),
            exclude_current_token=data.draw(st.booleans(), label="exclude_current_token"),
            error_measure=data.draw(st.sampled_from(["mul", "abs"]), label="error_measure"),
        )
        heads = data.draw(st.sampled_from([None, [(0, 0), (hm.cfg.n_layers - 1, 1)]]), label="heads")
        check(
            detect_head(hm, text, pattern, heads, **kw),
            quiet(tl_detect_head, tl, text, pattern, heads, **kw),
            f"detect_head {pattern}",
        )


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@SETTINGS
@given(data=st.data())
def test_circuits_match(model_type: str, data: st.DataObject) -> None:
    with pair(data, model_type, max_layers=3) as (hm, tl), torch.no_grad():
        for name in ("OV", "QK"):
            ours, theirs = getattr(hm, name), getattr(tl, name)
            assert ours.shape == theirs.shape
            check(ours.AB, theirs.AB, f"{name}.AB")
            check(ours.S, theirs.S, f"{name}.S")
            check(ours.norm(), theirs.norm(), f"{name}.norm()")
        for mode in "QKV":
            check(hm.all_composition_scores(mode), tl.all_composition_scores(mode), f"composition {mode}")
        tokens = draw_tokens(data, hm.cfg.d_vocab)
        check(
            hm.tokens_to_residual_directions(tokens),
            tl.tokens_to_residual_directions(tokens),
            "tokens_to_residual_directions",
        )
        check(
            hm.tokens_to_residual_directions(int(tokens[0, 0])),
            tl.tokens_to_residual_directions(int(tokens[0, 0])),
            "one token's direction",
        )
        for layer in range(hm.cfg.n_layers + 1):
            for mlp_input in [False, True] if layer < hm.cfg.n_layers else [False]:
                for mlp_biases in (False, True):
                    check(
                        hm.accumulated_bias(layer, mlp_input, mlp_biases),
                        tl.accumulated_bias(layer, mlp_input, mlp_biases),
                        "accumulated_bias",
                    )
        assert hm.all_head_labels() == tl.all_head_labels()


@SETTINGS
@given(
    name=st.sampled_from(
        [
            "resid_pre",
            "k",
            "q",
            "v",
            "z",
            "pattern",
            "attn",
            "attn_scores",
            "attn_logits",
            "key",
            "query",
            "value",
            "mlp_pre",
            "mlp_post",
            "pre",
            "post",
            "scale",
            "normalized",
            "resid_mid",
            "mlp_out",
            "attn_out",
            "result",
            "rot_k",
            "q_input",
            "attn_in",
            "pre_linear",
            "embed",
            "blocks.3.hook_resid_pre",
            "hook_embed",
        ]
    ),
    layer=st.one_of(st.none(), st.integers(0, 30)),
    layer_type=st.sampled_from([None, "a", "m", "b", "block", "blocks", "attention", "ln1", "ln2", "mlp", "attn"]),
    fused=st.booleans(),
)
def test_get_act_name_matches(name: str, layer: Any, layer_type: Any, fused: bool) -> None:
    from transformer_lens.utils import get_act_name as tl_get_act_name

    if fused and layer is not None and "." not in name:  # "k6", "scale4ln1": layer (and type) written into the name
        text = f"{name}{layer}{layer_type or ''}"
        assert la_utils.get_act_name(text) == tl_get_act_name(text)
    else:
        assert la_utils.get_act_name(name, layer, layer_type) == tl_get_act_name(name, layer, layer_type)
