"""lensadapters-mixtral's test kit: ``MixtralContract``, ``mixtral_config`` and ``mixtral_configs``."""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import MixtralConfig

import lensadapters_mixtral
from lensadapters import hf
from lensadapters.testing.families import HEAD_DRAWS, MOE_DRAWS, MoEDecoderContract, config_strategy

__all__ = ["MixtralContract", "mixtral_config", "mixtral_configs"]


def mixtral_config(*, head_dim: int = 8, sliding_window: Optional[int] = None, **shared: Any) -> MixtralConfig:
    """A tiny Mixtral config (``moe_decoder_config``'s shared fields): ``experts`` experts of width ``d_mlp``."""
    fields: dict[str, Any] = dict(head_dim=head_dim, sliding_window=sliding_window, router_jitter_noise=0.0)
    return hf.moe_decoder_config(MixtralConfig, **fields, **shared)


mixtral_configs = config_strategy(
    mixtral_config,
    """Tiny Mixtral configs: 2 to 5 experts, top-k from 1 to every expert (``top_k`` defaults to a draw in
    ``1..min(experts, 4)``), GQA and multi-query attention, ``head_dim`` apart from ``hidden / heads``, tied and
    untied embeddings. No sliding window by default (the generic properties assume every earlier key is attended;
    ``tests/test_mixtral.py`` checks sliding windows on their own).""",
    **MOE_DRAWS,
    **HEAD_DRAWS,
    n_layers=st.integers(1, 2),
    d_mlp=st.sampled_from([8, 16, 24]),
    vocab=st.integers(16, 96),
    theta=st.sampled_from([100.0, 10000.0, 1e6]),
    sliding_window=None,
    tied=st.booleans(),
    act=st.sampled_from(["silu", "silu", "gelu_new"]),
    eps=st.sampled_from([1e-6, 1e-5]),
)


class MixtralContract(MoEDecoderContract):
    """Every generic adapter property (in its MoE form) and the MoE properties on tiny Mixtral models: 2-6
    experts, top-1 to top-every-expert routing, every experts implementation of transformers 5."""

    plugin = lensadapters_mixtral
    config_strategy = mixtral_configs

    def config_label(self, config: Any) -> Optional[str]:
        return f"top-{config.num_experts_per_tok} of {config.num_local_experts}"
