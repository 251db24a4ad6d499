"""lensadapters-gemma2's test kit: ``Gemma2Contract``, ``gemma2_config`` and ``gemma2_configs``."""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from transformers import Gemma2Config

import lensadapters_gemma2
from lensadapters.testing.families import (
    HEAD_DRAWS,
    SMALL_MATRIX,
    DecoderContract,
    OffsetNormModels,
    config_strategy,
    declared_config,
)

__all__ = ["Gemma2Contract", "gemma2_config", "gemma2_configs"]


gemma2_config = declared_config(
    "gemma2_config",
    Gemma2Config,
    """A tiny Gemma 2 config (``decoder_config``'s shared fields; bos 2, eos 1, pad 0), eager attention; layers
    alternate sliding and global from layer 0 as HF's Gemma 2 does.""",
    keywords={
        **dict(head_dim=8, layers=2, window=3, scalar=8, attn_cap=50.0, final_cap=30.0),
        **dict(act="gelu_pytorch_tanh", act_field="hidden_activation", tied=True, attn_implementation="eager"),
        **dict(bos_token_id=2, eos_token_id=1),
    },
    fields={
        **dict(window="sliding_window", scalar="query_pre_attn_scalar"),
        **dict(attn_cap="attn_logit_softcapping", final_cap="final_logit_softcapping"),
    },
)


gemma2_configs = config_strategy(
    gemma2_config,
    """Tiny Gemma 2 configs: alternating sliding (2, 3 or 16 tokens) and global layers, ``query_pre_attn_scalar``
    unlike ``head_dim``, attention-logit and final-logit softcaps (small caps that bind on random weights, 50/30 as
    the checkpoints, or none), GQA and multi-query attention, tied and untied embeddings.""",
    **HEAD_DRAWS,
    n_layers=st.integers(1, 2),
    d_mlp=st.sampled_from([16, 40]),
    vocab=st.integers(16, 128),
    window=st.sampled_from([2, 3, 16]),
    scalar=st.sampled_from([4, 16, 256]),
    attn_cap=st.sampled_from([None, 3.0, 50.0]),
    final_cap=st.sampled_from([None, 2.0, 30.0]),
    theta=st.sampled_from([100.0, 10000.0]),
    tied=st.booleans(),
)
#: properties that must see binding softcaps and a window shorter than the input on every run
CAPPED_PROPERTIES = (
    "test_pattern_matches_hf_eager",
    "test_pattern_and_query_edits_are_used",
    "test_query_and_key_edits_reach_their_side_of_the_scores",
    "test_weight_and_residual_identities",
    "test_edits_during_generation_match_one_pass",
)


class Gemma2Contract(OffsetNormModels, DecoderContract):
    """Every generic adapter property on tiny Gemma 2 models (eager attention: transformers 5.x offers Gemma 2 no
    sdpa); binding softcaps with a short window on two layers is a stratum of the pattern, identity, edit and
    generation properties."""

    plugin = lensadapters_gemma2
    attn_implementations = ("eager",)
    post_norms = {"hook_attn_out": "ln1_post", "hook_mlp_out": "ln2_post"}
    logit_softcap = "final_logit_softcapping"
    score_softcap = "attn_logit_softcapping"
    config_strata = {"binding softcaps": CAPPED_PROPERTIES}
    config_strategy = gemma2_configs
    stratum_overrides = {
        "binding softcaps": {"attn_cap": 3.0, "final_cap": 2.0, "n_layers": 2, "window": st.sampled_from([2, 3])}
    }
    matrix_overrides = {
        **SMALL_MATRIX,
        **dict(head_dim=8, n_layers=2, window=3),
        **dict(attn_cap=st.sampled_from([None, 50.0]), final_cap=st.sampled_from([None, 30.0])),
    }

    def config_label(self, config: Any) -> Optional[str]:
        return f"softcaps {config.attn_logit_softcapping}/{config.final_logit_softcapping}"
