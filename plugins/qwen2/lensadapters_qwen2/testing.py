"""Test kit of lensadapters-qwen2: configs and the contract class (needs ``lensadapters[testing]``).

``Qwen2Contract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``: ``lensadapters check qwen2`` runs it);
the plugin's tests subclass it and mix the LoRA and 8-bit variants in front of it. ``qwen2_configs(**overrides)``
draws tiny ``Qwen2Config``s (every keyword a fixed value or a strategy). Importing ``lensadapters_qwen2`` itself
never imports this module.
"""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import Qwen2Config

import lensadapters_qwen2
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["Qwen2Contract", "qwen2_config", "qwen2_configs"]


def qwen2_config(
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    hidden: int = 32,
    layers: int = 1,
    d_mlp: int = 32,
    vocab: int = 64,
    window: Optional[int] = None,
    window_from: int = 0,
    theta: float = 10000.0,
    tied: bool = False,
    eps: float = 1e-6,
    act: str = "silu",
) -> Qwen2Config:
    """A tiny Qwen2 config (bos 1, eos 2, pad 0); layers ``window_from`` and later use ``window`` when it is set."""
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        vocab_size=vocab,
        max_position_embeddings=64,
        sliding_window=window or 4096,
        use_sliding_window=window is not None,
        max_window_layers=window_from,
        rms_norm_eps=eps,
        hidden_act=act,
        tie_word_embeddings=tied,
        rope_theta=theta,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@st.composite
def qwen2_configs(
    draw: st.DrawFn,
    *,
    n_kv: Any = st.sampled_from([1, 2]),
    ratio: Any = st.sampled_from([1, 2, 4]),
    hidden_per_head: Any = st.sampled_from([4, 8]),
    d_model: Any = None,
    n_layers: Any = st.integers(1, 2),
    d_mlp: Any = st.sampled_from([16, 40]),
    vocab: Any = st.integers(16, 128),
    window: Any = st.sampled_from([None, 2, 3, 5]),
    window_from: Any = st.integers(0, 1),
    theta: Any = st.sampled_from([100.0, 10000.0]),
    tied: Any = st.booleans(),
    act: Any = st.sampled_from(["silu", "gelu_new"]),
) -> Qwen2Config:
    """Tiny Qwen2 configs: q/k/v biases always (Qwen2 has them); sliding windows of 2, 3 or 5 tokens on the
    layers from ``window_from`` on (so some models mix windowed and full layers), or none; GQA ratios 1, 2, 4 and
    multi-query attention; tied and untied embeddings."""
    kv = draw(as_strategy(n_kv), label="n_kv")
    heads = kv * draw(as_strategy(ratio), label="gqa ratio")
    hidden = (
        heads * draw(as_strategy(hidden_per_head), label="hidden per head")
        if d_model is None
        else draw(as_strategy(d_model), label="d_model")
    )
    return qwen2_config(
        n_heads=heads,
        n_kv=kv,
        hidden=hidden,
        layers=draw(as_strategy(n_layers), label="n_layers"),
        d_mlp=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        window=draw(as_strategy(window), label="window"),
        window_from=draw(as_strategy(window_from), label="from"),
        theta=draw(as_strategy(theta), label="theta"),
        tied=draw(as_strategy(tied), label="tied"),
        act=draw(as_strategy(act), label="act"),
    )


#: properties that must see a window shorter than the input (next to a full-attention layer) on every run
WINDOW_PROPERTIES = (
    "test_pattern_matches_hf_eager",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_edits_during_generation_match_one_pass",
)


class Qwen2Contract(AdapterContract):
    """Every generic adapter property on tiny Qwen2 models; a short window on the second of two layers is a
    stratum of the pattern, edit and generation properties (drawn on every run)."""

    plugin = lensadapters_qwen2
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, True, False
    config_strata = {"mixed windows": WINDOW_PROPERTIES}
    config_strategy = qwen2_configs
    stratum_overrides = {"mixed windows": {"window": st.sampled_from([2, 3]), "n_layers": 2, "window_from": 1}}
    # the LoRA and 8-bit matrices build two models per example (or save and reload one): smaller ones
    matrix_overrides = dict(
        n_kv=1,
        ratio=2,
        hidden_per_head=8,
        n_layers=st.integers(1, 2),
        d_mlp=24,
        vocab=64,
        window=st.sampled_from([None, 3]),
        window_from=1,
    )

    def config_label(self, config: Any) -> Optional[str]:
        return f"layer types {config.layer_types}"
