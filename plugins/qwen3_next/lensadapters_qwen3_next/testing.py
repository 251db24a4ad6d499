"""Test kit of lensadapters-qwen3-next (needs ``lensadapters[testing]``; transformers 4.57 or 5):
``Qwen3NextContract`` (``LENSADAPTERS_CONTRACT``; the plugin's tests subclass it), ``qwen3_next_config(...)`` (one tiny
Qwen3-Next config, dense or MoE) and ``qwen3_next_configs(**overrides)`` (their strategy). Importing
``lensadapters_qwen3_next`` never imports it."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Optional, Sequence

from hypothesis import strategies as st

import lensadapters_qwen3_next
from lensadapters.testing.families import (
    DecoderContract,
    OffsetNormModels,
    QKNormScores,
    config_strategy,
)
from lensadapters_qwen3_next.configs import qwen3_next_config

__all__ = ["Qwen3NextContract", "qwen3_next_config", "qwen3_next_configs"]


def _drawn_config(*, moe: bool, kinds: list[str], linear: tuple[int, int, int, int], **drawn: Any) -> Any:
    key_heads, ratio, key_dim, value_dim = linear
    return qwen3_next_config(
        moe=moe,
        layer_types=kinds,
        linear_heads=(key_heads, key_heads * ratio),
        linear_dims=(key_dim, value_dim),
        **drawn,
    )


def _kinds(drawn: dict[str, Any]) -> Any:
    kinds = st.sampled_from(["linear_attention", "full_attention"])
    # both kinds: transformers' Qwen3-Next cannot run a cache without a full-attention layer (get_seq_length)
    return st.lists(kinds, min_size=2, max_size=3).filter(lambda k: len(set(k)) == 2)


#: MoE models are served on transformers 4.57 and 5 (kept for the tests that import it)
MOE_SERVED = True

qwen3_next_configs = config_strategy(
    _drawn_config,
    """Tiny Qwen3-Next configs, dense or MoE: two or three layers, each a gated DeltaNet or a gated full
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


#: an edit at every point, in place and returned, and the declared points: they hold on dense and MoE models alike
#: (the kit's MoE form on the MoE layers) and run on one of each on every run, each drawn once, the MoE one with
#: two layers (an edit at every point of a hybrid MoE toy is the suite's costliest example)
EVERY_POINT = (
    "test_hook_points_match_declared_capabilities",
    "test_every_hook_point_edit_changes_logits",
    "test_in_place_edits_equal_returned_edits",
)
#: the generic properties this contract refuses on the drawn hybrid models, each with why (the plugin's README,
#: "Tested", lists them)
NOT_SERVED: dict[str, str] = {
    "test_zero_ablating_a_head_removes_its_output": "the property reads the stacked W_O, refused on a hybrid model "
    "(its linear-attention layers have no heads)",
    "test_weight_and_residual_identities": "the stacked W_Q/W_O identities, refused on a hybrid model "
    "(lensadapters_qwen3_next.query_weights serves a full-attention layer's)",
    "test_pattern_matches_hf_eager": "the kit's eager reference counts every layer as softmax attention",
    "test_pattern_and_query_edits_are_used": "the property checks hook_z = pattern @ v; here hook_z is after the "
    "output gate, (pattern @ v) * sigmoid(gate) (checked in the plugin's tests)",
}


class Qwen3NextContract(OffsetNormModels, QKNormScores, DecoderContract):
    """Every generic adapter property on tiny hybrid Qwen3-Next models (gated DeltaNet and gated attention layers,
    dense or MoE)."""

    plugin: ClassVar[Any] = lensadapters_qwen3_next
    config_strategy = qwen3_next_configs
    attn_implementations: ClassVar[Sequence[str]] = ("eager", "sdpa")
    #: the gated DeltaNet's points that a scale-invariant norm reads (the delta rule's L2 norm of queries and keys, the
    #: gated RMSNorm of its output): edited along directions of their own scale in the gradient property, as a
    #: head's output can be tiny (the first real token, from an empty state) and a unit-scale step then leaves the
    #: norm's linear regime
    #: The embeddings and the residual stream before a block too (read by ``ln1``'s RMSNorm): the toys' embeddings
    #: have a scale of 0.02, and a unit-scale step of 1e-2 moved an MoE model's top-k routing (its renormalized
    #: weights jump when the selection changes), so that finite differences missed the derivative autograd gives
    #: And the gated DeltaNet's output, ``linear_attn.hook_gated`` (its norm times ``silu(z)``): its values can be tiny
    #: (RMS 0.008 in a LoRA example) and a unit-scale step of 1e-2 through a LoRA-scaled ``out_proj`` (effective weight
    #: norm 14 against the base's 2.6) left the linear regime: finite differences gave -130 at that step and -836.62 at
    #: 1e-3 and 1e-4, where autograd gives -836.65 (float64; without LoRA on ``out_proj`` both agree at 1e-2)
    gradient_scaled_points: ClassVar[tuple[str, ...]] = (
        "linear_attn.hook_q",
        "linear_attn.hook_k",
        "linear_attn.hook_recurrent",
        "linear_attn.hook_gated",
        "hook_embed",
        "hook_resid_pre",
    )

    #: in the cross-cutting matrices (bnb, PEFT), dense models only: their MoE form is the MoE contracts', which
    #: these variants leave to each MoE architecture's own tests, and every example builds more than one model
    matrix_overrides: ClassVar[Mapping[str, Any]] = dict(moe=False)
    #: the delta rule L2-normalizes each head's keys and queries: where a tiny head's key is near zero its direction
    #: is mostly int8 rounding, and the drift reaches the rest of the model (over 65 random dense toys, 1 or 2 key
    #: heads of width 4 or 8: up to 0.41 per block at ``linear_attn.hook_gated``/``hook_attn_out``; the default 0.25 is
    #: Llama's 0.12 with a margin)
    quantized_drift_per_block: ClassVar[Optional[float]] = 0.6
    config_strata: ClassVar[Mapping[str, Sequence[str]]] = {"dense": EVERY_POINT, "moe": EVERY_POINT}
    stratum_overrides: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "dense": dict(moe=False),
        "moe": dict(moe=True, kinds=st.just(["linear_attention", "full_attention"])),
    }
    strata_only: ClassVar[Sequence[str]] = EVERY_POINT
    not_served: ClassVar[Mapping[str, str]] = NOT_SERVED

    def config_label(self, config: Any) -> Optional[str]:
        moe = "moe" if lensadapters_qwen3_next.is_moe(config) else "dense"
        return f"{moe} {''.join('L' if k == 'linear_attention' else 'F' for k in config.layer_types)}"
