"""Test kit of lensadapters-qwen3-5 (needs ``lensadapters[testing]``; the models need transformers 5):
``Qwen3_5Contract`` (``LENSADAPTERS_CONTRACT``; the plugin's tests subclass it), ``qwen3_5_config(...)`` (one tiny
Qwen 3.5 text config, dense or MoE) and ``qwen3_5_configs(**overrides)`` (their strategy). Importing
``lensadapters_qwen3_5`` never imports it."""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

from hypothesis import strategies as st

import lensadapters_qwen3_5
from lensadapters.testing.families import (
    DecoderContract,
    OffsetNormModels,
    QKNormScores,
    config_strategy,
)
from lensadapters_qwen3_5.configs import qwen3_5_config

__all__ = ["Qwen3_5Contract", "qwen3_5_config", "qwen3_5_configs"]


def _drawn_config(*, moe: bool, kinds: list[str], linear: tuple[int, int, int, int], **drawn: Any) -> Any:
    key_heads, ratio, key_dim, value_dim = linear
    return qwen3_5_config(
        moe=moe,
        layer_types=kinds,
        linear_heads=(key_heads, key_heads * ratio),
        linear_dims=(key_dim, value_dim),
        **drawn,
    )


def _kinds(drawn: dict[str, Any]) -> Any:
    kinds = st.sampled_from(["linear_attention", "full_attention"])
    # both kinds: transformers' Qwen 3.5 cannot run a cache without a full-attention layer (get_seq_length)
    return st.lists(kinds, min_size=2, max_size=3).filter(lambda k: len(set(k)) == 2)


qwen3_5_configs = config_strategy(
    _drawn_config,
    """Tiny Qwen 3.5 text configs, dense or MoE: two or three layers, each a gated DeltaNet or a gated full
    attention (at least one of each), GQA in both (the DeltaNet's value heads a multiple of its key heads), partial
    or full rotary, convolutions of width 2 or 4, tied or untied embeddings.""",
    moe=st.booleans(),
    kinds=_kinds,
    linear=st.tuples(
        st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([4, 8]), st.sampled_from([4, 6])
    ),
    n_kv=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([4, 8]),
    partial_rotary_factor=st.sampled_from([0.5, 1.0]),
    conv_kernel=st.sampled_from([2, 4]),
    vocab=st.integers(16, 64),
    tied=st.booleans(),
)


class Qwen3_5Contract(OffsetNormModels, QKNormScores, DecoderContract):
    """Every generic adapter property on tiny hybrid Qwen 3.5 models (gated DeltaNet and gated attention layers,
    dense or MoE)."""

    plugin: ClassVar[Any] = lensadapters_qwen3_5
    config_strategy = qwen3_5_configs
    attn_implementations: ClassVar[Sequence[str]] = ("eager", "sdpa")
    #: the gated DeltaNet's points that a scale-invariant norm reads (the delta rule's L2 norm of queries and keys, the
    #: gated RMSNorm of its output): edited along directions of their own scale in the gradient property, as a
    #: head's output can be tiny (the first real token, from an empty state) and a unit-scale step then leaves the
    #: norm's linear regime
    gradient_scaled_points: ClassVar[tuple[str, ...]] = (
        "linear_attn.hook_q",
        "linear_attn.hook_k",
        "linear_attn.hook_recurrent",
    )

    def config_label(self, config: Any) -> Optional[str]:
        moe = "moe" if lensadapters_qwen3_5.is_moe(config) else "dense"
        return f"{moe} {''.join('L' if k == 'linear_attention' else 'F' for k in config.layer_types)}"
