"""TransformerLens 2.x's ``HookedTransformer`` for a Gemma 3 text model, for comparisons (needs
``transformer_lens``, transformers 4.x). Not imported by the plugin itself."""

from __future__ import annotations

from typing import Any

from lensadapters.testing.tl_compare import hooked_transformer, rotary_decoder_fields


def tl_fields(config: Any) -> dict:
    """TL's Gemma 3 config: TL 2.18 has no conversion from an HF config for Gemma (it matches checkpoint names
    against hard-coded tables); these are the flags of its ``google/gemma-3-*`` tables (query/key norms, sandwich
    norms, local and global RoPE bases) with this config's sizes, ``query_pre_attn_scalar`` (TL's ``attn_scale``) and
    layer types. TL has no RoPE scaling for Gemma 3 (the 4B-27B checkpoints scale global layers linearly)."""
    theta = getattr(config, "rope_theta", None)
    local = getattr(config, "rope_local_base_freq", None)
    params = getattr(config, "rope_parameters", None) or {}
    if theta is None and isinstance(params.get("full_attention"), dict):
        theta, local = params["full_attention"]["rope_theta"], params["sliding_attention"]["rope_theta"]
    return rotary_decoder_fields(
        config,
        act_fn=config.hidden_activation,
        rotary_base=float(theta),
        rotary_base_local=float(local),
        use_attn_scale=True,
        attn_scale=float(config.query_pre_attn_scalar) ** 0.5,
        use_normalization_before_and_after=True,
        use_qk_norm=True,
        output_logits_soft_cap=float(config.final_logit_softcapping or -1.0),
        original_architecture="Gemma3ForCausalLM",
    )


def to_hooked_transformer(hf_model: Any) -> Any:
    """TL's model with ``hf_model``'s weights: :func:`tl_fields` and TL's weight conversion
    (``convert_gemma_weights``: ``W_E`` scaled by ``sqrt(d_model)``, ``1 + w`` norm weights, q/k norms), no
    weight processing."""
    from transformer_lens.pretrained.weight_conversions import convert_gemma_weights

    return hooked_transformer(hf_model, convert_gemma_weights, tl_fields(hf_model.config))
