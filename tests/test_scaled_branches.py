"""Layers of two branches that the layer adds multiplied by a constant of its config
(:mod:`lensadapters.adapters.generic.parallel`): Granite's and GraniteMoe's ``residual_multiplier``
(``mid = x + attn_out * c``, ``out = mid + mlp_out * c``; ibm-granite's checkpoints use 0.22), and GraniteMoeShared's
MLP of two modules under the same constant. ``hook_attn_out`` and ``hook_mlp_out`` are what the layer adds to the
residual stream (TransformerLens' semantics: ``resid_mid = resid_pre + attn_out``), read and edited where the layer
adds them, bit for bit against plain hooks doing the layer's own sums; the norms, ``hook_resid_mid`` and the dense
MLP's points are served beside them, each verified against plain hooks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lensadapters.adapters.generic import findings
from lensadapters.adapters.generic.plugin import summary
from lensadapters.adapters.generic.verify import check_points
from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import add_to_output, edit_error, record, seeded_delta, sum_edit, tiny_model, wrap_generic

GRANITE_MULTIPLIERS = {"embedding_multiplier": 12.0, "attention_multiplier": 0.3, "logits_scaling": 4.0}

#: each model type's MLP modules, in the order the layer adds them
MLP_MODULES = {"granite": ["mlp"], "granitemoe": ["block_sparse_moe"], "granitemoeshared": ["block_sparse_moe"]}
MLP_MODULES["granitemoeshared"].append("shared_mlp")

BRANCH_POINTS = {"hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", "hook_attn_out", "hook_resid_mid"}
BRANCH_POINTS |= {"ln2.hook_scale", "ln2.hook_normalized", "hook_mlp_out", "hook_resid_post", "attn.hook_pattern"}


@pytest.mark.parametrize("multiplier", [0.5, 0.22])
@pytest.mark.parametrize("model_type", sorted(MLP_MODULES))
def test_a_residual_multiplier_gives_branch_points_read_and_edited_where_the_layer_adds_them(
    model_type: str, multiplier: float
) -> None:
    shared = {"shared_intermediate_size": 96} if model_type == "granitemoeshared" else {}
    model = tiny_model(model_type, residual_multiplier=multiplier, **GRANITE_MULTIPLIERS, **shared)
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    served = {n[len("blocks.1.") :] for n in hm.hook_names if n.startswith("blocks.1.")}
    assert BRANCH_POINTS <= served, sorted(served)
    if model_type == "granite":  # a dense MLP: its activations are served too
        assert {"mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post"} <= served, sorted(served)
    layer = reference.model.layers[1]
    mlps = [layer.get_submodule(name) for name in MLP_MODULES[model_type]]
    seen = record(
        reference,
        {
            "hook_resid_pre": (layer, "in"),
            "attn": (layer.self_attn, "out"),
            "hook_resid_mid": (layer.post_attention_layernorm, "in"),
            "hook_resid_post": (layer, "out"),
            **{f"mlp{k}": (m, "out") for k, m in enumerate(mlps)},
        },
    )
    seen["hook_attn_out"] = seen.pop("attn") * multiplier  # the contributions: the outputs times the multiplier
    outputs = [seen.pop(f"mlp{k}") for k in range(len(mlps))]
    seen["hook_mlp_out"] = (outputs[0] if len(outputs) == 1 else outputs[0] + outputs[1]) * multiplier
    assert torch.equal(seen["hook_resid_mid"], seen["hook_resid_pre"] + seen["hook_attn_out"])
    assert torch.equal(seen["hook_resid_post"], seen["hook_resid_mid"] + seen["hook_mlp_out"])
    with torch.no_grad():
        plain = reference(input_ids()).logits
    logits, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n.startswith("blocks.1.hook_"))
    assert torch.equal(logits, plain)  # reading them changes nothing
    for name, want in seen.items():
        assert torch.equal(cache[f"blocks.1.{name}"], want), name  # the layer's own values, bit for bit
    kinds = {"hook_attn_out": "before0", "hook_resid_mid": "mid", "hook_mlp_out": "after"}
    ln2 = layer.post_attention_layernorm
    for k, (name, kind) in enumerate(kinds.items()):
        d = seeded_delta(seen[name], 20 + k)
        install = sum_edit(layer, ln2, [(layer.self_attn, multiplier)], mlps, multiplier, kind, d)
        assert edit_error(hm, reference, f"blocks.1.{name}", d, install) == 0.0, name
    if multiplier == 0.22:  # (0.5 divides back exactly) the same edit made at the attention's output, divided back
        d = seeded_delta(seen["hook_attn_out"], 23)  # by the multiplier, is not bit for bit
        install = add_to_output(layer.self_attn, d / multiplier)
        assert edit_error(hm, reference, "blocks.1.hook_attn_out", d, install) > 0.0
    names = [f"blocks.1.{n}" for n in sorted(served)]  # every point, value and edit, against plain hooks
    assert check_points(hm.wiring, input_ids(), names, points_per_pass=1) == dict.fromkeys(names)
    hm.unwrap()


def test_the_description_of_a_scaled_layer_is_refused_with_its_constants_named() -> None:
    """Until a block description has a branch constant, its W_O would not be what the layer adds: no queries, keys,
    values or weights, and the warning says which constants stand in the way."""
    model = tiny_model("granite", residual_multiplier=0.5, **GRANITE_MULTIPLIERS)
    hm = wrap_generic(model)
    why = " ".join(findings(model).missing.values())
    assert "multiplied by constants of its config (0.5, 0.5)" in why, why
    assert "blocks.0.attn.hook_q" not in hm.hook_dict
    # the warning names as needing a plugin what is missing, not the norm scales and hook_resid_mid it serves
    needs = summary(hm).split(" need a plugin")[0].rsplit(". ", 1)[-1]
    assert needs.startswith("Queries, keys and values") and "norm scales" not in needs and "resid_mid" not in needs
    hm.unwrap()


def test_a_unit_multiplier_keeps_the_full_description() -> None:
    """The scaled split is tried only where the plain sum fails: Granite with multiplier 1.0 is described as a
    Llama-shaped layer (queries, keys, values, weights)."""
    model = tiny_model("granite", residual_multiplier=1.0)
    hm = wrap_generic(model)
    assert {"blocks.0.attn.hook_q", "blocks.0.hook_attn_out", "blocks.0.mlp.hook_post"} <= set(hm.hook_dict)
    assert hm.W_O.shape[0] == model.config.num_hidden_layers
    hm.unwrap()


def test_a_forward_run_inside_a_branch_point_leaves_the_outer_forwards_sums_exact() -> None:
    """The sums a layer's ``SumSite`` follows are each forward's own: a hook at ``hook_attn_out`` of the outer forward
    that runs the model on another input (passing through the same layer) leaves the outer forward's edit there and
    its points after it bit for bit those of a run without the nested call; the nested call gives the model's
    logits."""
    model = tiny_model("granite", residual_multiplier=0.5, **GRANITE_MULTIPLIERS)
    hm: Any = wrap_generic(model)
    outer, inner = input_ids(1), input_ids(2)
    names = [f"blocks.1.{n}" for n in ("hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")]

    def run(extra: list) -> tuple:
        seen: dict = {}
        hooks = [("blocks.1.hook_attn_out", lambda t, hook: t + 0.25 * torch.sin(t))]
        hooks += [(n, lambda t, hook: seen.__setitem__(hook.name, t.detach().clone())) for n in names]
        return hm.run_with_hooks(outer, fwd_hooks=hooks + extra), seen

    with torch.no_grad():
        expected_logits, expected = run([])
        clean_inner = model(inner).logits
        nested: list = []
        logits, seen = run([("blocks.1.hook_attn_out", lambda t, hook: nested.append(hm(inner).logits))])
    assert torch.equal(logits, expected_logits), "the outer forward's edit was lost to the nested call"
    assert sorted(seen) == sorted(expected) == sorted(names)
    for name in names:
        assert torch.equal(seen[name], expected[name]), name
    assert len(nested) == 1 and torch.equal(nested[0], clean_inner)
    hm.unwrap()
