"""lensadapters-gpt-oss's test kit: ``GptOssContract``, ``gpt_oss_config`` and ``gpt_oss_configs``."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from hypothesis import strategies as st
from transformers import GptOssConfig

import lensadapters_gpt_oss
from lensadapters import hf
from lensadapters.testing.families import (
    HEAD_DRAWS,
    MOE_DRAWS,
    WINDOW_PROPERTIES,
    MoEDecoderContract,
    config_strategy,
)

__all__ = ["GptOssContract", "gpt_oss_config", "gpt_oss_configs"]

_YARN = {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def _rope_fields(rope: str, max_pos: int) -> dict[str, Any]:
    """The config keywords of a ``default`` or ``yarn`` rope (transformers 5: ``rope_parameters``, which takes the
    shared ``rope_theta``; 4.57: ``rope_scaling``)."""
    params = {"rope_type": "default"} if rope == "default" else {**_YARN, "original_max_position_embeddings": max_pos}
    if lensadapters_gpt_oss._router_returns_logits():
        return {"rope_parameters": params}
    return {"rope_scaling": None if rope == "default" else params}


def gpt_oss_config(
    *,
    head_dim: int = 8,
    window: int = 3,
    layer_types: Optional[list[str]] = None,
    rope: str = "yarn",
    limit: float = 7.0,
    alpha: float = 1.702,
    attention_bias: bool = True,
    max_pos: int = 32,
    **shared: Any,
) -> GptOssConfig:
    """A tiny GPT-OSS config (``moe_decoder_config``'s shared fields): ``experts`` experts of width ``d_mlp``, layers
    alternating sliding (window ``window``) and full from layer 0 as GPT-OSS, the SwiGLU clamp ``limit`` and gain
    ``alpha`` (transformers 4.57 hard-codes 7.0 and 1.702 in the experts module: :meth:`GptOssContract.make_model`
    sets the module's attributes from the config)."""
    types = layer_types or hf.sliding_layers(shared.get("layers", 1), 2)
    fields: dict[str, Any] = dict(sliding_window=window, layer_types=types, attention_bias=attention_bias)
    fields.update(swiglu_limit=limit, swiglu_alpha=alpha, **_rope_fields(rope, max_pos))
    return hf.moe_decoder_config(GptOssConfig, head_dim=head_dim, max_pos=max_pos, **fields, **shared)


gpt_oss_configs = config_strategy(
    gpt_oss_config,
    """Tiny GPT-OSS configs: 2 to 5 experts, top-k from 1 to every expert (at most 4), a SwiGLU clamp that binds on
    random weights (``limit`` 0.5) or the checkpoints' 7, layers alternating sliding (2, 3 or 16 tokens) and full,
    default or YaRN RoPE, GQA and multi-query attention, ``head_dim`` apart from ``hidden / heads``, tied and
    untied embeddings.""",
    **MOE_DRAWS,
    **HEAD_DRAWS,
    n_layers=st.integers(1, 2),
    d_mlp=st.sampled_from([8, 16]),
    vocab=st.integers(16, 96),
    theta=st.sampled_from([100.0, 10000.0]),
    window=st.sampled_from([2, 3, 16]),
    rope=st.sampled_from(["default", "yarn"]),
    limit=st.sampled_from([0.5, 7.0]),
    tied=st.booleans(),
    eps=st.sampled_from([1e-6, 1e-5]),
)


class GptOssContract(MoEDecoderContract):
    """Every generic adapter property (in its MoE form, with attention sinks) and the MoE properties on tiny GPT-OSS
    models: biased experts with the clamped SwiGLU (a clamp that binds), top-k-then-softmax routing, alternating
    sliding windows (a short window on two layers is a stratum of the window properties), every experts
    implementation of transformers 5. GPT-OSS runs eager attention (transformers offers it no sdpa)."""

    plugin: ClassVar[Any] = lensadapters_gpt_oss
    config_strategy = gpt_oss_configs
    attn_implementations = ("eager",)
    attention_sinks: ClassVar[bool] = True
    config_strata = {"short window": WINDOW_PROPERTIES}
    stratum_overrides = {"short window": {"window": st.sampled_from([2, 3]), "n_layers": 2}}

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> torch.nn.Module:
        model = super().make_model(config, seed, attn_implementation)
        layers: Any = model.get_submodule("model.layers")
        for layer in layers:
            experts = layer.mlp.experts
            experts.limit, experts.alpha = config.swiglu_limit, config.swiglu_alpha
        return model

    def config_label(self, config: Any) -> Optional[str]:
        return f"top-{config.num_experts_per_tok} of {config.num_local_experts}, limit {config.swiglu_limit}"
