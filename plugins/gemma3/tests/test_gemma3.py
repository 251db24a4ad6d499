"""Gemma 3 (text): the contract suite over random tiny Gemma 3 configs, plus Gemma 3's own quirks (local and
global RoPE bases, per-head q/k norms after the projections, the multimodal model, the bidirectional refusal)."""

from __future__ import annotations

import pytest
import torch
from lensadapters_gemma3.testing import Gemma3Contract, gemma3_config

from lensadapters import UnsupportedModelError
from lensadapters.rotary import apply_rotate_half
from lensadapters.testing import assert_close
from lensadapters.testing.families import GenerationChecks, RefusalChecks, padded_cache
from lensadapters.testing.families import left_padded_tokens as tokens
from lensadapters.testing.family_checks import assert_window_patterns


class TestGemma3(Gemma3Contract, RefusalChecks, GenerationChecks):
    """The plugin's contract suite (``lensadapters_gemma3.testing``, also run by ``lensadapters check gemma3``)."""

    example_config = gemma3_config
    refused_settings = {"use_bidirectional_attention": (True, "use_bidirectional_attention")}

    def test_unknown_rope_type_is_refused(self) -> None:
        # transformers 5.x: one rotary module with a rope type per layer type
        model = self.example_model()
        rotary = model.model.rotary_emb
        rotary.rope_type = (
            {k: "interleaved_future_rope" for k in rotary.rope_type}
            if isinstance(rotary.rope_type, dict)
            else "interleaved_future_rope"
        )
        with pytest.raises(UnsupportedModelError, match="rope type 'interleaved_future_rope'.*supported: default"):
            self.wrap(model)

    generation_config = dict(layers=2, global_every=2, window=3)


CONTRACT = TestGemma3()


def rope(x: torch.Tensor, base: float, factor: float = 1.0) -> torch.Tensor:
    """Rotate-half RoPE on ``[b, p, h, d]`` at positions 0..p-1 (positions divided by ``factor``), from the formula."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] / factor * inv[None]
    emb = torch.cat([angles, angles], -1)
    return apply_rotate_half(x.double(), emb.cos()[None], emb.sin()[None]).to(x.dtype)


def test_local_and_global_layers_rotate_with_their_own_bases():
    """Layer 0 (sliding) rotates with rope_local_base_freq, layer 1 (global) with rope_theta and linear scaling: each
    layer's hook_rot_q is RoPE(q_norm output) with its own base."""
    model = CONTRACT.make_model(
        gemma3_config(layers=2, global_every=2, theta=1000.0, local_theta=10.0, global_scaling=4.0), 0
    )
    hm = CONTRACT.wrap(model)
    assert hm.cfg.attn_types == ("local", "global")
    assert hm.cfg.extra["rotary_base"] == 1000.0 and hm.cfg.extra["rotary_base_local"] == 10.0
    cache = padded_cache(hm, pads=(0, 0))
    for layer, base, factor in ((0, 10.0, 1.0), (1, 1000.0, 4.0)):
        spec = hm.norm_spec(hm.norm_module(f"blocks.{layer}.attn.q_norm"))
        normed = cache[f"blocks.{layer}.attn.q_norm.hook_normalized"] * (spec.weight + spec.weight_offset)
        assert_close(cache["rot_q", layer], rope(normed, base, factor), f"layer {layer} hook_rot_q", atol=1e-5)
    hm.unwrap()


def test_query_norms_fire_after_all_three_projections():
    hm = CONTRACT.wrap(CONTRACT.make_model(gemma3_config(), 0))
    attn = [n[len("blocks.0.") :] for n in hm.hook_names if n.startswith("blocks.0.attn.")][:11]
    assert attn == [
        "attn.hook_q",
        "attn.hook_k",
        "attn.hook_v",
        "attn.q_norm.hook_scale",
        "attn.q_norm.hook_normalized",
        "attn.hook_rot_q",
        "attn.k_norm.hook_scale",
        "attn.k_norm.hook_normalized",
        "attn.hook_rot_k",
        "attn.hook_attn_scores",
        "attn.hook_pattern",
    ]
    cache = padded_cache(hm)
    k = cache["k", 0]
    assert cache["blocks.0.attn.k_norm.hook_scale"].shape == k.shape[:-1] + (1,)  # per head, [b, p, h, 1]
    assert_close(
        cache["blocks.0.attn.k_norm.hook_normalized"],
        k / (k.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt(),
        "k_norm normalized per head",
    )
    hm.unwrap()


@pytest.mark.parametrize("pads", [(0, 0), (3, 0)])
def test_windows_follow_the_layer_types(pads):
    model = CONTRACT.make_model(gemma3_config(layers=3, global_every=3, window=3), 0, "sdpa")
    hm = CONTRACT.wrap(model)
    assert_window_patterns(hm, *tokens(length=9, pads=pads), [3, 3, None])
    hm.unwrap()


def test_multimodal_model_is_described_through_its_language_model():
    """``Gemma3ForConditionalGeneration`` (``model_type: "gemma3"``) is served: its language model's points under
    their usual names, as this plugin describes them, and the projector's output (tests/test_vlm.py checks values)."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    config = Gemma3Config(text_config=gemma3_config().to_dict(), vision_config=vision, mm_tokens_per_image=4)
    model = AutoModelForCausalLM.from_config(config)
    hm = CONTRACT.wrap(model)
    assert hm.arch.name == "gemma3" and "vision_projector.hook_out" in hm.hook_names
    assert "blocks.0.attn.q_norm.hook_scale" in hm.hook_names
    hm.unwrap()
