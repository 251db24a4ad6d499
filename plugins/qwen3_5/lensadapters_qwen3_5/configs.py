"""Tiny Qwen 3.5 text configs (dense or MoE), for ``lensadapters_tiny_config`` and the test kit; needs nothing but
transformers 5."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lensadapters import hf

__all__ = ["qwen3_5_config"]


def qwen3_5_config(
    *,
    moe: bool = False,
    layer_types: Optional[Sequence[str]] = None,
    head_dim: int = 8,
    partial_rotary_factor: float = 0.5,
    linear_heads: tuple[int, int] = (2, 4),
    linear_dims: tuple[int, int] = (8, 6),
    conv_kernel: int = 4,
    experts: int = 4,
    top_k: int = 2,
    **shared: Any,
) -> Any:
    """A tiny Qwen 3.5 text config: by default four layers, three gated DeltaNet layers then a full-attention one
    (the checkpoints' pattern); ``linear_heads`` are the DeltaNet's (key, value) heads, ``linear_dims`` their sizes;
    ``moe``: 4 experts of width 12, top 2, a shared expert of width 20."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    kinds = list(layer_types or ["linear_attention"] * 3 + ["full_attention"])
    fields: dict[str, Any] = dict(
        layers=len(kinds),
        layer_types=kinds,
        head_dim=head_dim,
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
        linear_key_head_dim=linear_dims[0],
        linear_value_head_dim=linear_dims[1],
        linear_conv_kernel_dim=conv_kernel,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor},
        **shared,
    )
    if moe:
        fields.update(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            output_router_logits=False,
        )
    config = hf.decoder_config(Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig, **fields)
    config._attn_implementation = "eager"
    return config
