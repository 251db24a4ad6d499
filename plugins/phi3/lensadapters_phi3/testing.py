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
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["Phi3Contract", "phi3_config", "phi3_configs"]


def longrope(rotary_dim: int) -> dict:
    """LongRoPE parameters with distinct short and long factors for ``rotary_dim`` rotated dimensions."""
    half = rotary_dim // 2
    return {
        "type": "longrope",
        "short_factor": [1.0 + 0.25 * i / half for i in range(half)],
        "long_factor": [1.5 + 2.0 * i / half for i in range(half)],
    }


def phi3_config(
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    hidden: int = 32,
    layers: int = 1,
    d_mlp: int = 32,
    vocab: int = 64,
    partial: float = 1.0,
    rope: str = "default",
    window: Optional[int] = None,
    theta: float = 10000.0,
    tied: bool = False,
    eps: float = 1e-6,
    act: str = "silu",
) -> Phi3Config:
    """A tiny Phi-3 config (bos 1, eos 2, pad 0). With LongRoPE, sequences up to 16 tokens stay in the short-factor
    regime (``original_max_position_embeddings``) and ``max_position_embeddings`` (64) sets the attention factor."""
    rotary = int(hidden // n_heads * partial)
    return Phi3Config(
        hidden_size=hidden,
        intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        vocab_size=vocab,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        partial_rotary_factor=partial,
        rope_scaling=longrope(rotary) if rope == "longrope" else None,
        sliding_window=window,
        rms_norm_eps=eps,
        hidden_act=act,
        tie_word_embeddings=tied,
        rope_theta=theta,
        attention_dropout=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@st.composite
def phi3_configs(
    draw: st.DrawFn,
    *,
    n_kv: Any = st.sampled_from([1, 2]),
    ratio: Any = st.sampled_from([1, 2, 3]),
    head_dim: Any = st.sampled_from([8, 16]),
    n_layers: Any = st.integers(1, 2),
    d_mlp: Any = st.sampled_from([16, 40]),
    vocab: Any = st.integers(16, 128),
    partial: Any = st.sampled_from([0.5, 0.75, 1.0]),
    rope: Any = st.sampled_from(["default", "longrope"]),
    window: Any = st.sampled_from([None, 2, 3, 5]),
    theta: Any = st.sampled_from([100.0, 10000.0]),
    tied: Any = st.booleans(),
    act: Any = st.sampled_from(["silu", "gelu_new"]),
) -> Phi3Config:
    """Tiny Phi-3 configs: fused ``qkv_proj`` with GQA ratios 1, 2, 3 and multi-query attention (unequal q and kv
    widths), fused ``gate_up_proj``, partial rotary (0.5, 0.75 as Phi-4-mini, 1.0), default and LongRoPE, sliding
    windows of 2, 3, 5 tokens or none, tied and untied embeddings."""
    kv = draw(as_strategy(n_kv), label="n_kv")
    heads = kv * draw(as_strategy(ratio), label="gqa ratio")
    return phi3_config(
        n_heads=heads,
        n_kv=kv,
        hidden=heads * draw(as_strategy(head_dim), label="head_dim"),
        layers=draw(as_strategy(n_layers), label="n_layers"),
        d_mlp=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        partial=draw(as_strategy(partial), label="partial rotary"),
        rope=draw(as_strategy(rope), label="rope"),
        window=draw(as_strategy(window), label="window"),
        theta=draw(as_strategy(theta), label="theta"),
        tied=draw(as_strategy(tied), label="tied"),
        act=draw(as_strategy(act), label="act"),
    )


#: properties that must see Phi-4-mini's shape (partial rotary, GQA, a short window) on every run
PHI4_PROPERTIES = (
    "test_weight_and_residual_identities",
    "test_pattern_matches_hf_eager",
    "test_in_place_edits_equal_returned_edits",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_edits_during_generation_match_one_pass",
)


class Phi3Contract(AdapterContract):
    """Every generic adapter property on tiny Phi-3 models; Phi-4-mini's shape (partial rotary 0.75, GQA 3:1,
    LongRoPE) with a short window is a stratum of the identity, pattern, edit and generation properties."""

    plugin = lensadapters_phi3
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, True, False
    config_strata = {"phi-4-mini": PHI4_PROPERTIES}
    config_strategy = phi3_configs
    stratum_overrides = {
        "phi-4-mini": {"partial": 0.75, "ratio": 3, "rope": "longrope", "window": st.sampled_from([2, 3])}
    }
    # the LoRA and 8-bit matrices build two models per example (or save and reload one): smaller ones
    matrix_overrides = dict(
        n_kv=1,
        ratio=2,
        head_dim=8,
        n_layers=1,
        d_mlp=24,
        vocab=64,
        partial=st.sampled_from([0.5, 1.0]),
        rope="default",
        window=st.sampled_from([None, 3]),
    )

    def config_label(self, config: Any) -> Optional[str]:
        return f"partial {lensadapters_phi3.partial_rotary_factor(config)}, window {config.sliding_window}"
