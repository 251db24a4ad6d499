"""lensadapters-olmo2's test kit: ``Olmo2Contract`` (``lensadapters check``), ``olmo2_config`` and ``olmo2_configs``."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from transformers import Olmo2Config

import lensadapters_olmo2
from lensadapters.testing.families import DENSE_DRAWS, DecoderContract, config_strategy, decoder_config

__all__ = ["Olmo2Contract", "olmo2_config", "olmo2_configs"]


def olmo2_config(*, attention_bias: bool = False, **shared: Any) -> Olmo2Config:
    """A tiny OLMo 2 config (``decoder_config``'s shared fields)."""
    return decoder_config(Olmo2Config, attention_bias=attention_bias, **shared)


olmo2_configs = config_strategy(
    olmo2_config,
    """Tiny OLMo 2 configs: post norms only, q/k norms over the projection width, multi-head (OLMo-2 1B-13B),
    grouped (32B) and multi-query attention, with and without ``attention_bias``, tied and untied embeddings.""",
    **{
        **DENSE_DRAWS,
        "n_kv": st.sampled_from([1, 2, 4]),
        "ratio": st.sampled_from([1, 2]),
        "theta": st.sampled_from([100.0, 500000.0]),
    },
    attention_bias=st.booleans(),
)


class Olmo2Contract(DecoderContract):
    """Every generic adapter property on tiny OLMo 2 models."""

    plugin = lensadapters_olmo2
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
