"""TransformerLens 2.x's ``HookedTransformer`` for a Gemma 2 model, for comparisons (needs ``transformer_lens``,
transformers 4.x). Not imported by the plugin itself."""

from __future__ import annotations

from typing import Any

from lensadapters.testing.tl_compare import hooked_transformer, rotary_decoder_fields


def tl_fields(config: Any) -> dict:
    """TL's Gemma 2 config: TL 2.18 has no conversion from an HF config for Gemma (its ``convert_hf_model_config``
    matches checkpoint names against hard-coded tables); these are the flags of its ``google/gemma-2-*`` tables with
    this config's sizes, its ``query_pre_attn_scalar`` (TL's ``attn_scale``, as its 27B table sets it) and its layer
    types (TL's tables put the global layer first, opposite to HF: the HF config is the truth)."""
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return rotary_decoder_fields(
        config,
        act_fn=config.hidden_activation,
        rotary_base=float(theta),
        use_attn_scale=True,
        attn_scale=float(config.query_pre_attn_scalar) ** 0.5,
        attn_scores_soft_cap=float(config.attn_logit_softcapping or -1.0),
        output_logits_soft_cap=float(config.final_logit_softcapping or -1.0),
        use_normalization_before_and_after=True,
        original_architecture="Gemma2ForCausalLM",
    )


def to_hooked_transformer(hf_model: Any) -> Any:
    """TL's model with ``hf_model``'s weights: :func:`tl_fields` and TL's weight conversion
    (``convert_gemma_weights``: ``W_E`` scaled by ``sqrt(d_model)``, ``1 + w`` norm weights), no weight processing."""
    from transformer_lens.pretrained.weight_conversions import convert_gemma_weights

    return hooked_transformer(hf_model, convert_gemma_weights, tl_fields(hf_model.config))
