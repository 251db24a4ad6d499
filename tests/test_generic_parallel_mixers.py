"""Layers with three branch children (:mod:`lensadapters.adapters.generic.parallel`): Falcon-H1's attention and
Mamba-2 mixer in parallel before its MLP, GraniteMoeHybrid's token mixer before an MLP of routed experts plus a shared
MLP. Each served point reads what an independent reference computed from the HF modules with plain PyTorch hooks
reads, and an edit of it changes the logits exactly as the same change made by a plain hook on the HF module does;
a layer that scales a branch by a constant other than 1 gets none of the branch points."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lensadapters import HookedModel
from lensadapters.adapters.generic import findings
from lensadapters.adapters.generic.scan import SCAN_POINTS
from lensadapters.adapters.generic.verify import check_points
from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import (
    add_to_input,
    add_to_output,
    assert_cached_edit_is_a_full_pass,
    assert_verified_but_scan,
    block_points,
    edit_error,
    gradients_through_edit,
    record,
    relative_error,
    resid_mid_edit,
    seeded_delta,
    sum_edits,
    tiny_model,
    wrap_generic,
)
from tests.falcon_h1_helpers import branch_record

Tensor = torch.Tensor


def test_falcon_h1s_parallel_attention_and_mamba_get_every_point_read_and_edited_as_the_model_computes_them() -> None:
    model = tiny_model("falcon_h1")
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    served = {n for n in hm.hook_names if n.startswith("blocks.0.")}
    canonical = {"hook_resid_mid", "hook_attn_out", "hook_mixer_out", "hook_mlp_out", "attn.hook_q", "attn.hook_k"}
    canonical |= {"attn.hook_v"}
    canonical |= {"mlp.hook_pre", "mlp.hook_post", "ln1.hook_scale", "ln2.hook_scale", "attn.hook_pattern"}
    assert {f"blocks.0.{n}" for n in canonical} <= served, sorted(served)
    layer = reference.model.layers[0]
    seen = branch_record(
        reference,
        layer,
        {
            "hook_resid_post": (layer, "out"),
            "attn.hook_q": (layer.self_attn.q_proj, "out"),
            "attn.hook_k": (layer.self_attn.k_proj, "out"),
            "attn.hook_v": (layer.self_attn.v_proj, "out"),
            "mlp.hook_pre": (layer.feed_forward.gate_proj, "out"),
            "mlp.hook_post": (layer.feed_forward.down_proj, "in"),
        },
    )
    # hook_attn_out is the attention branch's contribution: resid_mid adds it and the parallel mixer's output
    assert torch.equal(
        seen["hook_resid_mid"], seen["hook_resid_pre"] + (seen["hook_mixer_out"] + seen["hook_attn_out"])
    )
    x = seen["hook_resid_pre"]
    eps = layer.input_layernorm.variance_epsilon
    seen["ln1.hook_scale"] = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    _, cache = hm.run_with_cache(input_ids())
    errors = {}
    for name, want in seen.items():
        got = cache[f"blocks.0.{name}"]
        errors[name] = relative_error(got.reshape(want.shape), want)
    # (the cache of every point runs the attention the core computes explicitly for its pattern: rounding apart)
    assert max(errors.values()) <= 1e-5, errors
    # the points' own sum: hook_resid_mid = hook_resid_pre + hook_attn_out + hook_mixer_out (the layer's order)
    got = {n: cache[f"blocks.0.{n}"] for n in ("hook_resid_pre", "hook_attn_out", "hook_mixer_out", "hook_resid_mid")}
    whole = got["hook_resid_pre"] + (got["hook_mixer_out"] + got["hook_attn_out"])
    assert relative_error(whole, got["hook_resid_mid"]) <= 1e-6
    seeds = {"hook_attn_out": 1, "hook_mixer_out": 6, "hook_mlp_out": 2, "hook_resid_mid": 3}
    seeds |= {"attn.hook_v": 4, "mlp.hook_post": 5}
    like = {**seen, "hook_resid_mid": x}
    d = {name: seeded_delta(like[name], seed) for name, seed in seeds.items()}
    edits = {
        "hook_attn_out": add_to_output(layer.self_attn, d["hook_attn_out"]),
        "hook_mixer_out": add_to_output(layer.mamba, d["hook_mixer_out"]),
        "hook_mlp_out": add_to_output(layer.feed_forward, d["hook_mlp_out"]),
        "hook_resid_mid": resid_mid_edit(layer, layer.pre_ff_layernorm, [layer.feed_forward], d["hook_resid_mid"]),
        "attn.hook_v": add_to_output(layer.self_attn.v_proj, d["attn.hook_v"]),
        "mlp.hook_post": add_to_input(layer.feed_forward.down_proj, d["mlp.hook_post"]),
    }
    for name, install in edits.items():
        error = edit_error(hm, reference, f"blocks.0.{name}", d[name], install)
        assert error == 0.0, (name, error)
    assert {f"blocks.0.mamba.{n}" for n in SCAN_POINTS} <= served  # the scan's (tests/test_generic_scan_falcon_h1.py)
    # and every other point of the layer, the per-head inputs and results too, against plain hooks
    assert_verified_but_scan(hm, 0, sorted(block_points(hm, 0)))
    hm.unwrap()


FALCON_MULTIPLIERS = {"attention_out_multiplier": 0.75, "ssm_out_multiplier": 1.25, "key_multiplier": 0.6}


def _falcon_h1_sum_edits(layer: torch.nn.Module) -> dict[str, Callable[[Tensor], Callable]]:
    """The same edits of a Falcon-H1 layer with branch multipliers, by plain hooks (:func:`sum_edits`)."""
    before = {"hook_mixer_out": (layer.mamba, FALCON_MULTIPLIERS["ssm_out_multiplier"])}
    before["hook_attn_out"] = (layer.self_attn, FALCON_MULTIPLIERS["attention_out_multiplier"])
    return sum_edits(layer, layer.pre_ff_layernorm, before, [layer.feed_forward], 1.0)


def test_falcon_h1_with_branch_multipliers_gets_its_scaled_branches_read_and_edited_where_the_layer_adds_them() -> None:
    """hook_attn_out and hook_mixer_out are what the layer adds to the residual stream, the attention's and the
    mixer's outputs times their multipliers (TransformerLens' semantics: resid_mid = resid_pre + attn_out +
    mixer_out); an edit of either is the layer's middle recomputed from the edited contribution, bit for bit, never
    an edit of the module's output divided by the multiplier."""
    model = tiny_model("falcon_h1", **FALCON_MULTIPLIERS, attention_in_multiplier=0.9, mlp_multipliers=[0.8, 1.1])
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    served = block_points(hm, 0)
    # the attention reads ln1's output times 0.9 (attention_in_multiplier): described with it
    # (BlockLayout.attn_in_scale, tests/test_generic_falcon_h1_attention_in.py); the MLP's hook_pre is the
    # activation's input, its gate projection's output times its multiplier
    # (tests/test_generic_falcon_h1_multipliers.py has the other multipliers)
    assert "attn.hook_k" in served and "mlp.hook_pre" in served, sorted(served)
    assert {"hook_attn_out", "hook_mixer_out", "hook_resid_mid", "ln2.hook_scale", "hook_mlp_out"} <= served
    assert "ln1.hook_scale" in served  # the pre-norm the Mamba mixer reads as it is (the attention: times 0.9)
    layer = reference.model.layers[0]
    seen = branch_record(reference, layer)
    seen["hook_mixer_out"] = seen["hook_mixer_out"] * 1.25  # the contributions: the outputs times the multipliers
    seen["hook_attn_out"] = seen["hook_attn_out"] * 0.75
    whole = seen["hook_resid_pre"] + (seen["hook_mixer_out"] + seen["hook_attn_out"])
    assert torch.equal(seen["hook_resid_mid"], whole)  # what the model computes, the multipliers included
    with torch.no_grad():
        plain = reference(input_ids()).logits
    logits, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n.startswith("blocks.0.hook_"))
    assert torch.equal(logits, plain)  # reading them changes nothing
    for name, want in seen.items():
        assert torch.equal(cache[f"blocks.0.{name}"], want), name  # the layer's own values, bit for bit
    for k, (name, make) in enumerate(_falcon_h1_sum_edits(layer).items()):
        d = seeded_delta(seen[name], 8 + k)
        assert edit_error(hm, reference, f"blocks.0.{name}", d, make(d)) == 0.0, name
    # the same edit made at the module's output, divided back by the multiplier, is not bit for bit
    d = seeded_delta(seen["hook_attn_out"], 9)
    divided = edit_error(hm, reference, "blocks.0.hook_attn_out", d, add_to_output(layer.self_attn, d / 0.75))
    assert divided > 0.0
    assert_verified_but_scan(hm, 0, sorted(served))
    hm.unwrap()


def test_a_key_multiplier_and_mlp_multipliers_leave_the_branches_served_and_give_the_keys_and_the_mlp_points() -> None:
    model = tiny_model("falcon_h1", key_multiplier=0.6, mlp_multipliers=[0.8, 1.1])
    hm = wrap_generic(model)
    served = block_points(hm, 0)
    assert {"hook_attn_out", "hook_mixer_out", "hook_resid_mid", "hook_mlp_out", "ln2.hook_scale"} <= served
    assert {"attn.hook_k", "attn.hook_rot_k", "mlp.hook_pre", "hook_k_input"} <= served, sorted(served)
    assert_verified_but_scan(hm, 0, sorted(served))
    hm.unwrap()


LINEAR_THEN_ATTENTION = ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("multiplier", [1.0, 0.5])
def test_granite_moe_hybrids_layers_get_their_branch_contributions_resid_mid_and_norms(multiplier: float) -> None:
    """A Mamba layer and the attention layer: hook_attn_out the mixer's output and hook_mlp_out the routed experts'
    plus the shared MLP's outputs, each times ``residual_multiplier`` (what the layer adds to the residual stream),
    read and edited where the layer adds them, bit for bit against plain hooks doing the layer's own sums."""
    model = tiny_model("granitemoehybrid", layer_types=LINEAR_THEN_ATTENTION, residual_multiplier=multiplier)
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    with torch.no_grad():
        plain = reference(input_ids()).logits
    for i in (0, 3):  # a Mamba layer and the attention layer
        served = block_points(hm, i)
        assert {"hook_attn_out", "hook_resid_mid", "hook_mlp_out", "ln1.hook_scale", "ln2.hook_scale"} <= served
        layer = reference.model.layers[i]
        mixer = layer.mamba if i == 0 else layer.self_attn
        mlps = [layer.block_sparse_moe, layer.shared_mlp]
        seen = record(
            reference,
            {
                "hook_attn_out": (mixer, "out"),
                "moe": (layer.block_sparse_moe, "out"),
                "shared": (layer.shared_mlp, "out"),
                "hook_resid_mid": (layer.post_attention_layernorm, "in"),
                "hook_resid_pre": (layer, "in"),
                "hook_resid_post": (layer, "out"),
            },
        )
        seen["hook_attn_out"] = seen["hook_attn_out"] * multiplier
        seen["hook_mlp_out"] = (seen.pop("moe") + seen.pop("shared")) * multiplier
        assert torch.equal(seen["hook_resid_mid"], seen["hook_resid_pre"] + seen["hook_attn_out"])
        assert torch.equal(seen["hook_resid_post"], seen["hook_resid_mid"] + seen["hook_mlp_out"])
        prefix = f"blocks.{i}.hook_"
        logits, cache = hm.run_with_cache(input_ids(), names_filter=lambda n, p=prefix: n.startswith(p))
        assert torch.equal(logits, plain)  # reading them changes nothing
        for name, want in seen.items():
            assert torch.equal(cache[f"blocks.{i}.{name}"], want), (i, name)
        reader = layer.post_attention_layernorm
        edits = sum_edits(layer, reader, {"hook_attn_out": (mixer, multiplier)}, mlps, multiplier)
        for k, (name, make) in enumerate(edits.items()):
            d = seeded_delta(seen[name], 6 + k)
            assert edit_error(hm, reference, f"blocks.{i}.{name}", d, make(d)) == 0.0, (i, name)
        assert_verified_but_scan(hm, i, sorted(served), points_per_pass=1)
    hm.unwrap()


@pytest.mark.parametrize("multipliers", [{}, FALCON_MULTIPLIERS], ids=["as_is", "multipliers"])
def test_generation_with_an_edited_parallel_point_continues_through_the_models_cache(multipliers: dict) -> None:
    """Each generated step (the model's cache: the Mamba-2 mixer's states, the attention's keys and values) gives the
    logits of one forward over the generated tokens with the same edit of hook_attn_out, hook_mixer_out or
    hook_resid_mid (with branch multipliers: the layer's own sums, SumSite, and hook_mlp_out)."""
    hm = wrap_generic(tiny_model("falcon_h1", **multipliers))
    points = ["blocks.1.hook_attn_out", "blocks.1.hook_mixer_out", "blocks.0.hook_resid_mid"]
    for point in points + ["blocks.0.hook_mlp_out"] * bool(multipliers):
        assert point in hm.hook_names, point
        assert_cached_edit_is_a_full_pass(hm, point)
    hm.unwrap()


def test_a_norm_with_matrix_parameters_before_the_attention_leaves_the_points_after_the_middle() -> None:
    """AXK2's gated input norm has matrix parameters (a third branch child by the rule): no sum before the middle is
    exact, the part after it is (hook_resid_mid, ln2, hook_mlp_out), each checked against plain hooks."""
    from lensadapters.testing.every_model_type import NotBuildable, build

    if "axk2" not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip("axk2 is not in this transformers")
    try:
        model = build("axk2")
    except NotBuildable as why:
        pytest.skip(f"axk2: {why}")
    hm = wrap_generic(model)
    served = block_points(hm, 0)
    assert {"hook_resid_mid", "ln2.hook_scale", "hook_mlp_out"} <= served and "hook_attn_out" not in served, served
    assert "hook_attn_out" in findings(model).missing
    names = [f"blocks.0.{n}" for n in ("hook_resid_mid", "ln2.hook_scale", "ln2.hook_normalized", "hook_mlp_out")]
    assert check_points(hm.wiring, input_ids(), names) == dict.fromkeys(names)
    hm.unwrap()


def _norm_edit(norm: torch.nn.Module, point: str, d: Tensor) -> Callable[[], list]:
    """The RMSNorm ``norm`` computing its output from an edited scale (``hook_scale + d``) or normalized value
    (``hook_normalized + d``): ``weight * x / (scale + d)``, ``weight * (x / scale + d)``, in the input's dtype."""

    def hook(m: Any, a: Any, o: Any) -> Any:
        x = a[0]
        scale = (x.float().pow(2).mean(-1, keepdim=True) + m.variance_epsilon).sqrt()
        if point == "hook_scale":
            return m.weight * (x.float() / (scale + d.reshape(scale.shape))).to(x.dtype)
        return m.weight * (x.float() / scale + d.reshape(x.shape)).to(x.dtype)

    return lambda: [norm.register_forward_hook(hook)]


def _falcon_h1_edits(layer: torch.nn.Module, like: dict[str, Tensor]) -> dict[str, Callable[[Tensor], Callable]]:
    """For each parallel-branch point of a Falcon-H1 layer, the same edit (adding ``d``) made by plain PyTorch hooks
    on the HF modules: ``install = edits[point](d)``."""
    attn, mlp = layer.self_attn, layer.feed_forward
    return {
        "hook_attn_out": lambda d: add_to_output(attn, d),
        "hook_mixer_out": lambda d: add_to_output(layer.mamba, d),
        "hook_mlp_out": lambda d: add_to_output(mlp, d),
        "hook_resid_mid": lambda d: resid_mid_edit(layer, layer.pre_ff_layernorm, [mlp], d),
        "attn.hook_q": lambda d: add_to_output(attn.q_proj, d.reshape(like["attn.hook_q"].shape)),
        "attn.hook_v": lambda d: add_to_output(attn.v_proj, d.reshape(like["attn.hook_v"].shape)),
        "mlp.hook_pre": lambda d: add_to_output(mlp.gate_proj, d),
        "mlp.hook_post": lambda d: add_to_input(mlp.down_proj, d),
        "ln1.hook_scale": lambda d: _norm_edit(layer.input_layernorm, "hook_scale", d),
        "ln1.hook_normalized": lambda d: _norm_edit(layer.input_layernorm, "hook_normalized", d),
        "ln2.hook_scale": lambda d: _norm_edit(layer.pre_ff_layernorm, "hook_scale", d),
        "ln2.hook_normalized": lambda d: _norm_edit(layer.pre_ff_layernorm, "hook_normalized", d),
    }


def _plain_shapes(reference: torch.nn.Module, layer: torch.nn.Module) -> dict[str, Tensor]:
    """What the plain hooks of :func:`_falcon_h1_edits` add to, by point (their shapes)."""
    attn = layer.self_attn
    return record(reference, {"attn.hook_q": (attn.q_proj, "out"), "attn.hook_v": (attn.v_proj, "out")})


def test_gradients_through_every_parallel_branch_edit_match_finite_differences_and_a_plain_hooks() -> None:
    """In float64, for each point of Falcon-H1's parallel layer: the gradient of a loss of the logits with respect to
    the edit (a tensor added at the point) equals the gradient through the same edit made by plain PyTorch hooks on
    a copy of the model, and its directional derivative equals central finite differences (the model's RMSNorms
    compute in float32: the differences are taken with steps that float32 rounding does not swamp, extrapolated)."""
    model = tiny_model("falcon_h1").double()
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    layer = reference.model.layers[0]
    _, cache = hm.run_with_cache(input_ids())
    edits = _falcon_h1_edits(layer, _plain_shapes(reference, layer))
    served = block_points(hm, 0)
    assert set(edits) <= served, sorted(set(edits) - served)
    errors, differences = {}, {}
    for point, make in edits.items():
        like = cache[f"blocks.0.{point}"]
        d0 = seeded_delta(like, 11).double() * 0.1
        direction = seeded_delta(like, 12).double()
        direction = direction / direction.norm()
        grad, want, through_hm = gradients_through_edit(hm, reference, f"blocks.0.{point}", make, d0)
        errors[point] = relative_error(grad, want)
        with torch.no_grad():  # central differences at two steps, extrapolated (Richardson: no step squared term)
            central = [
                (through_hm(d0 + h * direction) - through_hm(d0 - h * direction)) / (2 * h) for h in (0.04, 0.02)
            ]
        numeric = float(4 * central[1] - central[0]) / 3
        analytic = float((grad * direction).sum())
        # relative to the gradient's norm (the largest directional derivative along a unit direction)
        differences[point] = abs(numeric - analytic) / float(grad.norm())
    # the same gradient (measured: bit for bit but the norms', whose plain hook rounds to float32 its own way, 1.5e-6)
    assert all(e <= (1e-5 if p.startswith(("ln1.", "ln2.")) else 1e-12) for p, e in errors.items()), errors
    # float32 rounding inside the model (its norms, the mixer's decay) and the steps' size: measured 2.4e-5 at most,
    # and 2.6e-3 for a norm's scale, which the logits depend on through its inverse (steps of 0.04 on scales near 1)
    assert all(e <= (1e-2 if p.endswith("hook_scale") else 1e-4) for p, e in differences.items()), differences
    hm.unwrap()


@pytest.mark.parametrize("model_type", ["falcon_h1", "granitemoehybrid"])
def test_gradients_through_the_scaled_contributions_equal_a_plain_hooks(model_type: str) -> None:
    """In float64, for each branch point a layer's own sums serve (Falcon-H1 with branch multipliers, GraniteMoeHybrid
    with a residual multiplier): the gradient of a loss of the logits with respect to the edit equals the gradient
    through the same edit made by plain hooks doing the layer's sums (:func:`sum_edit`) on a copy."""
    if model_type == "falcon_h1":
        model = tiny_model("falcon_h1", **FALCON_MULTIPLIERS).double()
    else:
        # (transformers 5's default experts kernel, grouped matrix products, has no float64)
        eager = {} if transformers.__version__.startswith("4.") else {"_experts_implementation": "eager"}
        model = tiny_model("granitemoehybrid", layer_types=LINEAR_THEN_ATTENTION, residual_multiplier=0.5, **eager)
        model = model.double()
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    layer = reference.model.layers[0]
    if model_type == "falcon_h1":
        edits = _falcon_h1_sum_edits(layer)
    else:
        mlps = [layer.block_sparse_moe, layer.shared_mlp]
        edits = sum_edits(layer, layer.post_attention_layernorm, {"hook_attn_out": (layer.mamba, 0.5)}, mlps, 0.5)
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n.startswith("blocks.0.hook_"))
    errors = {}
    for point, make in edits.items():
        d0 = seeded_delta(cache[f"blocks.0.{point}"], 11).double() * 0.1
        grad, want, _ = gradients_through_edit(hm, reference, f"blocks.0.{point}", make, d0)
        errors[point] = relative_error(grad, want)
    assert all(e <= 1e-12 for e in errors.values()), errors
    hm.unwrap()


#: points a bfloat16 model may lack: the routing of fused experts, which the MoE description does not find in
#: bfloat16 (GraniteMoe's own layers neither)
BFLOAT16_ROUTING = ("mlp.hook_router_logits", "mlp.hook_routing_weights")


def _bfloat16_wrapped_as_float32(model: torch.nn.Module) -> tuple[HookedModel, torch.nn.Module, set[str]]:
    """``model`` (float32) cast to bfloat16 and wrapped, asserted to serve the points it serves in float32 (but the
    routing points, :data:`BFLOAT16_ROUTING`); with a bfloat16 copy for plain hooks and those points."""
    hm = wrap_generic(model)
    full = set(hm.hook_names)
    hm.unwrap()
    model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    served = set(hm.hook_names)
    assert served <= full and all(n.endswith(BFLOAT16_ROUTING) for n in full - served), sorted(full ^ served)
    return hm, reference, served


@pytest.mark.parametrize("model_type", ["falcon_h1", "granitemoehybrid"])
def test_a_bfloat16_parallel_layer_gets_the_points_of_float32_read_without_change_and_edited_as_plain_hooks(
    model_type: str,
) -> None:
    """The same points as the float32 model; reading every one changes no logit (bit for bit, but the scores and
    patterns: hooking them computes the attention explicitly); an edit of each Falcon-H1 branch point gives the
    logits of the same edit made by plain hooks on a copy (bit for bit, but the norms' edits, which the plain hook
    computes by its own formula: to bfloat16 rounding)."""
    config = {"layer_types": LINEAR_THEN_ATTENTION} if model_type == "granitemoehybrid" else {}
    hm, reference, full = _bfloat16_wrapped_as_float32(tiny_model(model_type, **config))
    model = hm.model
    read = {n for n in full if not n.endswith(("hook_attn_scores", "hook_pattern"))}
    with torch.no_grad():
        plain = model(input_ids()).logits
        logits, cache = hm.run_with_cache(input_ids(), names_filter=lambda name: name in read)
    assert torch.equal(logits, plain) and set(cache.keys()) == read
    if model_type == "falcon_h1":
        layer = reference.model.layers[0]
        errors = {}
        for k, (point, make) in enumerate(_falcon_h1_edits(layer, _plain_shapes(reference, layer)).items()):
            d = seeded_delta(cache[f"blocks.0.{point}"], 20 + k) * (0.1 if point.endswith("hook_scale") else 1.0)
            errors[point] = edit_error(hm, reference, f"blocks.0.{point}", d, make(d))
        norms = {p for p in errors if p.startswith(("ln1.", "ln2."))}
        assert all(e == 0.0 for p, e in errors.items() if p not in norms), errors
        # the norms' edits: the plain hook's formula rounds its own way (measured 2.7% of the largest logit at most)
        assert max(errors[p] for p in norms) <= 0.05 * float(plain.abs().max()), (errors, float(plain.abs().max()))
    hm.unwrap()


def test_a_bfloat16_falcon_h1_with_branch_multipliers_gets_its_scaled_branches_edited_as_plain_hooks() -> None:
    """In bfloat16 the multipliers are found as in float32 (``output * c`` in the model's dtype, bit for bit), and an
    edit of each contribution gives the logits of plain hooks doing the layer's sums, bit for bit."""
    hm, reference, _ = _bfloat16_wrapped_as_float32(tiny_model("falcon_h1", **FALCON_MULTIPLIERS))
    layer = reference.model.layers[0]
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n.startswith("blocks.0.hook_"))
    for k, (name, make) in enumerate(_falcon_h1_sum_edits(layer).items()):
        d = seeded_delta(cache[f"blocks.0.{name}"], 30 + k)
        assert edit_error(hm, reference, f"blocks.0.{name}", d, make(d)) == 0.0, name
    hm.unwrap()
