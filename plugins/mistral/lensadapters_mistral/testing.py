"""Test kit of lensadapters-mistral: configs and the contract class (needs ``lensadapters[testing]``).

``MistralContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``: ``lensadapters check mistral``
runs it); the plugin's tests subclass it and mix the LoRA and 8-bit variants in front of it.
``mistral_configs(**overrides)`` draws tiny ``MistralConfig``s (every keyword a fixed value or a strategy).
Importing ``lensadapters_mistral`` itself never imports this module.
"""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import MistralConfig

import lensadapters_mistral
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["MistralContract", "mistral_config", "mistral_configs"]


def mistral_config(
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    head_dim: int = 8,
    hidden: int = 32,
    layers: int = 1,
    d_mlp: int = 32,
    vocab: int = 64,
    window: Optional[int] = 3,
    theta: float = 10000.0,
    tied: bool = False,
    eps: float = 1e-6,
    act: str = "silu",
) -> MistralConfig:
    """A tiny Mistral config (bos 1, eos 2, pad 0)."""
    return MistralConfig(
        hidden_size=hidden,
        intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=64,
        sliding_window=window,
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
def mistral_configs(
    draw: st.DrawFn,
    *,
    n_kv: Any = st.sampled_from([1, 2]),
    ratio: Any = st.sampled_from([1, 2, 4]),
    head_dim: Any = st.sampled_from([4, 8]),
    hidden_per_head: Any = st.sampled_from([4, 8]),
    d_model: Any = None,
    n_layers: Any = st.integers(1, 2),
    d_mlp: Any = st.sampled_from([16, 40]),
    vocab: Any = st.integers(16, 128),
    window: Any = st.sampled_from([None, 2, 3, 5, 16]),
    theta: Any = st.sampled_from([100.0, 10000.0]),
    tied: Any = st.booleans(),
    act: Any = st.sampled_from(["silu", "gelu_new"]),
) -> MistralConfig:
    """Tiny Mistral configs: sliding windows of 2, 3 and 5 tokens (shorter than most drawn inputs, up to 9
    tokens), 16 (longer than any) or none; GQA ratios 1, 2, 4 and multi-query attention; ``head_dim`` other than
    ``hidden_size / n_heads``; tied and untied embeddings."""
    kv = draw(as_strategy(n_kv), label="n_kv")
    heads = kv * draw(as_strategy(ratio), label="gqa ratio")
    dim = draw(as_strategy(head_dim), label="head_dim")
    hidden = (
        heads * draw(as_strategy(hidden_per_head), label="hidden per head")
        if d_model is None
        else draw(as_strategy(d_model), label="d_model")
    )
    return mistral_config(
        n_heads=heads,
        n_kv=kv,
        head_dim=dim,
        hidden=hidden,
        layers=draw(as_strategy(n_layers), label="n_layers"),
        d_mlp=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        window=draw(as_strategy(window), label="window"),
        theta=draw(as_strategy(theta), label="theta"),
        tied=draw(as_strategy(tied), label="tied"),
        act=draw(as_strategy(act), label="act"),
    )


#: properties that must see a window shorter than the input on every run
WINDOW_PROPERTIES = (
    "test_pattern_matches_hf_eager",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_edits_during_generation_match_one_pass",
    "test_generation_with_hooks_matches",
)


class MistralContract(AdapterContract):
    """Every generic adapter property on tiny Mistral models; a window shorter than the input is a stratum of the
    pattern, edit and generation properties (drawn on every run)."""

    plugin = lensadapters_mistral
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, True, False
    config_strata = {"short window": WINDOW_PROPERTIES}
    config_strategy = mistral_configs
    stratum_overrides = {"short window": {"window": st.sampled_from([2, 3])}}
    # the LoRA and 8-bit matrices build two models per example (or save and reload one): smaller ones
    matrix_overrides = dict(
        n_kv=1, ratio=2, head_dim=8, hidden_per_head=8, n_layers=1, d_mlp=24, vocab=64, window=st.sampled_from([2, 16])
    )

    def config_label(self, config: Any) -> Optional[str]:
        return f"window {config.sliding_window}"
