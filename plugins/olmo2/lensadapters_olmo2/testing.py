"""Test kit of lensadapters-olmo2: configs and the contract class (needs ``lensadapters[testing]``).

``Olmo2Contract`` is the plugin's contract suite (``LENSADAPTERS_CONTRACT``: ``lensadapters check olmo2`` runs it);
the plugin's tests subclass it and mix the LoRA and 8-bit variants in front of it. ``olmo2_configs(**overrides)``
draws tiny ``Olmo2Config``s (every keyword a fixed value or a strategy). Importing ``lensadapters_olmo2`` itself
never imports this module.
"""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import Olmo2Config

import lensadapters_olmo2
from lensadapters.testing import AdapterContract
from lensadapters.testing.strategies import as_strategy

__all__ = ["Olmo2Contract", "olmo2_config", "olmo2_configs"]


def olmo2_config(
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    hidden: int = 32,
    layers: int = 1,
    d_mlp: int = 32,
    vocab: int = 64,
    theta: float = 10000.0,
    tied: bool = False,
    attention_bias: bool = False,
    eps: float = 1e-6,
    act: str = "silu",
) -> Olmo2Config:
    """A tiny OLMo 2 config (bos 1, eos 2, pad 0)."""
    return Olmo2Config(
        hidden_size=hidden,
        intermediate_size=d_mlp,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        vocab_size=vocab,
        max_position_embeddings=64,
        rms_norm_eps=eps,
        hidden_act=act,
        tie_word_embeddings=tied,
        attention_bias=attention_bias,
        rope_theta=theta,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@st.composite
def olmo2_configs(
    draw: st.DrawFn,
    *,
    n_kv: Any = st.sampled_from([1, 2, 4]),
    ratio: Any = st.sampled_from([1, 2]),
    hidden_per_head: Any = st.sampled_from([4, 8]),
    n_layers: Any = st.integers(1, 2),
    d_mlp: Any = st.sampled_from([16, 40]),
    vocab: Any = st.integers(16, 128),
    theta: Any = st.sampled_from([100.0, 500000.0]),
    tied: Any = st.booleans(),
    attention_bias: Any = st.booleans(),
    act: Any = st.sampled_from(["silu", "gelu_new"]),
) -> Olmo2Config:
    """Tiny OLMo 2 configs: post norms only, q/k norms over the projection width, multi-head (OLMo-2 1B-13B),
    grouped (32B) and multi-query attention, with and without ``attention_bias``, tied and untied embeddings."""
    kv = draw(as_strategy(n_kv), label="n_kv")
    heads = kv * draw(as_strategy(ratio), label="gqa ratio")
    return olmo2_config(
        n_heads=heads,
        n_kv=kv,
        hidden=heads * draw(as_strategy(hidden_per_head), label="hidden per head"),
        layers=draw(as_strategy(n_layers), label="n_layers"),
        d_mlp=draw(as_strategy(d_mlp), label="d_mlp"),
        vocab=draw(as_strategy(vocab), label="vocab"),
        theta=draw(as_strategy(theta), label="theta"),
        tied=draw(as_strategy(tied), label="tied"),
        attention_bias=draw(as_strategy(attention_bias), label="bias"),
        act=draw(as_strategy(act), label="act"),
    )


class Olmo2Contract(AdapterContract):
    """Every generic adapter property on tiny OLMo 2 models."""

    plugin = lensadapters_olmo2
    learned_positions, rotary, gated_mlp, parallel_blocks = False, True, True, False
    # no norms before attention and MLP; norms after them and on the whole query/key projections
    pre_norms = False
    post_norms = {"hook_attn_out": "ln1_post", "hook_mlp_out": "ln2_post"}
    score_linear_points = ("attn.hook_rot_q", "attn.q_norm.hook_normalized")
    score_invariant_points = ("attn.hook_q",)
    config_strategy = olmo2_configs
    # the LoRA and 8-bit matrices build two models per example (or save and reload one): smaller ones
    matrix_overrides = dict(
        n_kv=st.sampled_from([1, 2]), ratio=st.sampled_from([1, 2]), hidden_per_head=8, n_layers=1, d_mlp=24, vocab=64
    )

    def config_label(self, config: Any) -> Optional[str]:
        return f"{config.num_attention_heads}:{config.num_key_value_heads} heads"
