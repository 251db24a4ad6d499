"""lensadapters-qwen3's test kit: ``Qwen3Contract`` (``lensadapters check``), ``qwen3_config`` and ``qwen3_configs``."""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import Qwen3Config

import lensadapters_qwen3
from lensadapters import hf
from lensadapters.testing.families import (
    DENSE_DRAWS,
    WINDOW_PROPERTIES,
    DecoderContract,
    config_strategy,
    declared_config,
)

__all__ = ["Qwen3Contract", "qwen3_config", "qwen3_configs"]


qwen3_config = declared_config(
    "qwen3_config",
    Qwen3Config,
    """A tiny Qwen3 config (``decoder_config``'s shared fields); layers ``window_from`` and later use ``window``
    when it is set.""",
    keywords=dict(head_dim=8, attention_bias=False, window=None, window_from=0),
    fields=dict(window=None, window_from=None),
    derive=lambda given: hf.window_from_fields(given["window"], given["window_from"]),
)


qwen3_configs = config_strategy(
    qwen3_config,
    """Tiny Qwen3 configs: per-head q/k norms, ``head_dim`` other than ``hidden_size / n_heads``, with and without
    ``attention_bias``; sliding windows of 2, 3 or 5 tokens on the layers from ``window_from`` on (so some models
    mix windowed and full layers), or none; GQA ratios 1, 2, 4 and multi-query attention; tied and untied
    embeddings.""",
    **DENSE_DRAWS,
    head_dim=st.sampled_from([4, 8]),
    attention_bias=st.booleans(),
    window=st.sampled_from([None, 2, 3, 5]),
    window_from=st.integers(0, 1),
)


class Qwen3Contract(DecoderContract):
    """Every generic adapter property on tiny Qwen3 models; a short window on the second of two layers is a
    stratum of the pattern, edit and generation properties (drawn on every run)."""

    plugin = lensadapters_qwen3
    # q_norm between hook_q and the scores: doubling hook_q changes nothing, its output and hook_rot_q are linear
    score_linear_points = ("attn.hook_rot_q", "attn.q_norm.hook_normalized")
    score_invariant_points = ("attn.hook_q",)
    config_strata = {"mixed windows": WINDOW_PROPERTIES}
    config_strategy = qwen3_configs
    stratum_overrides = {"mixed windows": {"window": st.sampled_from([2, 3]), "n_layers": 2, "window_from": 1}}
    # the LoRA and 8-bit matrices build two models per example (or save and reload one): smaller ones
    matrix_overrides = dict(n_kv=1, ratio=2, head_dim=8, hidden_per_head=8, n_layers=1, d_mlp=24, vocab=64, window=None)

    def config_label(self, config: Any) -> Optional[str]:
        return f"layer types {config.layer_types}"
