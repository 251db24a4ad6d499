"""lensadapters-olmoe's test kit: ``OlmoeContract`` (``lensadapters check``), ``olmoe_config`` and ``olmoe_configs``."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from hypothesis import strategies as st
from transformers import OlmoeConfig

import lensadapters_olmoe
from lensadapters import hf
from lensadapters.testing.families import MOE_DRAWS, MoEDecoderContract, QKNormScores, config_strategy

__all__ = ["OlmoeContract", "olmoe_config", "olmoe_configs"]


def olmoe_config(*, norm_topk_prob: bool = False, clip_qkv: Optional[float] = None, **shared: Any) -> OlmoeConfig:
    """A tiny OLMoE config (``moe_decoder_config``'s shared fields; ``eps`` 1e-5, no attention bias by default);
    ``head_dim`` is ``hidden / n_heads``, as OLMoE requires."""
    shared = {"eps": 1e-5, "attention_bias": False, **shared}
    return hf.moe_decoder_config(OlmoeConfig, clip_qkv=clip_qkv, norm_topk_prob=norm_topk_prob, **shared)


olmoe_configs = config_strategy(
    olmoe_config,
    """Tiny OLMoE configs: 2 to 5 experts, top-k from 1 to every expert (``top_k`` defaults to a draw in
    ``1..min(experts, 4)``), renormalized top-k or raw probabilities, GQA and multi-query attention, attention
    biases, tied embeddings; ``hidden_per_head`` is OLMoE's ``head_dim``. ``clip_qkv`` stays ``None`` (the plugin
    refuses it).""",
    **MOE_DRAWS,
    norm_topk_prob=st.booleans(),
    n_layers=st.integers(1, 2),
    n_kv=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2]),
    hidden_per_head=st.sampled_from([4, 8]),
    d_mlp=st.sampled_from([8, 16, 24]),
    vocab=st.integers(16, 96),
    theta=st.sampled_from([100.0, 10000.0, 1e6]),
    tied=st.booleans(),
    attention_bias=st.booleans(),
    act=st.sampled_from(["silu", "silu", "gelu_new"]),
    eps=st.sampled_from([1e-6, 1e-5]),
)


class OlmoeContract(QKNormScores, MoEDecoderContract):
    """Every generic adapter property (in its MoE and q/k-norm forms) and the MoE properties on tiny OLMoE models:
    2-5 experts, top-1 to top-every-expert routing with and without renormalization, every experts implementation of
    transformers 5, transformers 4.57's own attention classes."""

    plugin: ClassVar[Any] = lensadapters_olmoe
    config_strategy = olmoe_configs

    def config_label(self, config: Any) -> Optional[str]:
        norm = "renormalized" if config.norm_topk_prob else "raw"
        return f"top-{config.num_experts_per_tok} of {config.num_experts} ({norm})"
