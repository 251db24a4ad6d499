"""lensadapters-gemma3's test kit: ``Gemma3Contract``, ``gemma3_config`` and ``gemma3_configs``."""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import Gemma3TextConfig

import lensadapters_gemma3
from lensadapters import hf
from lensadapters.testing.families import (
    HEAD_DRAWS,
    SMALL_MATRIX,
    DecoderContract,
    OffsetNormModels,
    QKNormScores,
    config_strategy,
    declared_config,
)

__all__ = ["Gemma3Contract", "gemma3_config", "gemma3_configs"]


gemma3_config = declared_config(
    "gemma3_config",
    Gemma3TextConfig,
    """A tiny Gemma 3 text config (``decoder_config``'s shared fields; bos 2, eos 1, pad 0): every
    ``global_every``-th layer global (Gemma 3's 5 local : 1 global pattern, shortened), the others sliding; RoPE
    base ``theta`` (with linear scaling by ``global_scaling`` as Gemma-3-4B+) on global layers and ``local_theta`` on
    sliding ones.""",
    keywords={
        **dict(head_dim=8, layers=2, global_every=2, window=3, scalar=8, local_theta=10.0, global_scaling=None),
        **dict(final_cap=None, tied=True, act="gelu_pytorch_tanh", act_field="hidden_activation"),
        **lensadapters_gemma3.TOKENS,
    },
    fields={
        **dict(window="sliding_window", scalar="query_pre_attn_scalar", local_theta="rope_local_base_freq"),
        **dict(final_cap="final_logit_softcapping", global_every=None, global_scaling=None),
    },
    derive=lambda given: dict(
        layer_types=hf.sliding_layers(given["layers"], given["global_every"]),
        rope_scaling={"rope_type": "linear", "factor": given["global_scaling"]} if given["global_scaling"] else None,
    ),
)


gemma3_configs = config_strategy(
    gemma3_config,
    """Tiny Gemma 3 configs: sliding (2, 3 or 16 tokens) and global layers, different RoPE bases on the two (and
    linear scaling on global layers), per-head q/k norms, ``query_pre_attn_scalar`` unlike ``head_dim``, an optional
    final-logit softcap, GQA and multi-query attention, tied and untied embeddings.""",
    **HEAD_DRAWS,
    n_layers=st.integers(1, 3),
    global_every=st.sampled_from([1, 2]),
    d_mlp=st.sampled_from([16, 40]),
    vocab=st.integers(16, 128),
    window=st.sampled_from([2, 3, 16]),
    scalar=st.sampled_from([4, 16, 256]),
    theta=st.sampled_from([1000.0, 1000000.0]),
    local_theta=st.sampled_from([10.0, 10000.0]),
    global_scaling=st.sampled_from([None, 8.0]),
    final_cap=st.sampled_from([None, None, 2.0]),
    tied=st.booleans(),
)


#: properties that must see a local and a global layer with different RoPE bases and a short window on every run
LOCAL_GLOBAL_PROPERTIES = (
    "test_pattern_matches_hf_eager",
    "test_pattern_and_query_edits_are_used",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_edits_during_generation_match_one_pass",
    "test_identity_hooks_keep_logits",
)


class Gemma3Contract(QKNormScores, OffsetNormModels, DecoderContract):
    """Every generic adapter property on tiny Gemma 3 text models; a sliding then a global layer (different RoPE
    bases, linear scaling on the global one, a short window) is a stratum of the pattern, edit and generation
    properties."""

    plugin = lensadapters_gemma3
    post_norms = {"hook_attn_out": "ln1_post", "hook_mlp_out": "ln2_post"}
    logit_softcap = "final_logit_softcapping"
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
    matrix_overrides = {
        **SMALL_MATRIX,
        **dict(head_dim=8, n_layers=2, global_every=2, window=3, global_scaling=None, final_cap=None),
    }

    def config_label(self, config: Any) -> Optional[str]:
        return f"layer types {config.layer_types}"
