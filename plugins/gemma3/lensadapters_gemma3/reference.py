"""TransformerLens 2.x's ``HookedTransformer`` for a Gemma 3 text model, for comparisons (needs
``transformer_lens``, transformers 4.x). Not imported by the plugin itself."""

from __future__ import annotations

from typing import Any


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
    return {
        "d_model": config.hidden_size,
        "d_head": config.head_dim,
        "n_heads": config.num_attention_heads,
        "d_mlp": config.intermediate_size,
        "n_layers": config.num_hidden_layers,
        "n_ctx": config.max_position_embeddings,
        "eps": config.rms_norm_eps,
        "d_vocab": config.vocab_size,
        "act_fn": config.hidden_activation,
        "initializer_range": config.initializer_range,
        "normalization_type": "RMS",
        "rotary_base": float(theta),
        "rotary_base_local": float(local),
        "positional_embedding_type": "rotary",
        "use_attn_scale": True,
        "attn_scale": float(config.query_pre_attn_scalar) ** 0.5,
        "n_key_value_heads": config.num_key_value_heads,
        "gated_mlp": True,
        "final_rms": True,
        "use_normalization_before_and_after": True,
        "use_qk_norm": True,
        "window_size": config.sliding_window,
        "use_local_attn": True,
        "attn_types": ["local" if t == "sliding_attention" else "global" for t in config.layer_types],
        "output_logits_soft_cap": float(config.final_logit_softcapping or -1.0),
        "original_architecture": "Gemma3ForCausalLM",
        "rotary_dim": config.head_dim,
    }


def to_hooked_transformer(hf_model: Any) -> Any:
    """TL's model with ``hf_model``'s weights: :func:`tl_fields` and TL's weight conversion
    (``convert_gemma_weights``: ``W_E`` scaled by ``sqrt(d_model)``, ``1 + w`` norm weights, q/k norms), no
    weight processing."""
    from transformer_lens.pretrained.weight_conversions import convert_gemma_weights

    from lensadapters.testing.tl_compare import hooked_transformer

    return hooked_transformer(hf_model, convert_gemma_weights, tl_fields(hf_model.config))
