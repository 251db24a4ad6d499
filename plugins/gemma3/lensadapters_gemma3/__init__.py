"""Gemma 3 text models (``model_type: "gemma3_text"``: Gemma-3 270M, 1B, and the text part of 4B-27B) for lensadapters.

Gemma 2's structure (see the Gemma 2 plugin; TransformerLens 2.x names and semantics) plus:

* Per-head RMSNorm on queries and keys between projection and RoPE (``q_norm``/``k_norm``, ``(1 + weight)``):
  ``attn.q_norm.hook_scale``/``hook_normalized`` and ``attn.k_norm.*`` fire after all three projections (as the
  model runs them), ``hook_q``/``hook_k`` are the projection output, ``hook_rot_q``/``hook_rot_k`` the normed and
  rotated values attention uses (an edit of ``hook_rot_k`` reaches the KV cache). The norm points are
  ``[b, p, h, 1]``/``[b, p, h, d_head]`` (TransformerLens flattens them to ``[b*p*h, ...]``: the same values).
* Different RoPE bases (and scaling) on sliding and global layers (``rope_local_base_freq`` and ``rope_theta``;
  transformers 5.x ``rope_parameters`` per layer type): each layer's ``hook_rot_q``/``hook_rot_k`` use the
  ``(cos, sin)`` that layer receives (``ModelLayout.rotary_input``).
* Sandwich norms (``ln1_post``/``ln2_post``), ``(1 + weight)`` RMSNorm, embeddings scaled by ``sqrt(d_model)``
  (in ``hook_embed`` and ``W_E``), ``query_pre_attn_scalar``, an optional final-logit softcap, sliding-window
  layers from ``config.layer_types``. (The config's ``attn_logit_softcapping`` is not applied by transformers'
  Gemma 3, whose attention module never passes it on: ``cfg.attn_scores_soft_cap`` is -1, as the model computes.)

The multimodal ``Gemma3ForConditionalGeneration`` (``model_type: "gemma3"``) is described through its language
model (the core finds it and adds the projector's output, see the README's "Vision-language models"); image tokens'
bidirectional masks are the masks the attention modules receive, which the pattern points read.

Refused at wrap time: rope types other than rotate-half ones, bidirectional attention
(``use_bidirectional_attention``: EmbeddingGemma), custom modeling code, a model without Gemma 3's layout.
Flash and flex attention: every hook point but ``hook_attn_scores``/``hook_pattern`` (which name the fix).
"""

from __future__ import annotations

from typing import Any, Optional

from lensadapters import UnsupportedModelError, hf

__version__ = "0.1.0"
FAMILY = hf.DecoderFamily.named(
    "Gemma3",
    "gemma3_text",
    packages=("gemma3",),
    norm_weight_offset=1.0,  # Gemma: x / rms * (1 + weight)
    block=hf.SANDWICH_BLOCK,
    scaled_embeddings=True,
    # the norms see [b, heads, p, d_head]: the attention module transposes before normalizing; q, k and v are
    # projected first, then q_norm and k_norm, then RoPE
    qk_norms=hf.qk_norms("bhpd"),
    qk_norms_after_projections=True,
    # each layer's (cos, sin) from its attention module's `position_embeddings`: local and global layers differ
    rotary_input="position_embeddings",
)
ARCH = FAMILY.architecture(
    "Gemma 3 text (Gemma3ForCausalLM, Gemma3TextModel): sandwich norms, per-head q/k norms, local and global RoPE "
    "bases, scaled embeddings, sliding windows",
    name="gemma3",
    model_types=("gemma3_text", "gemma3"),
    vision_language=True,
)


def rope_bases(config: Any) -> tuple[Optional[float], Optional[float]]:
    """``(global, local)`` RoPE bases (transformers 4.x: ``rope_theta``, ``rope_local_base_freq``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        local = params["sliding_attention"].get("rope_theta")
    else:
        local = getattr(config, "rope_local_base_freq", None)
    return hf.rope_theta(config, "full_attention"), (float(local) if local is not None else None)


def _cap(value: Optional[float]) -> float:
    return float(value) if value else -1.0


def check(model: Any) -> None:
    if getattr(hf.text_config(model), "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "this Gemma 3 config sets use_bidirectional_attention=True (an encoder such as EmbeddingGemma, not a "
            "causal language model); the gemma3 plugin describes causal Gemma 3 models, whose masks it reproduces"
        )


def config_fields(model: Any) -> dict[str, Any]:
    c = hf.text_config(model)
    base_global, base_local = rope_bases(c)
    return dict(
        act_fn=c.hidden_activation,
        model_type=model.config.model_type,
        # transformers' Gemma 3 never passes attn_logit_softcapping to its attention function: no attention softcap
        output_logits_soft_cap=_cap(c.final_logit_softcapping),
        **hf.window_fields(hf.layer_windows(c)),
        extra={
            "rotary_base": base_global,
            "rotary_base_local": base_local,
            "query_pre_attn_scalar": c.query_pre_attn_scalar,
            "attn_scale": float(c.query_pre_attn_scalar) ** 0.5,
            "use_normalization_before_and_after": True,
            "use_qk_norm": True,
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", True)),
        },
    )


def tiny_config(seed: int) -> Any:
    """A Gemma-3-1B-like toy, width 64, vocabulary 512. Seed 0 is the demo's model: 3 layers (two sliding with RoPE
    base 10, then a global one with base 10000), GQA (4 query heads, 1 kv head), a 4-token window. Other seeds vary
    depth, heads and the window."""
    from transformers import Gemma3TextConfig

    rope = {"rope_theta": 10000.0, "rope_local_base_freq": 10.0}
    return hf.sliding_toy(
        Gemma3TextConfig, seed, (3, (4, 1)), full_every=3, head_dim=16, query_pre_attn_scalar=16, **rope, **TOKENS
    )


#: Gemma's special tokens (bos 2, eos 1), in every toy config
TOKENS = {"bos_token_id": 2, "eos_token_id": 1}


PLUGIN = hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=config_fields, check=check).export(globals())
