"""Test kit of lensadapters-gemma4 (needs ``lensadapters[testing]`` and transformers 5.x): ``Gemma4Contract``
(``LENSADAPTERS_CONTRACT``, run by ``lensadapters check gemma4``; the plugin's tests subclass it),
``gemma4_config(...)`` (one tiny config) and ``gemma4_configs(**overrides)`` (their strategy). Importing
``lensadapters_gemma4`` never imports it.
"""

from __future__ import annotations

from typing import Any, Optional

from hypothesis import strategies as st
from torch import nn
from transformers import Gemma4TextConfig, Gemma4UnifiedTextConfig

import lensadapters_gemma4
from lensadapters import hf
from lensadapters.testing.families import SMALL_MATRIX, DecoderContract, QKNormScores, config_strategy, declared_config

__all__ = ["Gemma4Contract", "gemma4_config", "gemma4_configs"]


def _gemma4_fields(given: dict[str, Any]) -> dict[str, Any]:
    """The fields a Gemma 4 config derives from its keywords: layer types, RoPE of each kind, the per-layer inputs'
    and the experts' fields."""
    unified, ple, experts = given["unified"], given["ple"], given["experts"]
    if unified and (ple or experts):
        raise ValueError("a gemma4_unified_text config has neither per-layer inputs nor experts: ple=0, experts=0")
    full_rope = {"rope_type": "proportional", "partial_rotary_factor": given["partial_rotary"]}
    derived: dict[str, Any] = {
        "global_head_dim": given["global_head_dim"] or given["head_dim"],
        "layer_types": hf.sliding_layers(given["layers"], given["global_every"], last_full=True),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": given["local_theta"]},
            "full_attention": {**full_rope, "rope_theta": given.get("theta", 10000.0)},
        },
    }
    if not unified:  # the per-layer inputs' fields (none in a unified config)
        derived.update(hidden_size_per_layer_input=ple, vocab_size_per_layer_input=given.get("vocab", 64))
    if experts:
        derived.update(enable_moe_block=True, num_experts=experts, top_k_experts=given["top_k"])
        derived.update(moe_intermediate_size=8)
    return derived


gemma4_config = declared_config(
    "gemma4_config",
    lambda given: Gemma4UnifiedTextConfig if given["unified"] else Gemma4TextConfig,
    """A tiny Gemma 4 text config (``decoder_config``'s shared fields; bos 2, eos 1, pad 0): every
    ``global_every``-th layer and the last one full attention (Gemma 4's last layer always is), the others sliding;
    full layers with head size ``global_head_dim`` (``head_dim`` by default) and proportional RoPE on
    ``partial_rotary`` of each head (base ``theta``), sliding ones with default RoPE of base ``local_theta``;
    per-layer inputs of width ``ple`` (0: none); ``experts`` (0: none) experts of width 8 beside every layer's MLP
    (``enable_moe_block``), ``top_k`` of them per token. ``unified``: a ``Gemma4UnifiedTextConfig``
    (``gemma4_unified_text``: no per-layer inputs, no experts; ``ple`` and ``experts`` must be 0).""",
    keywords={
        **dict(head_dim=8, global_head_dim=None, layers=2, global_every=2, window=3, local_theta=10.0),
        **dict(partial_rotary=0.25, ple=4, final_cap=None, tied=True, experts=0, top_k=2, unified=False),
        **dict(act="gelu_pytorch_tanh", act_field="hidden_activation", **lensadapters_gemma4.TOKENS),
    },
    fields={
        **dict(window="sliding_window", final_cap="final_logit_softcapping", theta=None, local_theta=None),
        **dict(global_every=None, partial_rotary=None, ple=None, experts=None, top_k=None, unified=None),
    },
    derive=_gemma4_fields,
)


gemma4_configs = config_strategy(
    gemma4_config,
    """Tiny Gemma 4 text configs: sliding (2, 3 or 16 tokens) and full layers, default RoPE on sliding layers and
    proportional RoPE (a quarter or half of each head) on full ones, per-head q/k/v norms, per-layer inputs (or
    none), an optional final-logit softcap, GQA and multi-query attention, tied and untied embeddings, and (one draw
    in three) three experts beside every layer's MLP, top-1 or top-2; ``unified=True``: ``gemma4_unified_text``
    configs (``ple=0, experts=0`` with it). Heads are
    as wide on full layers as on sliding ones here (the stacked weights need one size; the plugin's exactness test
    covers wider full layers).""",
    n_kv=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([4, 8]),
    hidden_per_head=st.sampled_from([4, 8]),
    n_layers=st.integers(1, 3),
    global_every=st.sampled_from([1, 2]),
    d_mlp=st.sampled_from([16, 40]),
    vocab=st.integers(16, 128),
    window=st.sampled_from([2, 3, 16]),
    theta=st.sampled_from([1000.0, 1000000.0]),
    local_theta=st.sampled_from([10.0, 10000.0]),
    partial_rotary=st.sampled_from([0.25, 0.5]),
    ple=st.sampled_from([0, 4]),
    final_cap=st.sampled_from([None, None, 2.0]),
    tied=st.booleans(),
    experts=st.sampled_from([0, 0, 3]),
    top_k=st.sampled_from([1, 2]),
    unified=False,
)

#: properties that must see a sliding and a full layer with per-layer inputs on every run
LOCAL_GLOBAL_PROPERTIES = (
    "test_pattern_matches_hf_eager",
    "test_pattern_and_query_edits_are_used",
    "test_edits_during_generation_match_one_pass",
    "test_identity_hooks_keep_logits",
)

#: properties that must see experts beside the MLP on every run (a draw in three has them otherwise)
EXPERTS_PROPERTIES = (
    "test_hook_points_match_declared_capabilities",
    "test_every_hook_point_edit_changes_logits",
    "test_weight_and_residual_identities",
)

#: properties that must see a ``gemma4_unified_text`` model (a sliding and a full layer) on every run
UNIFIED_PROPERTIES = (*LOCAL_GLOBAL_PROPERTIES, *EXPERTS_PROPERTIES)


class Gemma4Contract(QKNormScores, DecoderContract):
    """Every generic adapter property on tiny Gemma 4 text models; a sliding then a full layer with per-layer
    inputs and a short window is a stratum of the pattern, edit and generation properties, as is a
    ``gemma4_unified_text`` model (``Gemma4UnifiedForCausalLM``)."""

    plugin = lensadapters_gemma4
    post_norms = {"hook_attn_out": "ln1_post", "hook_mlp_out": "ln2_post"}
    logit_softcap = "final_logit_softcapping"
    mixed_values = "attn.v_norm.hook_normalized"
    absorbed_points = ("ln1.hook_scale",)  # q, k and v are all normalized per head after ln1
    attn_implementations = ("eager", "sdpa")
    config_strata = {
        "sliding and full": LOCAL_GLOBAL_PROPERTIES,
        "experts": EXPERTS_PROPERTIES,
        "unified": UNIFIED_PROPERTIES,
    }
    config_strategy = gemma4_configs
    stratum_overrides = {
        "sliding and full": {"n_layers": 2, "global_every": 2, "ple": 4, "window": st.sampled_from([2, 3])},
        "experts": {"experts": 3, "n_layers": st.integers(1, 2)},
        "unified": {"unified": True, "ple": 0, "experts": 0, "n_layers": 2, "global_every": 2, "window": 2},
    }
    #: the cross-cutting matrices (bnb, PEFT) on dense models: the experts are the plugin's own tests'
    matrix_overrides = {**SMALL_MATRIX, **dict(head_dim=8, n_layers=2, global_every=2, window=3, experts=0)}

    def pre_ln_residual(self, model: nn.Module) -> bool:
        # the per-layer-input branch adds a third term to the residual stream after the MLP's
        config: Any = model.config
        return not getattr(config, "hidden_size_per_layer_input", 0)

    def config_label(self, config: Any) -> Optional[str]:
        experts = f", {config.num_experts} experts" if getattr(config, "enable_moe_block", False) else ""
        ple = getattr(config, "hidden_size_per_layer_input", None)
        kind = f"per-layer inputs {ple}" if ple is not None else "unified"
        return f"layer types {config.layer_types}, {kind}{experts}"
