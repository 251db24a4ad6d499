"""Test kit of lensadapters-gemma2: configs and the contract class (needs ``lensadapters[testing]``).

``Gemma2Contract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``: ``lensadapters check gemma2`` runs
it); the plugin's tests subclass it and mix the LoRA and 8-bit variants in front of it.
``gemma2_configs(**overrides)`` draws tiny ``Gemma2Config``s (every keyword a fixed value or a strategy).
Importing ``lensadapters_gemma2`` itself never imports this module.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from hypothesis import strategies as st
from transformers import Gemma2Config

import lensadapters_gemma2
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["Gemma2Contract", "gemma2_config", "gemma2_configs", "gemma_reinit"]


def gemma2_config(
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    head_dim: int = 8,
    hidden: int = 32,
    layers: int = 2,
    d_mlp: int = 32,
    vocab: int = 64,
    window: int = 3,
    scalar: float = 8,
    attn_cap: Optional[float] = 50.0,
    final_cap: Optional[float] = 30.0,
    theta: float = 10000.0,
    eps: float = 1e-6,
    act: str = "gelu_pytorch_tanh",
    tied: bool = True,
) -> Gemma2Config:
    """A tiny Gemma 2 config (bos 2, eos 1, pad 0), eager attention; layers alternate sliding and global from
    layer 0 as HF's Gemma 2 does."""
    return Gemma2Config(
        hidden_size=hidden,
        intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=64,
        sliding_window=window,
        query_pre_attn_scalar=scalar,
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap,
        rms_norm_eps=eps,
        hidden_activation=act,
        rope_theta=theta,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
        attn_implementation="eager",
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )


@st.composite
def gemma2_configs(
    draw: st.DrawFn,
    *,
    n_kv: Any = st.sampled_from([1, 2]),
    ratio: Any = st.sampled_from([1, 2]),
    head_dim: Any = st.sampled_from([4, 8]),
    hidden_per_head: Any = st.sampled_from([4, 8]),
    d_model: Any = None,
    n_layers: Any = st.integers(1, 2),
    d_mlp: Any = st.sampled_from([16, 40]),
    vocab: Any = st.integers(16, 128),
    window: Any = st.sampled_from([2, 3, 16]),
    scalar: Any = st.sampled_from([4, 16, 256]),
    attn_cap: Any = st.sampled_from([None, 3.0, 50.0]),
    final_cap: Any = st.sampled_from([None, 2.0, 30.0]),
    theta: Any = st.sampled_from([100.0, 10000.0]),
    tied: Any = st.booleans(),
) -> Gemma2Config:
    """Tiny Gemma 2 configs: alternating sliding (2, 3 or 16 tokens) and global layers, ``query_pre_attn_scalar``
    unlike ``head_dim``, attention-logit and final-logit softcaps (small caps that bind on random weights, 50/30 as
    the checkpoints, or none), GQA and multi-query attention, tied and untied embeddings."""
    kv = draw(as_strategy(n_kv), label="n_kv")
    heads = kv * draw(as_strategy(ratio), label="gqa ratio")
    hidden = (
        heads * draw(as_strategy(hidden_per_head), label="hidden per head")
        if d_model is None
        else draw(as_strategy(d_model), label="d_model")
    )
    return gemma2_config(
        n_heads=heads,
        n_kv=kv,
        head_dim=draw(as_strategy(head_dim), label="head_dim"),
        hidden=hidden,
        layers=draw(as_strategy(n_layers), label="n_layers"),
        d_mlp=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        window=draw(as_strategy(window), label="window"),
        scalar=draw(as_strategy(scalar), label="query_pre_attn_scalar"),
        attn_cap=draw(as_strategy(attn_cap), label="attn softcap"),
        final_cap=draw(as_strategy(final_cap), label="final softcap"),
        theta=draw(as_strategy(theta), label="theta"),
        tied=draw(as_strategy(tied), label="tied"),
    )


def gemma_reinit(model: torch.nn.Module, seed: int) -> None:
    """Unit-ish random weights as ``lensadapters.testing.reinit`` gives, with Gemma's ``(1 + weight)`` norm weights
    drawn around 0 (their effective scale around 1, as in the checkpoints)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point():
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim == 1:
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / math.sqrt(min(param.shape)))


#: properties that must see binding softcaps and a window shorter than the input on every run
CAPPED_PROPERTIES = (
    "test_pattern_matches_hf_eager",
    "test_pattern_and_query_edits_are_used",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_weight_and_residual_identities",
    "test_edits_during_generation_match_one_pass",
)


class Gemma2Contract(AdapterContract):
    """Every generic adapter property on tiny Gemma 2 models (eager attention: transformers 5.x offers Gemma 2 no
    sdpa); binding softcaps with a short window on two layers is a stratum of the pattern, identity, edit and
    generation properties."""

    plugin = lensadapters_gemma2
    attn_implementations = ("eager",)
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, True, False
    post_norms = {"hook_attn_out": "ln1_post", "hook_mlp_out": "ln2_post"}
    logit_softcap = "final_logit_softcapping"
    score_softcap = "attn_logit_softcapping"
    config_strata = {"binding softcaps": CAPPED_PROPERTIES}
    config_strategy = gemma2_configs
    stratum_overrides = {
        "binding softcaps": {"attn_cap": 3.0, "final_cap": 2.0, "n_layers": 2, "window": st.sampled_from([2, 3])}
    }
    # the LoRA and 8-bit matrices build two models per example (or save and reload one): smaller ones
    matrix_overrides = dict(
        n_kv=1,
        ratio=2,
        head_dim=8,
        hidden_per_head=8,
        n_layers=2,
        d_mlp=24,
        vocab=64,
        window=3,
        attn_cap=st.sampled_from([None, 50.0]),
        final_cap=st.sampled_from([None, 30.0]),
    )

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> torch.nn.Module:
        model = super().make_model(config, seed, attn_implementation)
        gemma_reinit(model, seed)
        return model

    def config_label(self, config: Any) -> Optional[str]:
        return f"softcaps {config.attn_logit_softcapping}/{config.final_logit_softcapping}"
