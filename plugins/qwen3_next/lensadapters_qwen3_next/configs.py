"""Tiny Qwen3-Next configs (dense or MoE), for ``lensadapters_tiny_config`` and the test kit; transformers 4.57 or
5."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lensadapters import hf

__all__ = ["qwen3_next_config"]


def qwen3_next_config(
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
    norm_topk_prob: bool = True,
    mlp_only_layers: Sequence[int] = (),
    **shared: Any,
) -> Any:
    """A tiny Qwen3-Next config: by default four layers, three gated DeltaNet layers then a full-attention one
    (the checkpoints' pattern); ``linear_heads`` are the DeltaNet's (key, value) heads, ``linear_dims`` their sizes;
    ``moe``: 4 experts of width 12, top 2, a shared expert of width 20 (the layers in ``mlp_only_layers`` dense)."""
    from transformers import Qwen3NextConfig

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
        partial_rotary_factor=partial_rotary_factor,
        decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
        **shared,
    )
    if moe:
        fields.update(
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=norm_topk_prob,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            output_router_logits=False,
        )
    else:
        fields.update(num_experts=0)
    config = hf.decoder_config(Qwen3NextConfig, **fields)
    config._attn_implementation = "eager"
    return config
