"""lensadapters-qwen2's test kit: ``Qwen2Contract`` (``lensadapters check``), ``qwen2_config`` and ``qwen2_configs``."""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import Qwen2Config

import lensadapters_qwen2
from lensadapters import hf
from lensadapters.testing.families import (
    DENSE_DRAWS,
    SMALL_MATRIX,
    WINDOW_PROPERTIES,
    DecoderContract,
    config_strategy,
    decoder_config,
)

__all__ = ["Qwen2Contract", "qwen2_config", "qwen2_configs"]


def qwen2_config(*, window: Optional[int] = None, window_from: int = 0, **shared: Any) -> Qwen2Config:
    """A tiny Qwen2 config (``decoder_config``'s shared fields); layers ``window_from`` and later use ``window``
    when it is set."""
    return decoder_config(Qwen2Config, **hf.window_from_fields(window, window_from), **shared)


qwen2_configs = config_strategy(
    qwen2_config,
    """Tiny Qwen2 configs: q/k/v biases always (Qwen2 has them); sliding windows of 2, 3 or 5 tokens on the layers
    from ``window_from`` on (so some models mix windowed and full layers), or none; GQA ratios 1, 2, 4 and
    multi-query attention; tied and untied embeddings.""",
    **DENSE_DRAWS,
    window=st.sampled_from([None, 2, 3, 5]),
    window_from=st.integers(0, 1),
)


class Qwen2Contract(DecoderContract):
    """Every generic adapter property on tiny Qwen2 models; a short window on the second of two layers is a
    stratum of the pattern, edit and generation properties (drawn on every run)."""

    plugin = lensadapters_qwen2
    config_strategy = qwen2_configs
    config_strata = {"mixed windows": WINDOW_PROPERTIES}
    stratum_overrides = {"mixed windows": {"window": st.sampled_from([2, 3]), "n_layers": 2, "window_from": 1}}
    matrix_overrides = {
        **SMALL_MATRIX,
        **dict(n_layers=st.integers(1, 2), window=st.sampled_from([None, 3]), window_from=1),
    }

    def config_label(self, config: Any) -> Optional[str]:
        return f"layer types {config.layer_types}"
