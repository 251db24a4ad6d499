"""Test kit of lensadapters-phi3: configs and the contract class (needs ``lensadapters[testing]``).

``Phi3Contract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``: ``lensadapters check phi3`` runs it);
the plugin's tests subclass it and mix the LoRA and 8-bit variants in front of it. ``phi3_configs(**overrides)``
draws tiny ``Phi3Config``s (every keyword a fixed value or a strategy). Importing ``lensadapters_phi3`` itself
never imports this module.
"""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import Phi3Config

import lensadapters_phi3
from lensadapters import hf
from lensadapters.testing.families import DENSE_DRAWS, SMALL_MATRIX, DecoderContract, config_strategy, declared_config

__all__ = ["Phi3Contract", "phi3_config", "phi3_configs"]


def longrope(rotary_dim: int) -> dict:
    """LongRoPE parameters with distinct short and long factors for ``rotary_dim`` rotated dimensions."""
    half = rotary_dim // 2
    return {
        "type": "longrope",
        "short_factor": [1.0 + 0.25 * i / half for i in range(half)],
        "long_factor": [1.5 + 2.0 * i / half for i in range(half)],
    }


def _rope_scaling(given: dict[str, Any]) -> Optional[dict]:
    """LongRoPE parameters for the rotated dimensions of ``given`` (width, heads, ``partial``), or None."""
    rotary = int(given.get("hidden", 32) // given.get("n_heads", 4) * given["partial"])
    return longrope(rotary) if given["rope"] == "longrope" else None


phi3_config = declared_config(
    "phi3_config",
    Phi3Config,
    """A tiny Phi-3 config (``decoder_config``'s shared fields). With LongRoPE, sequences up to 16 tokens stay in the
    short-factor regime (``original_max_position_embeddings``) and ``max_position_embeddings`` (64) sets the
    attention factor.""",
    keywords={
        **dict(partial=1.0, rope="default", window=None),
        **dict(original_max_position_embeddings=16, resid_pdrop=0.0, embd_pdrop=0.0),
    },
    fields=dict(partial="partial_rotary_factor", rope=None, window="sliding_window"),
    derive=lambda given: dict(rope_scaling=_rope_scaling(given)),
)


phi3_configs = config_strategy(
    phi3_config,
    """Tiny Phi-3 configs: fused ``qkv_proj`` with GQA ratios 1, 2, 3 and multi-query attention (unequal q and kv
    widths), fused ``gate_up_proj``, partial rotary (0.5, 0.75 as Phi-4-mini, 1.0), default and LongRoPE, sliding
    windows of 2, 3, 5 tokens or none, tied and untied embeddings; ``hidden_per_head`` is the head size.""",
    **{**DENSE_DRAWS, "ratio": st.sampled_from([1, 2, 3]), "hidden_per_head": st.sampled_from([8, 16])},
    partial=st.sampled_from([0.5, 0.75, 1.0]),
    rope=st.sampled_from(["default", "longrope"]),
    window=st.sampled_from([None, 2, 3, 5]),
)


#: properties that must see Phi-4-mini's shape (partial rotary, GQA, a short window) on every run
PHI4_PROPERTIES = (
    "test_weight_and_residual_identities",
    "test_pattern_matches_hf_eager",
    "test_in_place_edits_equal_returned_edits",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_edits_during_generation_match_one_pass",
)


class Phi3Contract(DecoderContract):
    """Every generic adapter property on tiny Phi-3 models; Phi-4-mini's shape (partial rotary 0.75, GQA 3:1,
    LongRoPE) with a short window is a stratum of the identity, pattern, edit and generation properties."""

    plugin = lensadapters_phi3
    config_strata = {"phi-4-mini": PHI4_PROPERTIES}
    config_strategy = phi3_configs
    stratum_overrides = {
        "phi-4-mini": {"partial": 0.75, "ratio": 3, "rope": "longrope", "window": st.sampled_from([2, 3])}
    }
    matrix_overrides = {
        **SMALL_MATRIX,
        **dict(n_layers=1, partial=st.sampled_from([0.5, 1.0]), rope="default", window=st.sampled_from([None, 3])),
    }

    def config_label(self, config: Any) -> Optional[str]:
        return f"partial {hf.partial_rotary_factor(config)}, window {config.sliding_window}"
