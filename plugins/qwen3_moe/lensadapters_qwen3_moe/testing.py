"""Test kit of lensadapters-qwen3-moe: configs and the contract class (needs ``lensadapters[testing]``).

``Qwen3MoeContract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``, so ``lensadapters check qwen3_moe``
runs it): the generic properties in their mixture-of-experts form, the MoE properties of
:class:`lensadapters.testing.moe.MoEContract` and the per-head q/k-norm forms. ``qwen3_moe_configs(**overrides)``
draws tiny ``Qwen3MoeConfig``s (every keyword a fixed value or a strategy); ``qwen3_moe_config(...)`` builds one.

Importing ``lensadapters_qwen3_moe`` itself never imports this module (nor hypothesis, nor pytest).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

from hypothesis import strategies as st
from transformers import Qwen3MoeConfig

import lensadapters_qwen3_moe
from lensadapters.testing.moe import MoEContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["Qwen3MoeContract", "qwen3_moe_config", "qwen3_moe_configs"]


def qwen3_moe_config(
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    head_dim: int = 8,
    hidden: int = 32,
    layers: int = 1,
    d_mlp: int = 16,
    dense_d_mlp: int = 24,
    vocab: int = 64,
    experts: int = 4,
    top_k: int = 2,
    norm_topk_prob: bool = False,
    mlp_only_layers: Sequence[int] = (),
    decoder_sparse_step: int = 1,
    theta: float = 10000.0,
    window: Optional[int] = None,
    tied: bool = False,
    attention_bias: bool = False,
    act: str = "silu",
    eps: float = 1e-6,
    max_pos: int = 32,
) -> Qwen3MoeConfig:
    """A tiny Qwen3-MoE config (bos 1, eos 2, pad 0): experts of width ``d_mlp``, dense layers of ``dense_d_mlp``."""
    return Qwen3MoeConfig(
        hidden_size=hidden,
        intermediate_size=dense_d_mlp,
        moe_intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        attention_bias=attention_bias,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        rms_norm_eps=eps,
        hidden_act=act,
        tie_word_embeddings=tied,
        rope_theta=theta,
        use_sliding_window=window is not None,
        sliding_window=window or 4096,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=decoder_sparse_step,
        attention_dropout=0.0,
        output_router_logits=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@st.composite
def qwen3_moe_configs(
    draw: st.DrawFn,
    *,
    experts: Any = st.integers(2, 5),
    top_k: Any = None,
    norm_topk_prob: Any = st.booleans(),
    n_layers: Any = st.integers(1, 3),
    dense: Any = st.sampled_from(["none", "none", "mlp_only_layers", "decoder_sparse_step"]),
    n_kv: Any = st.sampled_from([1, 2]),
    ratio: Any = st.sampled_from([1, 2]),
    head_dim: Any = st.sampled_from([4, 8]),
    hidden_per_head: Any = st.sampled_from([4, 8]),
    d_mlp: Any = st.sampled_from([8, 16]),
    dense_d_mlp: Any = st.sampled_from([12, 24]),
    vocab: Any = st.integers(16, 96),
    theta: Any = st.sampled_from([100.0, 10000.0, 1e6]),
    window: Any = None,
    tied: Any = st.booleans(),
    attention_bias: Any = st.booleans(),
    act: Any = st.sampled_from(["silu", "silu", "gelu_new"]),
    eps: Any = st.sampled_from([1e-6, 1e-5]),
) -> Qwen3MoeConfig:
    """Tiny Qwen3-MoE configs: 2 to 5 experts, top-k from 1 to every expert (``top_k`` defaults to a draw in
    ``1..min(experts, 4)``), renormalized top-k or raw probabilities, dense layers (``dense``: none, a drawn set of
    ``mlp_only_layers``, or ``decoder_sparse_step`` 2) next to sparse ones (at least one layer stays sparse), GQA
    and multi-query attention, ``head_dim`` apart from ``hidden / heads``, attention biases, tied embeddings. No
    sliding window by default (the generic properties assume every earlier key is attended)."""
    n = draw(as_strategy(experts), label="experts")
    k = draw(st.integers(1, min(n, 4)) if top_k is None else as_strategy(top_k), label="top_k")
    layers = draw(as_strategy(n_layers), label="n_layers")
    kind = draw(as_strategy(dense), label="dense layers")
    only: list[int] = []
    step = 1
    if kind == "mlp_only_layers" and layers > 1:
        sparse = draw(st.integers(0, layers - 1), label="a sparse layer")
        only = draw(
            st.lists(st.sampled_from([i for i in range(layers) if i != sparse]), unique=True, min_size=1),
            label="mlp_only_layers",
        )
    elif kind == "decoder_sparse_step" and layers > 1:
        step = 2
    kv = draw(as_strategy(n_kv), label="n_kv")
    heads = kv * draw(as_strategy(ratio), label="gqa ratio")
    return qwen3_moe_config(
        n_heads=heads,
        n_kv=kv,
        head_dim=draw(as_strategy(head_dim), label="head_dim"),
        hidden=heads * draw(as_strategy(hidden_per_head), label="hidden per head"),
        layers=layers,
        d_mlp=draw(as_strategy(d_mlp), label="d_mlp"),
        dense_d_mlp=draw(as_strategy(dense_d_mlp), label="dense d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        experts=n,
        top_k=k,
        norm_topk_prob=draw(as_strategy(norm_topk_prob), label="norm_topk_prob"),
        mlp_only_layers=sorted(only),
        decoder_sparse_step=step,
        theta=draw(as_strategy(theta), label="theta"),
        window=draw(as_strategy(window), label="window"),
        tied=draw(as_strategy(tied), label="tied"),
        attention_bias=draw(as_strategy(attention_bias), label="attention_bias"),
        act=draw(as_strategy(act), label="act"),
        eps=draw(as_strategy(eps), label="eps"),
    )


class Qwen3MoeContract(MoEContract):
    """Every generic adapter property (in its MoE and q/k-norm forms) and the MoE properties on tiny Qwen3-MoE
    models: 2-5 experts, top-1 to top-every-expert routing with and without renormalization, dense layers among the
    sparse ones, every experts implementation of transformers 5."""

    plugin: ClassVar[Any] = lensadapters_qwen3_moe
    config_strategy = qwen3_moe_configs
    # the LoRA matrix builds two models per example: smaller ones
    matrix_overrides = dict(experts=st.integers(2, 3), n_layers=st.integers(1, 2))
    # gated_mlp: a MoE block has no dense mlp.hook_pre_linear (each expert is gated: mlp.experts.{e}.hook_gate)
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, False, False
    # q_norm between hook_q and the scores: doubling hook_q changes nothing, its output and hook_rot_q are linear
    score_linear_points = ("attn.hook_rot_q", "attn.q_norm.hook_normalized")
    score_invariant_points = ("attn.hook_q",)

    def config_label(self, config: Any) -> Optional[str]:
        sparse = lensadapters_qwen3_moe.sparse_layers(config)
        norm = "renormalized" if config.norm_topk_prob else "raw"
        return f"top-{config.num_experts_per_tok} of {config.num_experts} ({norm}), sparse layers {sparse}"
