"""Test kit of lensadapters-gemma3: configs and the contract class (needs ``lensadapters[testing]``).

``Gemma3Contract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``: ``lensadapters check gemma3`` runs
it); the plugin's tests subclass it and mix the LoRA and 8-bit variants in front of it.
``gemma3_configs(**overrides)`` draws tiny ``Gemma3TextConfig``s (every keyword a fixed value or a strategy).
Importing ``lensadapters_gemma3`` itself never imports this module.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from hypothesis import strategies as st
from transformers import Gemma3TextConfig

import lensadapters_gemma3
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["Gemma3Contract", "gemma3_config", "gemma3_configs", "gemma_reinit"]


def gemma3_config(
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    head_dim: int = 8,
    hidden: int = 32,
    layers: int = 2,
    global_every: int = 2,
    d_mlp: int = 32,
    vocab: int = 64,
    window: int = 3,
    scalar: float = 8,
    theta: float = 10000.0,
    local_theta: float = 10.0,
    global_scaling: Optional[float] = None,
    final_cap: Optional[float] = None,
    eps: float = 1e-6,
    tied: bool = True,
) -> Gemma3TextConfig:
    """A tiny Gemma 3 text config (bos 2, eos 1, pad 0): every ``global_every``-th layer global (Gemma 3's
    5 local : 1 global pattern, shortened), the others sliding; RoPE base ``theta`` (with linear scaling by
    ``global_scaling`` as Gemma-3-4B+) on global layers and ``local_theta`` on sliding ones."""
    types = ["full_attention" if (i + 1) % global_every == 0 else "sliding_attention" for i in range(layers)]
    scaling = {"rope_type": "linear", "factor": global_scaling} if global_scaling else None
    return Gemma3TextConfig(
        hidden_size=hidden,
        intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=64,
        sliding_window=window,
        layer_types=types,
        query_pre_attn_scalar=scalar,
        rope_theta=theta,
        rope_local_base_freq=local_theta,
        rope_scaling=scaling,
        final_logit_softcapping=final_cap,
        rms_norm_eps=eps,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )


@st.composite
def gemma3_configs(
    draw: st.DrawFn,
    *,
    n_kv: Any = st.sampled_from([1, 2]),
    ratio: Any = st.sampled_from([1, 2]),
    head_dim: Any = st.sampled_from([4, 8]),
    hidden_per_head: Any = st.sampled_from([4, 8]),
    d_model: Any = None,
    n_layers: Any = st.integers(1, 3),
    global_every: Any = st.sampled_from([1, 2]),
    d_mlp: Any = st.sampled_from([16, 40]),
    vocab: Any = st.integers(16, 128),
    window: Any = st.sampled_from([2, 3, 16]),
    scalar: Any = st.sampled_from([4, 16, 256]),
    theta: Any = st.sampled_from([1000.0, 1000000.0]),
    local_theta: Any = st.sampled_from([10.0, 10000.0]),
    global_scaling: Any = st.sampled_from([None, 8.0]),
    final_cap: Any = st.sampled_from([None, None, 2.0]),
    tied: Any = st.booleans(),
) -> Gemma3TextConfig:
    """Tiny Gemma 3 configs: sliding (2, 3 or 16 tokens) and global layers, different RoPE bases on the two (and
    linear scaling on global layers), per-head q/k norms, ``query_pre_attn_scalar`` unlike ``head_dim``, an optional
    final-logit softcap, GQA and multi-query attention, tied and untied embeddings."""
    kv = draw(as_strategy(n_kv), label="n_kv")
    heads = kv * draw(as_strategy(ratio), label="gqa ratio")
    hidden = (
        heads * draw(as_strategy(hidden_per_head), label="hidden per head")
        if d_model is None
        else draw(as_strategy(d_model), label="d_model")
    )
    return gemma3_config(
        n_heads=heads,
        n_kv=kv,
        head_dim=draw(as_strategy(head_dim), label="head_dim"),
        hidden=hidden,
        layers=draw(as_strategy(n_layers), label="n_layers"),
        global_every=draw(as_strategy(global_every), label="global every"),
        d_mlp=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        window=draw(as_strategy(window), label="window"),
        scalar=draw(as_strategy(scalar), label="query_pre_attn_scalar"),
        theta=draw(as_strategy(theta), label="theta"),
        local_theta=draw(as_strategy(local_theta), label="local theta"),
        global_scaling=draw(as_strategy(global_scaling), label="global scaling"),
        final_cap=draw(as_strategy(final_cap), label="final softcap"),
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


#: properties that must see a local and a global layer with different RoPE bases and a short window on every run
LOCAL_GLOBAL_PROPERTIES = (
    "test_pattern_matches_hf_eager",
    "test_pattern_and_query_edits_are_used",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_edits_during_generation_match_one_pass",
    "test_identity_hooks_keep_logits",
)


class Gemma3Contract(AdapterContract):
    """Every generic adapter property on tiny Gemma 3 text models; a sliding then a global layer (different RoPE
    bases, linear scaling on the global one, a short window) is a stratum of the pattern, edit and generation
    properties."""

    plugin = lensadapters_gemma3
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, True, False
    post_norms = {"hook_attn_out": "ln1_post", "hook_mlp_out": "ln2_post"}
    logit_softcap = "final_logit_softcapping"
    # q_norm between hook_q and the scores: doubling hook_q changes nothing, its output and hook_rot_q are linear
    score_linear_points = ("attn.hook_rot_q", "attn.q_norm.hook_normalized")
    score_invariant_points = ("attn.hook_q",)
    config_strata = {"local and global": LOCAL_GLOBAL_PROPERTIES}
    config_strategy = gemma3_configs
    stratum_overrides = {
        "local and global": {
            "n_layers": 2,
            "global_every": 2,
            "global_scaling": 8.0,
            "window": st.sampled_from([2, 3]),
            "local_theta": 10.0,
        }
    }
    # the LoRA and 8-bit matrices build two models per example (or save and reload one): smaller ones
    matrix_overrides = dict(
        n_kv=1,
        ratio=2,
        head_dim=8,
        hidden_per_head=8,
        n_layers=2,
        global_every=2,
        d_mlp=24,
        vocab=64,
        window=3,
        global_scaling=None,
        final_cap=None,
    )

    def make_model(self, config: Any, seed: int, attn_implementation: Optional[str] = None) -> torch.nn.Module:
        model = super().make_model(config, seed, attn_implementation)
        gemma_reinit(model, seed)
        return model

    def config_label(self, config: Any) -> Optional[str]:
        return f"layer types {config.layer_types}"
