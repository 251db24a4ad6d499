"""Test kit of lensadapters-mixtral: configs and the contract class (needs ``lensadapters[testing]``).

``MixtralContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check mixtral``
runs it): the generic properties in their mixture-of-experts form and the MoE properties of
:class:`lensadapters.testing.moe.MoEContract`. ``mixtral_configs(**overrides)`` draws tiny ``MixtralConfig``s
(every keyword a fixed value or a strategy); ``mixtral_config(...)`` builds one.

Importing ``lensadapters_mixtral`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import MixtralConfig

import lensadapters_mixtral
from lensadapters.testing.moe import MoEContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["MixtralContract", "mixtral_config", "mixtral_configs"]


def mixtral_config(
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    head_dim: int = 8,
    hidden: int = 32,
    layers: int = 1,
    d_mlp: int = 16,
    vocab: int = 64,
    experts: int = 4,
    top_k: int = 2,
    theta: float = 10000.0,
    sliding_window: Optional[int] = None,
    tied: bool = False,
    act: str = "silu",
    eps: float = 1e-6,
    max_pos: int = 32,
) -> MixtralConfig:
    """A tiny Mixtral config (bos 1, eos 2, pad 0)."""
    return MixtralConfig(
        hidden_size=hidden,
        intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        rms_norm_eps=eps,
        hidden_act=act,
        tie_word_embeddings=tied,
        rope_theta=theta,
        sliding_window=sliding_window,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        router_jitter_noise=0.0,
        attention_dropout=0.0,
        output_router_logits=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@st.composite
def mixtral_configs(
    draw: st.DrawFn,
    *,
    experts: Any = st.integers(2, 5),
    top_k: Any = None,
    n_kv: Any = st.sampled_from([1, 2]),
    ratio: Any = st.sampled_from([1, 2]),
    head_dim: Any = st.sampled_from([4, 8]),
    hidden_per_head: Any = st.sampled_from([4, 8]),
    n_layers: Any = st.integers(1, 2),
    d_mlp: Any = st.sampled_from([8, 16, 24]),
    vocab: Any = st.integers(16, 96),
    theta: Any = st.sampled_from([100.0, 10000.0, 1e6]),
    sliding_window: Any = None,
    tied: Any = st.booleans(),
    act: Any = st.sampled_from(["silu", "silu", "gelu_new"]),
    eps: Any = st.sampled_from([1e-6, 1e-5]),
) -> MixtralConfig:
    """Tiny Mixtral configs: 2 to 5 experts, top-k from 1 to every expert (``top_k`` defaults to a draw in
    ``1..min(experts, 4)``), GQA and multi-query attention, ``head_dim`` apart from ``hidden / heads``, tied and
    untied embeddings. No sliding window by default (the generic properties assume every earlier key is attended;
    ``tests/test_mixtral.py`` checks sliding windows on their own)."""
    n = draw(as_strategy(experts), label="experts")
    k = draw(st.integers(1, min(n, 4)) if top_k is None else as_strategy(top_k), label="top_k")
    kv = draw(as_strategy(n_kv), label="n_kv")
    heads = kv * draw(as_strategy(ratio), label="gqa ratio")
    return mixtral_config(
        n_heads=heads,
        n_kv=kv,
        head_dim=draw(as_strategy(head_dim), label="head_dim"),
        hidden=heads * draw(as_strategy(hidden_per_head), label="hidden per head"),
        layers=draw(as_strategy(n_layers), label="n_layers"),
        d_mlp=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        experts=n,
        top_k=k,
        theta=draw(as_strategy(theta), label="theta"),
        sliding_window=draw(as_strategy(sliding_window), label="sliding_window"),
        tied=draw(as_strategy(tied), label="tied"),
        act=draw(as_strategy(act), label="act"),
        eps=draw(as_strategy(eps), label="eps"),
    )


class MixtralContract(MoEContract):
    """Every generic adapter property (in its MoE form) and the MoE properties on tiny Mixtral models: 2-6
    experts, top-1 to top-every-expert routing, every experts implementation of transformers 5."""

    plugin = lensadapters_mixtral
    config_strategy = mixtral_configs
    # the LoRA matrix builds two models per example: smaller ones
    matrix_overrides = dict(experts=st.integers(2, 3), n_layers=st.integers(1, 2))
    # gated_mlp: no block has the dense mlp.hook_pre_linear (each expert is gated: mlp.experts.{e}.hook_gate)
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, False, False

    def config_label(self, config: Any) -> Optional[str]:
        return f"top-{config.num_experts_per_tok} of {config.num_local_experts}"
