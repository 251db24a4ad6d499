"""Falcon-H1 with its real checkpoints' multipliers (tiiuae/Falcon-H1-*: every one of them other than 1) gets the
points it gets with unit multipliers, each what the model computes. The generic adapter finds every constant among
the config's numbers by exact checks on the probe, nothing named:

* ``attention_out_multiplier``/``ssm_out_multiplier``: ``hook_attn_out``/``hook_mixer_out`` are what the layer adds
  (the attention's and the Mamba mixer's outputs times them), ``W_O``/``b_O`` include the attention's constant;
* ``key_multiplier``: ``attn.hook_k`` is the keys the attention uses, ``k_proj(x) * key_multiplier`` (TransformerLens'
  ``hook_k``: the key the scores come from), ``W_K``/``b_K`` include it;
* ``mlp_multipliers`` ``[gate, down]``: ``mlp.hook_pre`` is the activation's input ``gate_proj(x) * gate``,
  ``mlp.hook_post`` the down projection's input, ``hook_mlp_out`` the MLP's output (``down_proj(.) * down``);
  ``W_gate``/``b_gate`` include ``gate``, ``W_out``/``b_out`` include ``down``.

Each point's value is checked against plain hooks on the HF modules, each edit's logits against a plain hook making
the same edit at the same place, and gradients through edits."""

from __future__ import annotations

import copy

import pytest
import torch

from lensadapters.adapters.generic.scan import SCAN_POINTS
from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import assert_verified_but_scan, block_points, relative_error, tiny_model, wrap_generic
from tests.falcon_h1_helpers import (
    EXACT,
    REAL,
    assert_edits_are_the_plain_hooks,
    assert_the_points_of_unit_multipliers,
    edit_gradient_error,
    multipliers,
    plain_edits,
    reference_values,
    unit_multiplier_points,
)

VARIANTS = {
    "real": REAL,
    "branches": {"attention_out_multiplier": 0.9375, "ssm_out_multiplier": 0.2357},
    "key": {"key_multiplier": 0.39},
    "mlp": {"mlp_multipliers": [0.88, 0.59]},
}


@pytest.fixture(scope="module")
def unit_points() -> list[set[str]]:
    return unit_multiplier_points()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_layer_gets_the_points_of_unit_multipliers_each_verified(variant: str, unit_points: list) -> None:
    hm = wrap_generic(tiny_model("falcon_h1", **VARIANTS[variant]))
    assert_the_points_of_unit_multipliers(hm, unit_points)
    assert_verified_but_scan(hm, 0)
    hm.unwrap()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_points_value_is_what_the_model_computes_with_its_multipliers(variant: str) -> None:
    model = tiny_model("falcon_h1", **VARIANTS[variant])
    reference = copy.deepcopy(model)
    m = multipliers(VARIANTS[variant])
    want = reference_values(reference, m)
    whole = want["hook_resid_pre"] + (want["hook_mixer_out"] + want["hook_attn_out"])
    assert torch.equal(want["hook_resid_mid"], whole)
    hm = wrap_generic(model)
    with torch.no_grad():
        plain = reference(input_ids()).logits
    # (reading the scores and pattern recomputes attention in eager form: not these points, other tests check them)
    skipped = ("hook_pattern", "hook_attn_scores")
    logits, cache = hm.run_with_cache(
        input_ids(), names_filter=lambda n: n.startswith("blocks.0.") and not n.endswith(skipped)
    )
    assert torch.equal(logits, plain)  # reading changes nothing
    for name in EXACT:
        assert torch.equal(cache[f"blocks.0.{name}"], want[name]), name  # bit for bit
    errors = {n: relative_error(cache[f"blocks.0.{n}"], want[n]) for n in ("attn.hook_rot_q", "attn.hook_rot_k")}
    errors["attn.hook_result"] = relative_error(cache["blocks.0.attn.hook_result"], want["attn.hook_result"])
    assert all(e < 1e-5 for e in errors.values()), errors
    # the weights include the constants: TransformerLens' identities hold where the layer's own sums make them hold
    c = lambda n: cache[f"blocks.0.{n}"]  # noqa: E731
    x = want["hook_q_input_read"]  # what the projections read (ln1's output)
    k_at_w = torch.einsum("bpm,hmd->bphd", x, hm._W_K[0]) + hm._b_K[0]  # the key heads' own
    assert relative_error(k_at_w, c("attn.hook_k")) < 1e-5
    z_at_w = torch.einsum("bphd,hdm->bpm", c("attn.hook_z"), hm.W_O[0]) + hm.b_O[0]
    assert relative_error(z_at_w, c("hook_attn_out")) < 1e-5
    assert relative_error(c("attn.hook_result").sum(-2) + hm.b_O[0], c("hook_attn_out")) < 1e-5
    assert relative_error(c("mlp.hook_post") @ hm.W_out[0] + hm.b_out[0], c("hook_mlp_out")) < 1e-5
    mlp_x = reference.model.layers[0].pre_ff_layernorm(want["hook_resid_mid"])
    assert relative_error(mlp_x @ hm.W_gate[0] + hm.b_gate[0], c("mlp.hook_pre")) < 1e-5
    assert relative_error(mlp_x @ hm.W_in[0] + hm.b_in[0], c("mlp.hook_pre_linear")) < 1e-5
    hm.unwrap()


@pytest.mark.parametrize("variant", ["real", "key", "mlp"])
def test_each_edit_changes_the_logits_as_a_plain_hook_making_it_at_the_same_place(variant: str) -> None:
    model = tiny_model("falcon_h1", **VARIANTS[variant])
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    assert_edits_are_the_plain_hooks(
        hm, reference, plain_edits(reference.model.layers[0], multipliers(VARIANTS[variant]))
    )
    hm.unwrap()


@pytest.mark.parametrize("point", ["hook_attn_out", "hook_mixer_out", "attn.hook_k", "mlp.hook_pre", "hook_mlp_in"])
def test_gradients_through_an_edit_equal_a_plain_hooks(point: str) -> None:
    """In float64, the real multipliers: the gradient of a loss of the logits with respect to an edit equals the
    gradient through the same edit made by plain hooks on a copy."""
    error = edit_gradient_error(
        tiny_model("falcon_h1", **REAL), lambda layer: plain_edits(layer, multipliers(REAL)), point
    )
    assert error < 1e-10, error


# (transformers 4.57's Falcon-H1 in bfloat16 has no described layer: the scan points are made once there already)
@pytest.mark.transformers5_only
def test_in_bfloat16_the_real_multipliers_wrap_each_scan_point_made_once_and_values_are_the_models() -> None:
    """bfloat16 rounds some layers' branch sums so that they are not described (served by the mixer form) while
    the others are: both ways reach the selective-scan points, which were made twice ("hook point
    'blocks.0.mamba.hook_dt' exists twice"). Now once per mixer; the first layer's points as in float32, each its
    plain hooks' value bit for bit, and the probe's verdict on every one of them holds."""
    model = tiny_model("falcon_h1", **REAL).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    want = reference_values(reference, multipliers(REAL))
    hm = wrap_generic(model)
    assert len(block_points(hm, 0)) == 31 and {f"mamba.{p}" for p in SCAN_POINTS} <= block_points(hm, 0)
    skipped = ("hook_pattern", "hook_attn_scores")  # (recomputed in eager form when read: other tests check them)
    logits, cache = hm.run_with_cache(
        input_ids(), names_filter=lambda n: n.startswith("blocks.0.") and not n.endswith(skipped)
    )
    with torch.no_grad():
        assert torch.equal(logits, reference(input_ids()).logits)  # reading changes nothing
    for name in EXACT:
        assert cache[f"blocks.0.{name}"].dtype == torch.bfloat16
        assert torch.equal(cache[f"blocks.0.{name}"], want[name]), name
    assert_verified_but_scan(hm, 0)
    hm.unwrap()
