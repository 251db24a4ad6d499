"""BERT and RoBERTa encoders: every point against a reference written from the Hugging Face modules, edits against
the same edits made with plain PyTorch hooks, weights from the live parameters, and (under transformers 4.57 with
TransformerLens 2.18 installed) every shared point and the logits against TransformerLens' ``HookedEncoder`` on the
same weights.

Tiny models (width 16-24, 2 layers) with unit-scale weights (``lensadapters.testing.reinit``); nothing is built at
import.
"""

from __future__ import annotations

from typing import Any

import lensadapters_bert
import pytest
import torch
from lensadapters_bert.reference import (
    FAMILIES,
    IMPLEMENTATIONS,
    PAD,
    base_model,
    inputs,
    make_model,
    max_error,
    mlm_head,
    reference,
    wrapped,
)
from torch import Tensor, nn
from transformers import BertConfig, BertForMaskedLM, BertModel, RobertaForMaskedLM

from lensadapters import DecompositionUndefinedError, HookedModel, NotCausalError, UnsupportedModelError, hf
from lensadapters.testing import assert_close, assert_wraps_transparently

# --- reading ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_point_matches_the_reference(family, implementation):
    model, batch, hm = wrapped(family, implementation)
    assert hm.cfg.attention_dir == "bidirectional"
    with torch.no_grad():
        expected = model(**batch).logits
        logits, cache = hm.run_with_cache(**batch, names_filter=hm.hook_names)  # the per-head points too
        ref = reference(model, batch)
    if implementation == "eager":  # caching patterns writes attention out, as eager attention computes it
        assert torch.equal(logits, expected), "a cached forward computes HF's eager logits bitwise"
    assert_close(logits, expected, "a cached forward computes HF's logits")
    assert set(ref) - {"logits"} == set(hm.hook_names), "the reference computes every point"
    error = max_error(cache, ref)
    assert error < 1e-5, f"largest difference from the reference {error:.3g}"
    print(f"largest difference from the reference ({family}, {implementation}): {error:.3g}")
    assert_close(ref["logits"], expected, "the reference's logits are HF's")
    # padding keys get no attention, every query row (padding queries too) attends to the real keys
    pattern = cache["pattern", 0]
    assert torch.all(pattern[1, :, :, 4:] == 0) and torch.all(pattern[1, :, :, :4] > 0)
    hm.unwrap()


@pytest.mark.parametrize("family", FAMILIES)
def test_no_hooks_is_hf_forward_and_order_is_firing_order(family):
    assert_wraps_transparently(make_model(family, "sdpa"), inputs(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_and_weights_from_live_parameters(family):
    model, batch, hm = wrapped(family)
    base = base_model(model)
    e, offset = base.embeddings, hm.layout.pos_embed_offset
    assert offset == (PAD["roberta"] + 1 if family == "roberta" else 0)
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch, names_filter=["hook_pos_embed", "hook_embed"])
    valid = batch["attention_mask"].bool()
    t = batch["attention_mask"].cumsum(1) - 1
    assert torch.equal(cache["hook_pos_embed"][valid], hm.W_pos[t[valid]]), "a real token at t reads W_pos[t]"
    assert torch.equal(cache["hook_embed"], hm.W_E[batch["input_ids"]])
    assert hm.W_pos.shape == (e.position_embeddings.num_embeddings - offset, hm.cfg.d_model)
    h, d = hm.cfg.n_heads, hm.cfg.d_head
    for i, layer in enumerate(base.encoder.layer):
        sa = layer.attention.self
        for W, b, lin in ((hm.W_Q, hm.b_Q, sa.query), (hm.W_K, hm.b_K, sa.key), (hm.W_V, hm.b_V, sa.value)):
            assert torch.equal(W[i], lin.weight.T.reshape(-1, h, d).transpose(0, 1))
            assert torch.equal(b[i], lin.bias.view(h, d))
        assert torch.equal(hm.W_O[i], layer.attention.output.dense.weight.T.reshape(h, d, -1))
        assert torch.equal(hm.b_O[i], layer.attention.output.dense.bias)
        assert torch.equal(hm.W_in[i], layer.intermediate.dense.weight.T)
        assert torch.equal(hm.W_out[i], layer.output.dense.weight.T)
    decoder = mlm_head(model)[3]
    assert torch.equal(hm.W_U, decoder.weight.T) and torch.equal(hm.b_U, decoder.bias)
    with torch.no_grad():  # live: an in-place change of a parameter is seen at once
        base.encoder.layer[1].attention.self.query.weight.mul_(2)
        e.position_embeddings.weight[offset].add_(1)
    assert torch.equal(hm.W_Q[1], base.encoder.layer[1].attention.self.query.weight.T.reshape(-1, h, d).transpose(0, 1))
    assert torch.equal(hm.W_pos[0], e.position_embeddings.weight[offset])
    hm.unwrap()


# --- editing --------------------------------------------------------------------------------------------


def _delta(shape: torch.Size, name: str) -> Tensor:
    return 0.5 * torch.randn(shape, generator=torch.Generator().manual_seed(len(name)))


# point -> (module, "out" | "in"): the module whose output or first input the point shows
def plain_sites(model: nn.Module, layer: int) -> dict[str, tuple[nn.Module, str]]:
    e = base_model(model).embeddings
    blk = base_model(model).encoder.layer[layer]
    pre = f"blocks.{layer}."
    return {
        "hook_embed": (e.word_embeddings, "out"),
        "embed.hook_token_type_embed": (e.token_type_embeddings, "out"),
        "hook_pos_embed": (e.position_embeddings, "out"),
        "embed.ln.hook_normalized": (e.LayerNorm, "out"),
        "hook_full_embed": (e, "out"),
        pre + "hook_resid_pre": (blk, "in"),
        pre + "attn.hook_q": (blk.attention.self.query, "out"),
        pre + "attn.hook_k": (blk.attention.self.key, "out"),
        pre + "attn.hook_v": (blk.attention.self.value, "out"),
        pre + "attn.hook_z": (blk.attention.output.dense, "in"),
        pre + "hook_attn_out": (blk.attention.output.dropout, "out"),
        pre + "hook_resid_mid": (blk.attention.output.LayerNorm, "in"),
        pre + "ln1.hook_normalized": (blk.attention.output.LayerNorm, "out"),
        pre + "hook_mlp_in": (blk.intermediate.dense, "in"),
        pre + "mlp.hook_pre": (blk.intermediate.dense, "out"),
        pre + "mlp.hook_post": (blk.output.dense, "in"),
        pre + "hook_mlp_out": (blk.output.dense, "out"),
        pre + "hook_resid_post": (blk.output.LayerNorm, "in"),
        pre + "ln2.hook_normalized": (blk.output.LayerNorm, "out"),
        pre + "hook_normalized_resid_post": (blk, "out"),
        "mlm_head.ln.hook_normalized": (mlm_head(model)[2], "out"),
    }


def _plain_hook(module: nn.Module, where: str, delta: Tensor) -> Any:
    def add(t: Tensor) -> Tensor:  # a point shows heads split, or a broadcast row per batch element
        return t + delta.reshape(delta.shape[0], *t.shape[1:])

    if where == "out":

        def out_hook(m: nn.Module, args: tuple, output: Any) -> Any:
            if isinstance(output, tuple):
                return (add(output[0]),) + output[1:]
            return add(output)

        return module.register_forward_hook(out_hook)

    def in_hook(m: nn.Module, args: tuple, kwargs: dict) -> Any:
        if args:
            return (add(args[0]),) + args[1:], kwargs
        key = next(iter(kwargs))
        return args, {**kwargs, key: add(kwargs[key])}

    return module.register_forward_pre_hook(in_hook, with_kwargs=True)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_edits_equal_plain_pytorch_hooks(family, implementation):
    """Adding a delta at a point gives exactly the logits of adding it to the module's tensor with a plain hook."""
    model, batch, hm = wrapped(family, implementation)
    with torch.no_grad():
        base_logits = model(**batch).logits
        _, cache = hm.run_with_cache(**batch)
        layers = (0, 1) if implementation == "eager" else (1,)  # sdpa: the last block's points
        for layer in layers:
            for name, (module, where) in plain_sites(model, layer).items():
                if not name.startswith("blocks.") and layer != layers[0]:
                    continue  # the embedding and head points once
                delta = _delta(cache[name].shape, name)
                edited = hm.run_with_hooks(**batch, fwd_hooks=[(name, lambda t, hook, d=delta: t + d)])
                handle = _plain_hook(module, where, delta)
                try:
                    plain = model(**batch).logits
                finally:
                    handle.remove()
                assert not torch.equal(plain, base_logits), f"{name}: the edit changes the logits"
                assert torch.equal(edited, plain), (
                    f"{name}: {(edited - plain).abs().max().item():.3g} from the plain hook"
                )
    hm.unwrap()


@pytest.mark.parametrize("family", FAMILIES)
def test_scale_score_and_pattern_edits_match_the_reference(family):
    """Edits without a module boundary (norm scales, scores, patterns) against the reference computing with them."""
    model, batch, hm = wrapped(family, "sdpa", seed=1)

    def double(t: Tensor, hook: Any = None) -> Tensor:
        return t * 2

    def sharpen(t: Tensor, hook: Any = None) -> Tensor:
        return t * torch.linspace(0.5, 1.5, t.shape[-1])

    def reweigh(t: Tensor, hook: Any = None) -> Tensor:
        return t * torch.linspace(1.0, 2.0, t.shape[-1])

    cases = {
        "embed.ln.hook_scale": double,
        "blocks.0.ln1.hook_scale": double,
        "blocks.1.ln2.hook_scale": double,
        "mlm_head.ln.hook_scale": double,
        "blocks.0.attn.hook_attn_scores": sharpen,
        "blocks.1.attn.hook_pattern": reweigh,
        "blocks.0.hook_attn_in": double,
        "blocks.1.hook_q_input": double,
        "blocks.0.hook_k_input": double,
        "blocks.1.hook_v_input": double,
        "blocks.0.attn.hook_result": reweigh,
    }
    with torch.no_grad():
        base_logits = model(**batch).logits
        for name, fn in cases.items():
            edited = hm.run_with_hooks(**batch, fwd_hooks=[(name, fn)])
            expected = reference(model, batch, {name: fn})["logits"]
            assert not torch.allclose(edited, base_logits), name
            assert_close(edited, expected, f"{name} edit against the reference")
    hm.unwrap()


# --- the analysis layer and refusals ---------------------------------------------------------------------


def test_analysis_layer_and_named_refusals():
    model, batch, hm = wrapped("bert")
    with torch.no_grad():
        _, cache = hm.run_with_cache(**batch)
    stack = cache.accumulated_resid()
    assert torch.equal(stack[-1], cache["blocks.1.hook_normalized_resid_post"]), "the final stream is the block output"
    assert torch.equal(stack[1], cache["blocks.1.hook_resid_pre"])
    with pytest.raises(DecompositionUndefinedError, match="post-LN"):
        cache.decompose_resid()
    with pytest.raises(DecompositionUndefinedError, match="post-LN"):
        cache.get_full_resid_decomposition()
    with pytest.raises(NotCausalError, match="bidirectionally"):
        hm(batch["input_ids"], return_type="loss")
    with pytest.raises(NotCausalError, match="generate"):
        hm.generate(batch["input_ids"], max_new_tokens=1)
    # activation patching with the encoder's inputs: patching a clean run's residual into itself changes nothing,
    # patching it into a corrupted run at every position of a layer restores the clean logits
    corrupted = {**batch, "input_ids": batch["input_ids"].flip(1)}
    with torch.no_grad():
        clean = model(**batch).logits
        name = "blocks.1.hook_resid_pre"
        patched = hm.run_with_hooks(**corrupted, fwd_hooks=[(name, lambda t, hook: cache[name])])
    assert torch.equal(patched, clean)
    hm.unwrap()


def test_stop_at_layer_and_encoders_without_a_head():
    model, batch, hm = wrapped("bert", cls=BertModel)
    assert "mlm_head.ln.hook_scale" not in hm.hook_names
    with torch.no_grad():
        out = model(**batch).last_hidden_state
        _, cache = hm.run_with_cache(**batch)
        stopped = hm(
            batch["input_ids"],
            token_type_ids=batch["token_type_ids"],
            one_zero_attention_mask=batch["attention_mask"],
            stop_at_layer=1,
        )
    assert torch.equal(cache["blocks.1.hook_normalized_resid_post"], out)
    assert torch.equal(stopped, cache["blocks.1.hook_resid_pre"])
    with pytest.raises(AttributeError):
        _ = hm.W_U
    hm.unwrap()


@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_lens_style_call_keeps_the_encoders_positions(family):
    """A TransformerLens-style call (HookedEncoder's keywords) computes HF's logits on padded inputs: an encoder's
    positions are its own (RoBERTa's from the token ids), not counted from the mask as for a causal LM."""
    model, batch, hm = wrapped(family)
    with torch.no_grad():
        expected = model(**batch).logits
        logits = hm(
            batch["input_ids"],
            return_type="logits",
            token_type_ids=batch["token_type_ids"],
            one_zero_attention_mask=batch["attention_mask"],
        )
    assert torch.equal(logits, expected)
    hm.unwrap()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(is_decoder=True), "is_decoder=True"),
        (dict(position_embedding_type="relative_key"), "relative_key"),
    ],
)
def test_refused_configurations(change, message):
    config = BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, **change
    )
    model = BertForMaskedLM(config).eval()
    with pytest.raises(UnsupportedModelError, match=message):
        HookedModel.wrap(model)


def test_tiny_configs_wrap():
    for seed in range(4):
        config = lensadapters_bert.lensadapters_tiny_config(arch=lensadapters_bert.ARCH, seed=seed)
        model = (BertForMaskedLM if config.model_type == "bert" else RobertaForMaskedLM)(config).eval()
        hm = HookedModel.wrap(model)
        assert hm.cfg.model_type == config.model_type and hm.cfg.n_layers == config.num_hidden_layers
        hm.unwrap()


# --- TransformerLens 2.18's HookedEncoder on the same weights ----------------------------------------------

TL_NAMES = {"hook_embed": "embed.hook_embed", "hook_pos_embed": "embed.hook_pos_embed"}


def hooked_encoder(model: BertForMaskedLM) -> Any:
    """TransformerLens' HookedEncoder with the model's weights, converted by TransformerLens' own BERT conversion
    (``from_pretrained`` would fetch the checkpoint's config from the Hub; the pooler and NSP head, which a masked-LM
    model lacks and nothing here reads, get placeholders)."""
    from types import SimpleNamespace as NS

    from transformer_lens import HookedEncoder, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.bert import convert_bert_weights

    c = model.config
    cfg = HookedTransformerConfig(
        **hf.config_sizes(c, d_head=c.hidden_size // c.num_attention_heads),
        act_fn="gelu",
        normalization_type="LN",
        attention_dir="bidirectional",
        original_architecture="BertForMaskedLM",
        eps=c.layer_norm_eps,
        device="cpu",
    )
    d = c.hidden_size
    source = NS(
        bert=NS(embeddings=model.bert.embeddings, encoder=model.bert.encoder, pooler=NS(dense=nn.Linear(d, d))),
        cls=NS(predictions=model.cls.predictions, seq_relationship=nn.Linear(d, 2)),
    )
    tl = HookedEncoder(cfg, move_to_device=False)
    tl.load_state_dict(convert_bert_weights(source, cfg), strict=False)
    return tl.eval()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_matches_transformer_lens_hooked_encoder(implementation):
    pytest.importorskip("transformer_lens")
    model = make_model("bert", implementation, seed=2)
    batch = inputs("bert", seed=2)
    tl = hooked_encoder(model)
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        tl_logits, tl_cache = tl.run_with_cache(
            batch["input_ids"], token_type_ids=batch["token_type_ids"], one_zero_attention_mask=batch["attention_mask"]
        )
        logits, cache = hm.run_with_cache(**batch)
    shared = [n for n in hm.hook_names if TL_NAMES.get(n, n) in tl_cache.cache_dict]
    assert len(shared) == len(tl_cache.cache_dict), "every HookedEncoder point is served"
    worst = 0.0
    keys = batch["attention_mask"].bool()[:, None, None, :]
    for name in shared:
        ours, theirs = cache[name], tl_cache[TL_NAMES.get(name, name)]
        assert ours.shape == theirs.shape, name
        if name.endswith("hook_attn_scores"):  # TransformerLens adds a large negative number where we put -inf
            ours, theirs = ours.masked_select(keys.expand_as(ours)), theirs.masked_select(keys.expand_as(theirs))
        worst = max(worst, (ours - theirs).abs().max().item())
        assert_close(ours, theirs, f"{name} against HookedEncoder")
    assert_close(logits, tl_logits, "logits against HookedEncoder")
    worst = max(worst, (logits - tl_logits).abs().max().item())
    assert worst < 1e-4
    print(f"largest difference from HookedEncoder ({implementation}): {worst:.3g}")
    hm.unwrap()
