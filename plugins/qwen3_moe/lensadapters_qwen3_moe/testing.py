"""lensadapters-qwen3-moe's test kit: ``Qwen3MoeContract``, ``qwen3_moe_config`` and ``qwen3_moe_configs``."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from hypothesis import strategies as st
from transformers import Qwen3MoeConfig

import lensadapters_qwen3_moe
from lensadapters import hf
from lensadapters.testing.families import (
    HEAD_DRAWS,
    MOE_DRAWS,
    MoEDecoderContract,
    QKNormScores,
    config_strategy,
    declared_config,
)

__all__ = ["Qwen3MoeContract", "qwen3_moe_config", "qwen3_moe_configs"]


qwen3_moe_config = declared_config(
    "qwen3_moe_config",
    Qwen3MoeConfig,
    """A tiny Qwen3-MoE config (``moe_decoder_config``'s shared fields): experts of width ``d_mlp``, dense layers of
    ``dense_d_mlp``.""",
    keywords={
        **dict(head_dim=8, d_mlp=16, dense_d_mlp=24, experts=4, top_k=2, norm_topk_prob=False, mlp_only_layers=()),
        **dict(decoder_sparse_step=1, window=None, attention_bias=False, max_pos=32),
    },
    fields=dict(d_mlp="moe_intermediate_size", dense_d_mlp="d_mlp", window=None),
    derive=lambda given: {
        **hf.window_from_fields(given["window"], None),
        "mlp_only_layers": list(given["mlp_only_layers"]),
    },
    build=hf.moe_decoder_config,
)


def _dense_layers(drawn: dict[str, Any]) -> Any:
    """``mlp_only_layers`` for the drawn ``dense`` kind: a set of layers that leaves one layer sparse."""
    layers = drawn["layers"]
    if drawn["dense"] != "mlp_only_layers" or layers < 2:
        return []
    return st.integers(0, layers - 1).flatmap(
        lambda sparse: st.lists(st.sampled_from([i for i in range(layers) if i != sparse]), unique=True, min_size=1)
    )


def _drawn_qwen3_moe_config(*, dense: str, mlp_only_layers: list[int], **drawn: Any) -> Qwen3MoeConfig:
    step = 2 if dense == "decoder_sparse_step" and drawn["layers"] > 1 else 1
    return qwen3_moe_config(mlp_only_layers=sorted(mlp_only_layers), decoder_sparse_step=step, **drawn)


qwen3_moe_configs = config_strategy(
    _drawn_qwen3_moe_config,
    """Tiny Qwen3-MoE configs: 2 to 5 experts, top-k from 1 to every expert (``top_k`` defaults to a draw in
    ``1..min(experts, 4)``), renormalized top-k or raw probabilities, dense layers (``dense``: none, a drawn set of
    ``mlp_only_layers``, or ``decoder_sparse_step`` 2) next to sparse ones (at least one layer stays sparse), GQA
    and multi-query attention, ``head_dim`` apart from ``hidden / heads``, attention biases, tied embeddings. No
    sliding window by default (the generic properties assume every earlier key is attended).""",
    **MOE_DRAWS,
    norm_topk_prob=st.booleans(),
    n_layers=st.integers(1, 3),
    dense=st.sampled_from(["none", "none", "mlp_only_layers", "decoder_sparse_step"]),
    mlp_only_layers=_dense_layers,
    **HEAD_DRAWS,
    d_mlp=st.sampled_from([8, 16]),
    dense_d_mlp=st.sampled_from([12, 24]),
    vocab=st.integers(16, 96),
    theta=st.sampled_from([100.0, 10000.0, 1e6]),
    window=None,
    tied=st.booleans(),
    attention_bias=st.booleans(),
    act=st.sampled_from(["silu", "silu", "gelu_new"]),
    eps=st.sampled_from([1e-6, 1e-5]),
)


class Qwen3MoeContract(QKNormScores, MoEDecoderContract):
    """Every generic adapter property (in its MoE and q/k-norm forms) and the MoE properties on tiny Qwen3-MoE
    models: 2-5 experts, top-1 to top-every-expert routing with and without renormalization, dense layers among the
    sparse ones, every experts implementation of transformers 5."""

    plugin: ClassVar[Any] = lensadapters_qwen3_moe
    config_strategy = qwen3_moe_configs

    def config_label(self, config: Any) -> Optional[str]:
        sparse = lensadapters_qwen3_moe.sparse_layers(config)
        norm = "renormalized" if config.norm_topk_prob else "raw"
        return f"top-{config.num_experts_per_tok} of {config.num_experts} ({norm}), sparse layers {sparse}"
