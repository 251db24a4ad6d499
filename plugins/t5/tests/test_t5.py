"""T5 encoder-decoders: every point against a reference written from the Hugging Face modules, every edit and its
gradient against the same edit made in that reference, edits against plain PyTorch hooks, and (under transformers
4.57 with TransformerLens 2.18 installed) every shared point and the logits against TransformerLens'
``HookedEncoderDecoder`` on the same weights. The forward without hooks (bitwise Hugging Face's), the firing order,
``unwrap`` and patching are the contract's (``test_t5_contract.py``).

Tiny models (width 16, 2 layers of each stack, 2 heads) with unit-scale weights (``lensadapters.testing.reinit``);
nothing is built at import.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lensadapters_t5
import pytest
import torch
import transformers
from torch import Tensor, nn
from transformers import T5Config, T5ForConditionalGeneration

from lensadapters import HookedModel, hf
from lensadapters.testing import assert_close
from lensadapters.testing.encoder_decoder import (
    ReferencePoints,
    check_edits_against_reference,
    check_edits_match_plain_hooks,
    check_generation_with_hooks,
    check_one_stack_refusals,
    check_points_against_reference,
    check_reference_patterns,
    logits_of,
    tiny_batch,
)
from lensadapters.testing.models import reinit

TRANSFORMERS_4 = transformers.__version__.startswith("4.")
#: transformers 4.x's T5 computes attention in its own code (eager only)
IMPLEMENTATIONS = ("eager",) if TRANSFORMERS_4 else ("eager", "sdpa")
MLPS = ("relu", "gated-gelu")


def make_model(mlp: str = "relu", implementation: str = "eager", seed: int = 0, tied: bool = True) -> nn.Module:
    config = T5Config(
        vocab_size=40,
        d_model=16,
        d_kv=8,
        d_ff=24,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=12,
        feed_forward_proj=mlp,
        tie_word_embeddings=tied,
        **lensadapters_t5.TINY_FIELDS,
    )
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration._from_config(config, attn_implementation=implementation)
    reinit(model, seed)
    return model.eval()


def inputs(seed: int = 0) -> dict[str, Tensor]:
    """Two encoder rows of 7 tokens, the second right-padded by 3 (pad id 0), and decoder rows of 5 tokens (the
    start token 0 first)."""
    return tiny_batch(seed, pad=0, start=0, low=2)


def reference(model: Any, batch: dict[str, Tensor], edits: Optional[dict[str, Callable]] = None) -> dict:
    """Every HookedEncoderDecoder point, computed step by step from the model's modules; ``edits`` (point -> fn)
    change a point's value where it is computed. RMS norms, attention (``q kᵀ`` unscaled, plus the relative position
    bias from each stack's layer-0 table, plus the additive mask: ``finfo.min`` at padding keys and, in the decoder's
    self-attention, at later positions) and the MLPs are written out."""
    out = ReferencePoints(edits)
    at = out.at
    c = model.config
    h, d = c.num_heads, c.d_kv
    lowest = torch.finfo(torch.float32).min

    def norm(prefix: str, ln: Any, x: Tensor) -> Tensor:
        scale = at(f"{prefix}.hook_scale", (x.pow(2).mean(-1, keepdim=True) + ln.variance_epsilon).sqrt())
        return at(f"{prefix}.hook_normalized", x / scale) * ln.weight

    def attention(prefix: str, attn: Any, x: Tensor, kv: Tensor, bias: Tensor) -> Tensor:
        b, p = x.shape[:2]
        q, k, v = (at(f"{prefix}.hook_{n}", getattr(attn, n)(y).view(b, -1, h, d)) for n, y in zip("qkv", (x, kv, kv)))
        scores = at(f"{prefix}.hook_attn_scores", torch.einsum("bqhd,bkhd->bhqk", q, k) + bias)
        pattern = at(f"{prefix}.hook_pattern", scores.softmax(-1))
        z = at(f"{prefix}.hook_z", torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return attn.o(z.reshape(b, p, h * d))

    def mlp(prefix: str, dense: Any, x: Tensor) -> Tensor:
        if hasattr(dense, "wi_0"):
            pre = at(f"{prefix}.mlp.hook_pre", dense.wi_0(x))
            post = dense.act(pre) * at(f"{prefix}.mlp.hook_pre_linear", dense.wi_1(x))
        else:
            post = dense.act(at(f"{prefix}.mlp.hook_pre", dense.wi(x)))
        return dense.wo(at(f"{prefix}.mlp.hook_post", post))

    def stack(
        name: str, x: Tensor, self_mask: Tensor, memory: Optional[Tensor], cross_mask: Optional[Tensor]
    ) -> Tensor:
        module = getattr(model, name)
        p = x.shape[1]
        bias = module.block[0].layer[0].SelfAttention.compute_bias(p, p) + self_mask
        for i, block in enumerate(module.block):
            pre = f"{name}.{i}"
            x = at(f"{pre}.hook_resid_pre", x)
            attn_out = at(
                f"{pre}.hook_attn_out",
                attention(
                    f"{pre}.attn",
                    block.layer[0].SelfAttention,
                    *[norm(f"{pre}.ln1", block.layer[0].layer_norm, x)] * 2,
                    bias,
                ),
            )
            x = at(f"{pre}.hook_resid_mid", x + attn_out)
            if memory is not None:
                cross = block.layer[1]
                normed = norm(f"{pre}.ln2", cross.layer_norm, x)
                cross_out = at(
                    f"{pre}.hook_cross_attn_out",
                    attention(f"{pre}.cross_attn", cross.EncDecAttention, normed, memory, cross_mask),
                )
                x = at(f"{pre}.hook_resid_mid_cross", x + cross_out)
            ff = block.layer[-1]
            normed = norm(f"{pre}.ln3" if memory is not None else f"{pre}.ln2", ff.layer_norm, x)
            x = at(f"{pre}.hook_resid_post", x + at(f"{pre}.hook_mlp_out", mlp(pre, ff.DenseReluDense, normed)))
        return norm(f"{name}_final_ln", module.final_layer_norm, x)

    ids, mask, decoder = batch["input_ids"], batch["attention_mask"], batch["decoder_input_ids"]
    padding = ((1 - mask) * lowest)[:, None, None, :].float()
    q = decoder.shape[1]
    causal = torch.zeros(q, q).masked_fill(~torch.ones(q, q, dtype=torch.bool).tril(), lowest)
    memory = stack("encoder", at("hook_embed", model.shared(ids)), padding, None, None)
    final = stack("decoder", at("decoder.hook_embed", model.shared(decoder)), causal, memory, padding)
    out["logits"] = model.lm_head(final * lensadapters_t5.unembed_scale(model))
    return out


# --- reading ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("mlp", MLPS)
def test_every_point_matches_the_reference(mlp, implementation):
    model = make_model(mlp, implementation)
    batch = inputs()
    hm = HookedModel.wrap(model)
    cache, worst = check_points_against_reference(hm, batch, reference, eager=implementation == "eager")
    print(f"largest difference from the reference ({mlp}, {implementation}): {worst:.3g}")
    # padding keys get no attention, the decoder attends causally, the cross-attention to the real encoder tokens
    check_reference_patterns(cache)
    hm.unwrap()


# --- editing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mlp", MLPS)
def test_every_edit_and_its_gradient_match_the_reference(mlp):
    """Edits at every point at once (``nudge(t) + delta_j * t``) change the logits as the same edits in the reference
    do, and the gradient of the logits with respect to each point's ``delta_j`` is the reference's."""
    model = make_model(mlp, IMPLEMENTATIONS[-1], seed=1)
    batch = inputs(1)
    hm = HookedModel.wrap(model)
    worst, worst_grad = check_edits_against_reference(hm, batch, reference)
    print(f"largest edit difference ({mlp}): logits {worst:.3g}, gradients (relative) {worst_grad:.3g}")
    hm.unwrap()


def test_edits_match_plain_pytorch_hooks():
    """An edit through a point is the same edit made by a plain PyTorch hook on the module, bit for bit."""
    model = make_model("gated-gelu")
    batch = inputs()
    hm = HookedModel.wrap(model)
    dec = model.decoder.block[1]
    cases = [
        ("decoder.1.hook_mlp_out", dec.layer[2].dropout, "output"),
        ("decoder.1.hook_cross_attn_out", dec.layer[1].dropout, "output"),
        ("encoder.0.attn.hook_v", model.encoder.block[0].layer[0].SelfAttention.v, "output"),
        ("decoder.0.mlp.hook_post", model.decoder.block[0].layer[2].DenseReluDense.wo, "input"),
        ("encoder.1.hook_resid_pre", model.encoder.block[1], "input"),
    ]
    check_edits_match_plain_hooks(hm, batch, cases)
    hm.unwrap()


# --- the unembedding, the calls, generation -----------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_unembedding_scale(tied):
    """T5ForConditionalGeneration multiplies the final norm's output by ``d_model**-0.5`` before ``lm_head`` when it
    ties its embeddings (transformers 4.x: ``tie_word_embeddings``; 5.x: ``scale_decoder_outputs``)."""
    model = make_model(tied=tied)
    batch = inputs()
    hm = HookedModel.wrap(model)
    assert hm.cfg.extra["unembed_scale"] == (16**-0.5 if tied else 1.0)
    with torch.no_grad():
        logits, cache = hm.run_with_cache(**batch, names_filter="decoder_final_ln.hook_normalized")
        final = cache["decoder_final_ln.hook_normalized"] * model.decoder.final_layer_norm.weight
        assert_close(final * hm.cfg.extra["unembed_scale"] @ hm.W_U, logits_of(logits), "logits from W_U")
    assert torch.equal(hm.W_U, model.lm_head.weight.T)
    hm.unwrap()


def test_generate_with_hooks_and_cached_patterns():
    """Hugging Face's ``generate`` runs with the hooks attached (with its key/value cache): an ablation at a decoder
    point changes what is generated exactly as a plain PyTorch hook does, and patterns can be read at every step."""
    model = make_model("gated-gelu", IMPLEMENTATIONS[-1], seed=3)
    hm = HookedModel.wrap(model)
    ours, plain = check_generation_with_hooks(hm, inputs(3), model.decoder.block[1].layer[2].dropout)
    hm.unwrap()


def test_analysis_layer_and_named_refusals():
    """Caches and patching work with the encoder-decoder's inputs; TransformerLens' one-stack methods are refused by
    name (HookedEncoderDecoder defines none of them), and so are the causal LM's loss and TransformerLens' decoder-only
    generate."""
    model = make_model()
    batch = inputs()
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        loss = hm(**batch, labels=batch["decoder_input_ids"]).loss  # the model's own loss
        assert torch.equal(loss, model(**batch, labels=batch["decoder_input_ids"]).loss)
    # patching the clean encoder output into a run on other encoder tokens restores the clean logits
    corrupted = {**batch, "input_ids": batch["input_ids"].flip(1) * batch["attention_mask"]}
    check_one_stack_refusals(hm, batch, corrupted, "encoder.1.hook_resid_post")
    assert torch.equal(hm.W_E, model.shared.weight)
    hm.unwrap()


def test_transformer_lens_style_call():
    """HookedEncoderDecoder's call: ``hm(input, decoder_input=..., one_zero_attention_mask=...)`` computes Hugging
    Face's logits, ``run_with_cache`` takes it too; without decoder tokens, or with HookedTransformer's layer
    keywords, it is refused by name."""
    from lensadapters.api.tl_call import TransformerLensKeywordError

    model = make_model()
    batch = inputs()
    hm = HookedModel.wrap(model)
    ids, mask, decoder = batch["input_ids"], batch["attention_mask"], batch["decoder_input_ids"]
    with torch.no_grad():
        expected = model(**batch).logits
        assert torch.equal(hm(ids, decoder_input=decoder, one_zero_attention_mask=mask), expected)
        logits, cache = hm.run_with_cache(ids, decoder_input=decoder, one_zero_attention_mask=mask)
        _, hf_cache = hm.run_with_cache(**batch)
    assert torch.equal(logits, expected)
    assert torch.equal(cache["decoder.1.cross_attn.hook_pattern"], hf_cache["decoder.1.cross_attn.hook_pattern"])
    with pytest.raises(ValueError, match="decoder_input"):
        hm(ids, one_zero_attention_mask=mask)
    with pytest.raises(TransformerLensKeywordError, match="HookedEncoderDecoder has neither"):
        hm(ids, decoder_input=decoder, stop_at_layer=1)
    hm.unwrap()


def test_tiny_configs_wrap():
    for seed in range(4):
        config = lensadapters_t5.lensadapters_tiny_config(arch=lensadapters_t5.ARCH, seed=seed)
        hm = HookedModel.wrap(T5ForConditionalGeneration(config).eval())
        assert hm.cfg.n_layers == config.num_layers and hm.cfg.gated_mlp == config.is_gated_act
        assert ("encoder.0.mlp.hook_pre_linear" in hm.hook_names) == config.is_gated_act
        hm.unwrap()


# --- TransformerLens 2.18's HookedEncoderDecoder on the same weights ---------------------------------------------


def hooked_encoder_decoder(model: Any) -> Any:
    """TransformerLens' HookedEncoderDecoder with the model's weights, converted by TransformerLens' own T5
    conversion, with the config TransformerLens' loader derives from a T5 config (``from_pretrained`` would fetch
    the checkpoint from the Hub)."""
    from transformer_lens import HookedEncoderDecoder, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.t5 import convert_t5_weights

    c = model.config
    cfg = HookedTransformerConfig(
        # TransformerLens takes the config's max_length for n_ctx; relative positions have no table
        **hf.config_sizes(c, d_mlp=c.d_ff, n_ctx=512),
        eps=c.layer_norm_epsilon,
        act_fn=c.feed_forward_proj,
        positional_embedding_type="relative_positional_bias",
        relative_attention_max_distance=c.relative_attention_max_distance,
        relative_attention_num_buckets=c.relative_attention_num_buckets,
        decoder_start_token_id=c.decoder_start_token_id,
        attention_dir="bidirectional",
        use_attn_scale=False,
        tie_word_embeddings=c.tie_word_embeddings,
        original_architecture="T5ForConditionalGeneration",
        normalization_type="RMS",
        device="cpu",
    )
    tl = HookedEncoderDecoder(cfg, move_to_device=False)
    tl.load_state_dict(convert_t5_weights(model, cfg), strict=False)
    return tl.eval()


@pytest.mark.parametrize("decoder_length", [1, 5])
def test_matches_transformer_lens_hooked_encoder_decoder(decoder_length):
    """Every point HookedEncoderDecoder has, and the logits, on the same weights. With one decoder token the two
    agree everywhere; with more, TransformerLens 2.18's decoder self-attention is bidirectional (no causal mask,
    bidirectional position buckets) where Hugging Face's T5 is causal: the encoder's points still agree, and the
    decoder's follow Hugging Face (checked against the reference above), not TransformerLens."""
    pytest.importorskip("transformer_lens")
    model = make_model(seed=2)
    batch = inputs(2)
    batch["decoder_input_ids"] = batch["decoder_input_ids"][:, :decoder_length]
    tl = hooked_encoder_decoder(model)
    hm = HookedModel.wrap(model)
    with torch.no_grad():
        tl_logits, tl_cache = tl.run_with_cache(
            batch["input_ids"], batch["decoder_input_ids"], one_zero_attention_mask=batch["attention_mask"]
        )
        logits, cache = hm.run_with_cache(  # HookedEncoderDecoder's call
            batch["input_ids"],
            decoder_input=batch["decoder_input_ids"],
            one_zero_attention_mask=batch["attention_mask"],
        )
    shared = [n for n in hm.hook_names if n in tl_cache.cache_dict]
    assert set(shared) == set(tl_cache.cache_dict), "every HookedEncoderDecoder point is served"
    compared = shared if decoder_length == 1 else [n for n in shared if not n.startswith("decoder")]
    worst = 0.0
    for name in compared:
        ours, theirs = cache[name], tl_cache[name]
        assert ours.shape == theirs.shape, name
        worst = max(worst, (ours - theirs).abs().max().item())
        assert_close(ours, theirs, f"{name} against HookedEncoderDecoder")
    if decoder_length == 1:
        assert_close(logits, tl_logits, "logits against HookedEncoderDecoder")
        worst = max(worst, (logits - tl_logits).abs().max().item())
    else:  # TransformerLens' decoder attends to later decoder positions; Hugging Face's does not
        assert not torch.allclose(cache["decoder.0.attn.hook_pattern"], tl_cache["decoder.0.attn.hook_pattern"])
        later = torch.ones(decoder_length, decoder_length, dtype=torch.bool).triu(1)
        assert torch.all(tl_cache["decoder.0.attn.hook_pattern"][..., later] > 0)
    assert worst < 1e-4
    print(
        f"largest difference from HookedEncoderDecoder ({len(compared)} points, decoder length "
        f"{decoder_length}): {worst:.3g}"
    )
    hm.unwrap()
