"""lensadapters-mistral's test kit: ``MistralContract``, ``mistral_config`` and ``mistral_configs``."""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import MistralConfig

import lensadapters_mistral
from lensadapters.testing.families import (
    DENSE_DRAWS,
    WINDOW_PROPERTIES,
    DecoderContract,
    config_strategy,
    decoder_config,
)

__all__ = ["MistralContract", "mistral_config", "mistral_configs"]


def mistral_config(*, head_dim: int = 8, window: Optional[int] = 3, **shared: Any) -> MistralConfig:
    """A tiny Mistral config (``decoder_config``'s shared fields) with a sliding ``window`` on every layer."""
    return decoder_config(MistralConfig, head_dim=head_dim, sliding_window=window, **shared)


mistral_configs = config_strategy(
    mistral_config,
    """Tiny Mistral configs: sliding windows of 2, 3 and 5 tokens (shorter than most drawn inputs, up to 9 tokens), 16
    (longer than any) or none; GQA ratios 1, 2, 4 and multi-query attention; ``head_dim`` other than
    ``hidden_size / n_heads``; tied and untied embeddings.""",
    **DENSE_DRAWS,
    head_dim=st.sampled_from([4, 8]),
    window=st.sampled_from([None, 2, 3, 5, 16]),
)


class MistralContract(DecoderContract):
    """Every generic adapter property on tiny Mistral models; a window shorter than the input is a stratum of the
    pattern, edit and generation properties (drawn on every run)."""

    plugin = lensadapters_mistral
    config_strategy = mistral_configs
    config_strata = {"short window": (*WINDOW_PROPERTIES, "test_generation_with_hooks_matches")}
    stratum_overrides = {"short window": {"window": st.sampled_from([2, 3])}}
    # the LoRA and 8-bit matrices build two models per example (or save and reload one): smaller ones
    matrix_overrides = dict(
        n_kv=1, ratio=2, head_dim=8, hidden_per_head=8, n_layers=1, d_mlp=24, vocab=64, window=st.sampled_from([2, 16])
    )

    def config_label(self, config: Any) -> Optional[str]:
        return f"window {config.sliding_window}"
