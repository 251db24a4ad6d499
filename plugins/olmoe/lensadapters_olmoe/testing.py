"""Test kit of lensadapters-olmoe: configs and the contract class (needs ``lensadapters[testing]``).

``OlmoeContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check olmoe`` runs
it): the generic properties in their mixture-of-experts form, the MoE properties of
:class:`lensadapters.testing.moe.MoEContract` and the q/k-norm forms. ``olmoe_configs(**overrides)`` draws tiny
``OlmoeConfig``s (every keyword a fixed value or a strategy); ``olmoe_config(...)`` builds one.

Importing ``lensadapters_olmoe`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from hypothesis import strategies as st
from transformers import OlmoeConfig

import lensadapters_olmoe
from lensadapters.testing.moe import MoEContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["OlmoeContract", "olmoe_config", "olmoe_configs"]


def olmoe_config(
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    hidden: int = 32,
    layers: int = 1,
    d_mlp: int = 16,
    vocab: int = 64,
    experts: int = 4,
    top_k: int = 2,
    norm_topk_prob: bool = False,
    clip_qkv: Optional[float] = None,
    theta: float = 10000.0,
    tied: bool = False,
    attention_bias: bool = False,
    act: str = "silu",
    eps: float = 1e-5,
    max_pos: int = 32,
) -> OlmoeConfig:
    """A tiny OLMoE config (bos 1, eos 2, pad 0); ``head_dim`` is ``hidden / n_heads``, as OLMoE requires."""
    return OlmoeConfig(
        hidden_size=hidden,
        intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        attention_bias=attention_bias,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        rms_norm_eps=eps,
        hidden_act=act,
        tie_word_embeddings=tied,
        rope_theta=theta,
        clip_qkv=clip_qkv,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        attention_dropout=0.0,
        output_router_logits=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@st.composite
def olmoe_configs(
    draw: st.DrawFn,
    *,
    experts: Any = st.integers(2, 5),
    top_k: Any = None,
    norm_topk_prob: Any = st.booleans(),
    n_layers: Any = st.integers(1, 2),
    n_kv: Any = st.sampled_from([1, 2]),
    ratio: Any = st.sampled_from([1, 2]),
    head_dim: Any = st.sampled_from([4, 8]),
    d_mlp: Any = st.sampled_from([8, 16, 24]),
    vocab: Any = st.integers(16, 96),
    theta: Any = st.sampled_from([100.0, 10000.0, 1e6]),
    tied: Any = st.booleans(),
    attention_bias: Any = st.booleans(),
    act: Any = st.sampled_from(["silu", "silu", "gelu_new"]),
    eps: Any = st.sampled_from([1e-6, 1e-5]),
) -> OlmoeConfig:
    """Tiny OLMoE configs: 2 to 5 experts, top-k from 1 to every expert (``top_k`` defaults to a draw in
    ``1..min(experts, 4)``), renormalized top-k or raw probabilities, GQA and multi-query attention, attention
    biases, tied embeddings. ``clip_qkv`` stays ``None`` (the plugin refuses it)."""
    n = draw(as_strategy(experts), label="experts")
    k = draw(st.integers(1, min(n, 4)) if top_k is None else as_strategy(top_k), label="top_k")
    kv = draw(as_strategy(n_kv), label="n_kv")
    heads = kv * draw(as_strategy(ratio), label="gqa ratio")
    return olmoe_config(
        n_heads=heads,
        n_kv=kv,
        hidden=heads * draw(as_strategy(head_dim), label="head_dim"),
        layers=draw(as_strategy(n_layers), label="n_layers"),
        d_mlp=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        experts=n,
        top_k=k,
        norm_topk_prob=draw(as_strategy(norm_topk_prob), label="norm_topk_prob"),
        theta=draw(as_strategy(theta), label="theta"),
        tied=draw(as_strategy(tied), label="tied"),
        attention_bias=draw(as_strategy(attention_bias), label="attention_bias"),
        act=draw(as_strategy(act), label="act"),
        eps=draw(as_strategy(eps), label="eps"),
    )


class OlmoeContract(MoEContract):
    """Every generic adapter property (in its MoE and q/k-norm forms) and the MoE properties on tiny OLMoE models:
    2-5 experts, top-1 to top-every-expert routing with and without renormalization, every experts implementation of
    transformers 5, transformers 4.57's own attention classes."""

    plugin: ClassVar[Any] = lensadapters_olmoe
    config_strategy = olmoe_configs
    # the LoRA matrix builds two models per example: smaller ones
    matrix_overrides = dict(experts=st.integers(2, 3), n_layers=st.integers(1, 2))
    # gated_mlp: no block has the dense mlp.hook_pre_linear (each expert is gated: mlp.experts.{e}.hook_gate)
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, False, False
    # q_norm between hook_q and the scores: doubling hook_q changes nothing, its output and hook_rot_q are linear
    score_linear_points = ("attn.hook_rot_q", "attn.q_norm.hook_normalized")
    score_invariant_points = ("attn.hook_q",)

    def config_label(self, config: Any) -> Optional[str]:
        norm = "renormalized" if config.norm_topk_prob else "raw"
        return f"top-{config.num_experts_per_tok} of {config.num_experts} ({norm})"
