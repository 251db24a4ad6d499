"""Llama: the contract suite over random tiny Llama configs, plus Llama's own quirks.

Coverage of the random configs: GQA ratios 1, 2, 3 and multi-query attention (one kv head),
``head_dim`` different from ``hidden_size / num_attention_heads``, every rope type of transformers'
Llama (default, linear, dynamic, llama3, yarn, longrope), tied and untied embeddings,
``attention_bias`` and ``mlp_bias``; inputs are left-padded batches.
"""

from __future__ import annotations

import math
from typing import Any

import lensadapters_llama
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lensadapters_llama.testing import (
    LlamaContract,
    left_padded,
    llama_config,
    llama_configs,
    make,
    wrap,
)
from transformers import LlamaConfig

from lensadapters import UnsupportedModelError
from lensadapters.testing import assert_close, reference_rope
from lensadapters.testing.plugins import assert_entry_point


class TestLlama(LlamaContract):
    """The plugin's contract suite (``lensadapters_llama.testing``, also run by ``lensadapters check llama``) over
    the coverage above; the edit and generation properties also run on llama3 rope scaling on every run."""


# --- an independent RoPE reference ------------------------------------------------------------------


def reference_inv_freq(config: LlamaConfig, rope_type: str, seq_len: int) -> torch.Tensor:
    """Inverse frequencies from the published formulas (float64), not from transformers."""
    d = config.head_dim
    theta = 10000.0
    params = getattr(config, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", theta)))
    scaling = getattr(config, "rope_scaling", None) or params
    exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
    inv = 1.0 / theta**exponents
    if rope_type == "default":
        return inv
    factor = float(scaling["factor"])
    if rope_type == "linear":  # positions divided by the factor
        return inv / factor
    if rope_type == "dynamic":  # NTK-aware base growth beyond max_position_embeddings
        max_pos = config.max_position_embeddings
        if seq_len <= max_pos:
            return inv
        base = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / base**exponents
    if rope_type == "llama3":  # Meta's wavelength-dependent interpolation
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        out = []
        for f in inv.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                out.append(f)
            elif wavelen > old / low:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return torch.tensor(out, dtype=torch.float64)
    raise ValueError(rope_type)


@pytest.mark.parametrize("rope_type", ["default", "linear", "dynamic", "llama3"])
@settings(deadline=None, max_examples=3)
@given(seed=st.integers(0, 2**16), ratio=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([8, 16]))
def test_rot_q_and_rot_k_equal_reference_rope(rope_type, seed, ratio, head_dim):
    """hook_rot_q/k == RoPE(hook_q/k) by an independent complex-number reference, per rope type.

    ``max_position_embeddings`` is below the input length so dynamic NTK scaling actually grows, and
    ``original_max_position_embeddings`` is small so llama3 interpolates low and medium frequencies.
    """
    length = 10
    config = llama_config(
        n_heads=2 * ratio,
        n_kv=2,
        head_dim=head_dim,
        hidden=4 * ratio,
        rope_type=rope_type,
        theta=500000.0 if rope_type == "llama3" else 10000.0,
        max_pos=6,
        original_max=4,
        factor=4.0,
    )
    model = make(config, seed)
    hm = wrap(model)
    ids, mask = left_padded(config.vocab_size, length=length, seed=seed)
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: "attn.hook_" in n)
    inv = reference_inv_freq(config, rope_type, seq_len=length)
    positions = torch.arange(length)[None]  # a forward without position_ids counts from 0 (padding included)
    for name in ("q", "k"):
        expected = reference_rope(cache[name, 0], positions, inv)
        assert_close(cache[f"rot_{name}", 0], expected, f"{rope_type}: hook_rot_{name}", atol=2e-5, rtol=2e-5)
    assert cache["rot_q", 0].shape[2] == 2 * ratio and cache["rot_k", 0].shape[2] == 2
    hm.unwrap()


@pytest.mark.parametrize(
    "rope_type,attention_factor",
    [
        ("yarn", lambda factor, orig: 0.1 * math.log(factor) + 1.0),
        ("longrope", lambda factor, orig: math.sqrt(1 + math.log(factor) / math.log(orig))),
    ],
)
def test_rope_attention_scaling_is_in_rot_q(rope_type, attention_factor):
    """YaRN and LongRoPE fold an attention factor into cos/sin: hook_rot_q carries it (pair norms scale)."""
    config = llama_config(
        n_heads=4, n_kv=2, head_dim=8, hidden=16, rope_type=rope_type, max_pos=32, original_max=4, factor=8.0
    )
    model = make(config, 1)
    hm = wrap(model)
    ids, mask = left_padded(config.vocab_size, length=9)
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: "attn.hook_" in n)
    scaling = getattr(config, "rope_scaling", None) or config.rope_parameters
    expected = attention_factor(float(scaling["factor"]), 4)
    assert expected != pytest.approx(1.0)
    for name in ("q", "k"):
        x, y = cache[name, 0], cache[f"rot_{name}", 0]
        pair_norm = lambda t: t[..., :4].pow(2) + t[..., 4:].pow(2)  # noqa: E731
        assert_close(
            pair_norm(y),
            expected**2 * pair_norm(x),
            f"{rope_type}: |rot_{name}| = factor * |{name}|",
            atol=1e-4,
            rtol=1e-4,
        )
    hm.unwrap()


def test_rot_q_and_rot_k_are_bitwise_what_attention_receives():
    """hook_rot_q/k are the very tensors Llama hands to its attention function (same ops, same order)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    received: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        received.append((query.transpose(1, 2), key.transpose(1, 2)))  # -> [b, p, h, d]
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("lensadapters_test_capture", capture)
    AttentionMaskInterface.register("lensadapters_test_capture", AttentionMaskInterface._global_mapping["sdpa"])
    config = llama_config(n_heads=6, n_kv=2, head_dim=8, hidden=12, layers=2, rope_type="llama3", theta=500000.0)
    model = make(config, 2)
    hm = wrap(model)
    model.config._attn_implementation = "lensadapters_test_capture"
    ids, mask = left_padded(config.vocab_size)
    try:
        with torch.no_grad():
            _, cache = hm.run_with_cache(ids, attention_mask=mask, names_filter=lambda n: "hook_rot_" in n)
    finally:
        model.config._attn_implementation = "sdpa"
    assert len(received) == 2
    for layer, (query, key) in enumerate(received):
        assert torch.equal(cache["rot_q", layer], query) and torch.equal(cache["rot_k", layer], key)
    hm.unwrap()


# --- attention: scores, GQA heads -------------------------------------------------------------------


@settings(deadline=None, max_examples=6)
@given(config=llama_configs(), seed=st.integers(0, 2**16))
def test_scores_are_rotated_queries_dot_shared_keys(config, seed):
    """hook_attn_scores[h] == rot_q[h] . rot_k[h // ratio] / sqrt(d_head): query heads share kv heads in groups."""
    model = make(config, seed)
    hm = wrap(model)
    ids, mask = left_padded(config.vocab_size, length=7, seed=seed)
    ratio = hm.cfg.n_heads // hm.cfg.n_key_value_heads
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, attention_mask=mask)
    valid = mask.bool()
    for layer in range(hm.cfg.n_layers):
        rot_q, rot_k = cache["rot_q", layer], cache["rot_k", layer]
        scores, pattern = cache["attn_scores", layer], cache["pattern", layer]
        for head in range(hm.cfg.n_heads):
            expected = torch.einsum("bqd,bkd->bqk", rot_q[:, :, head], rot_k[:, :, head // ratio]) / math.sqrt(
                hm.cfg.d_head
            )
            allowed = torch.isfinite(scores[:, head])
            assert_close(scores[:, head][allowed], expected[allowed], f"layer {layer} head {head} scores")
            probs = torch.softmax(expected.masked_fill(~allowed, float("-inf")), -1)
            assert_close(pattern[:, head][valid], probs[valid], f"layer {layer} head {head} pattern")
    hm.unwrap()


@pytest.mark.parametrize("n_heads,n_kv", [(2, 2), (4, 2), (6, 2), (3, 1), (16, 2)])
def test_editing_one_kv_head_changes_exactly_its_query_group(n_heads, n_kv):
    """A key head feeds query heads [j*ratio, (j+1)*ratio): MHA, GQA 2 and 3, MQA, and Llama 2 70B's ratio 8."""
    ratio = n_heads // n_kv
    config = llama_config(n_heads=n_heads, n_kv=n_kv, head_dim=8, hidden=2 * n_heads)
    model = make(config, 3)
    hm = wrap(model)
    ids, mask = left_padded(config.vocab_size, length=6)
    kv_head = n_kv - 1

    def bump(k: torch.Tensor, hook: Any) -> torch.Tensor:
        k = k.clone()
        k[:, :, kv_head] *= 3.0
        return k

    with torch.no_grad():
        _, base = hm.run_with_cache(ids, attention_mask=mask, names_filter="blocks.0.attn.hook_pattern")
        with hm.hooks([("blocks.0.attn.hook_k", bump)]):
            _, edited = hm.run_with_cache(ids, attention_mask=mask, names_filter="blocks.0.attn.hook_pattern")
    changed = [
        (edited["pattern", 0][:, h] - base["pattern", 0][:, h]).abs().max().item() > 1e-6 for h in range(hm.cfg.n_heads)
    ]
    assert changed == [h // ratio == kv_head for h in range(hm.cfg.n_heads)]
    hm.unwrap()


# --- RMSNorm --------------------------------------------------------------------------------------


def test_rms_norm_points_have_transformerlens_semantics():
    """scale = sqrt(mean(x^2) + eps); normalized = x / scale (before the weight); the norm outputs normalized * w."""
    config = llama_config(eps=1e-5)
    model = make(config, 4)
    hm = wrap(model)
    ids, mask = left_padded(config.vocab_size)
    outputs = {}
    handle = model.model.layers[0].input_layernorm.register_forward_hook(lambda m, a, o: outputs.setdefault("ln1", o))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, attention_mask=mask)
    handle.remove()
    x = cache["resid_pre", 0]
    scale = (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert_close(cache["blocks.0.ln1.hook_scale"], scale, "ln1.hook_scale")
    assert_close(cache["blocks.0.ln1.hook_normalized"], x / scale, "ln1.hook_normalized")
    weight = model.model.layers[0].input_layernorm.weight
    assert_close(cache["blocks.0.ln1.hook_normalized"] * weight, outputs["ln1"], "normalized * weight == ln1 output")
    hm.unwrap()


# --- the Llama 3.2 3B shape, scaled down ------------------------------------------------------------


def test_llama32_3b_like_shapes_and_weights(llama32):
    model = llama32
    ids, mask = left_padded(256, length=9)
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        hm = wrap(model)
        assert torch.equal(hm(ids, attention_mask=mask).logits, reference)
        _, cache = hm.run_with_cache(ids, attention_mask=mask)
    cfg = hm.cfg
    assert (cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model, cfg.d_vocab) == (24, 8, 128, 96, 256)
    assert cfg.extra["rope_theta"] == 500000.0 and cfg.extra["rope_type"] == "llama3"
    assert cfg.normalization_type == "RMS" and cfg.gated_mlp and cfg.positional_embedding_type == "rotary"
    assert cache["q", 0].shape == (2, 9, 24, 128) and cache["rot_q", 0].shape == (2, 9, 24, 128)
    assert cache["k", 0].shape == (2, 9, 8, 128) and cache["v", 0].shape == (2, 9, 8, 128)
    assert cache["rot_k", 0].shape == (2, 9, 8, 128)
    assert cache["pattern", 0].shape == (2, 24, 9, 9) and cache["z", 0].shape == (2, 9, 24, 128)
    assert hm.W_Q.shape == hm.W_K.shape == hm.W_V.shape == (2, 24, 96, 128)
    assert hm._W_K.shape == hm._W_V.shape == (2, 8, 96, 128)
    assert torch.equal(hm.W_K[:, 3:6], hm._W_K[:, 1:2].expand(-1, 3, -1, -1))  # heads 3, 4, 5 read kv head 1
    assert hm.W_O.shape == (2, 24, 128, 96)
    assert hm.W_gate.shape == hm.W_in.shape == (2, 96, 256) and hm.W_out.shape == (2, 256, 96)
    assert torch.equal(hm.W_gate[0], model.model.layers[0].mlp.gate_proj.weight.T)
    assert torch.equal(hm.W_in[0], model.model.layers[0].mlp.up_proj.weight.T)
    # tied embeddings: W_U is W_E transposed, the same storage
    assert torch.equal(hm.W_U, hm.W_E.T) and hm.W_U.data_ptr() == hm.W_E.data_ptr()
    # hook_q == (hook_normalized * ln1.weight) @ W_Q, per head
    attn_in = cache["blocks.1.ln1.hook_normalized"] * model.model.layers[1].input_layernorm.weight
    assert_close(cache["q", 1], torch.einsum("bpm,hmd->bphd", attn_in, hm.W_Q[1]) + hm.b_Q[1], "hook_q identity")
    assert_close(cache["k", 1], torch.einsum("bpm,hmd->bphd", attn_in, hm._W_K[1]) + hm._b_K[1], "hook_k identity")
    hm.unwrap()


# --- wrap-time errors ------------------------------------------------------------------------------


def test_unknown_rope_type_is_refused_at_wrap_time():
    model = make(llama_config(), 0)
    model.model.rotary_emb.rope_type = "interleaved_future_rope"  # what an unknown type would look like
    with pytest.raises(UnsupportedModelError, match="rope type 'interleaved_future_rope'.*supported: default"):
        wrap(model)


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention", "paged_attention"])
def test_untested_attention_implementations_are_refused(impl):
    model = make(llama_config(), 0)
    model.config._attn_implementation = impl  # set directly: these kernels need a GPU / extra packages
    with pytest.raises(UnsupportedModelError, match=f"{impl}.*set_attn_implementation"):
        wrap(model)


def test_eager_attention_is_accepted_and_bitwise():
    model = make(llama_config(), 0, attn_implementation="eager")
    ids, mask = left_padded(64)
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        hm = wrap(model)
        assert torch.equal(hm(ids, attention_mask=mask).logits, reference)
    hm.unwrap()


def test_foreign_layout_is_refused():
    model = make(llama_config(), 0)
    del model.model.layers[0].mlp.up_proj  # e.g. custom code registered under model_type "llama"
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.mlp\.up_proj"):
        wrap(model)


# --- other entry points -----------------------------------------------------------------------------


def test_base_model_without_lm_head():
    from transformers import LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(llama_config()).eval()
    hm = wrap(model)
    assert hm.layout.unembed is None and hm.layout.blocks == "layers"
    ids, mask = left_padded(64)
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).last_hidden_state
        _, cache = hm.run_with_cache(ids, attention_mask=mask)
    assert_close(cache["ln_final.hook_normalized"] * model.norm.weight, reference, "final norm")
    hm.unwrap()


def test_tiny_config_for_the_demo():
    config = lensadapters_llama.lensadapters_tiny_config(arch=lensadapters_llama.ARCH, seed=0)
    model = make(config, 0)
    hm = wrap(model)
    assert hm.cfg.n_key_value_heads < hm.cfg.n_heads and hm.cfg.d_model <= 64 and hm.cfg.d_vocab <= 512
    ids, mask = left_padded(config.vocab_size)
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, attention_mask=mask)
    assert set(cache) >= {"blocks.1.attn.hook_rot_k", "blocks.1.mlp.hook_pre_linear", "ln_final.hook_scale"}
    hm.unwrap()


def test_entry_point_is_installed():
    assert_entry_point("llama", lensadapters_llama, skip_uninstalled=True)


def test_declared_capabilities_catch_missing_rotary_points():
    """A Llama plugin that forgets the rotary spec still runs (Hugging Face rotates inside attention) and passes
    the properties that follow the hook points it has; the declared ``rotary=True`` makes the contract fail."""
    import types

    from hypothesis import HealthCheck, Phase

    from lensadapters import SeparateQKV, hookimpl

    broken = types.ModuleType("llama_without_rotary_points")
    for name in dir(lensadapters_llama):
        if name.startswith(("lensadapters_", "LENSADAPTERS_")):
            setattr(broken, name, getattr(lensadapters_llama, name))

    @hookimpl
    def lensadapters_attn_qkv(arch, model, layer):
        return SeparateQKV("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # no rotary=

    broken.lensadapters_attn_qkv = lensadapters_attn_qkv
    del broken.LENSADAPTERS_CONTRACT

    class Broken(LlamaContract):
        plugin = broken
        config_strata = {}

    test = settings(max_examples=2, phases=[Phase.generate], suppress_health_check=list(HealthCheck))(
        given(data=st.data())(LlamaContract.test_hook_points_match_declared_capabilities.hypothesis.inner_test)
    )
    with pytest.raises(AssertionError, match=r"rotary=True, but missing: \['blocks\.0\.attn\.hook_rot_k'"):
        test(Broken())
    # the inferring properties do not notice
    Broken().test_identity_hooks_keep_logits()
