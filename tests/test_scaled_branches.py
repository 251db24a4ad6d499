"""Layers of two branches that the layer adds multiplied by a constant of its config
(:mod:`lensadapters.adapters.generic.parallel`): Granite's and GraniteMoe's ``residual_multiplier``
(``mid = x + attn_out * c``, ``out = mid + mlp_out * c``; ibm-granite's checkpoints use 0.22), and GraniteMoeShared's
MLP of two modules under the same constant. ``hook_attn_out`` and ``hook_mlp_out`` are what the layer adds to the
residual stream (TransformerLens' semantics: ``resid_mid = resid_pre + attn_out``), read and edited where the layer
adds them, bit for bit against plain hooks doing the layer's own sums; the norms, ``hook_resid_mid`` and the dense
MLP's points are served beside them, each verified against plain hooks. The automatic description carries the
constant (``BlockLayout.attn_scale``/``mlp_scale``): queries, keys, values, ``attn.hook_result`` and the weights, with
the constant folded into ``W_O``/``b_O``/``W_out``/``b_out``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lensadapters.adapters.generic import findings
from lensadapters.adapters.generic.plugin import summary
from lensadapters.adapters.generic.verify import check_points
from lensadapters.testing.every_model_type import input_ids, shrink_config
from tests.branch_helpers import (
    add_to_input,
    add_to_output,
    block_points,
    edit_error,
    logits_with,
    per_head_weight,
    record,
    record_heads,
    relative_error,
    seeded_delta,
    sum_edit,
    sum_edits,
    tiny_model,
    wrap_generic,
)

Tensor = torch.Tensor

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
    served = block_points(hm, 1)
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
    ln2 = layer.post_attention_layernorm
    edits = sum_edits(layer, ln2, {"hook_attn_out": (layer.self_attn, multiplier)}, mlps, multiplier)
    for k, (name, make) in enumerate(edits.items()):
        d = seeded_delta(seen[name], 20 + k)
        assert edit_error(hm, reference, f"blocks.1.{name}", d, make(d)) == 0.0, name
    if multiplier == 0.22:  # (0.5 divides back exactly) the same edit made at the attention's output, divided back
        d = seeded_delta(seen["hook_attn_out"], 23)  # by the multiplier, is not bit for bit
        install = add_to_output(layer.self_attn, d / multiplier)
        assert edit_error(hm, reference, "blocks.1.hook_attn_out", d, install) > 0.0
    names = [f"blocks.1.{n}" for n in sorted(served)]  # every point, value and edit, against plain hooks
    assert check_points(hm.wiring, input_ids(), names, points_per_pass=1) == dict.fromkeys(names)
    hm.unwrap()


def _granite(multiplier: float, bias: bool = False) -> torch.nn.Module:
    biases = {"attention_bias": True, "mlp_bias": True} if bias else {}
    return tiny_model("granite", residual_multiplier=multiplier, **GRANITE_MULTIPLIERS, **biases)


def _in_layer_1(name: str) -> bool:
    """Layer 1's points but the patterns (hooking them computes the attention explicitly, not as the model does)."""
    return name.startswith("blocks.1.") and not name.endswith(("hook_pattern", "hook_attn_scores"))


@pytest.mark.parametrize("multiplier", [0.5, 0.22])
def test_a_scaled_layer_gets_the_points_of_an_unscaled_one_and_carries_its_constant(multiplier: float) -> None:
    """The description carries the branch constants the probe found (``BlockLayout.attn_scale``/``mlp_scale``): the
    points are an unscaled Granite's, every one verified at wrap time (nothing left out)."""
    model = _granite(multiplier)
    hm = wrap_generic(model)
    unit = wrap_generic(_granite(1.0))
    got, unscaled = block_points(hm, 1), block_points(unit, 1)
    assert got == unscaled, sorted(got ^ unscaled)
    assert {"attn.hook_q", "attn.hook_rot_q", "attn.hook_v", "attn.hook_result", "hook_q_input"} <= got
    assert [(b.attn_scale, b.mlp_scale) for b in hm.block_layouts] == [(multiplier, multiplier)] * len(hm.block_layouts)
    assert unit.block_layouts[0].attn_scale == unit.block_layouts[0].mlp_scale == 1.0
    assert not findings(model).missing, findings(model).missing
    hm.unwrap()
    unit.unwrap()


def _per_head(z: Tensor, o_proj: torch.nn.Module, c: float) -> Tensor:
    """Each head's output ``z_h @ W_O_h`` from the HF projection's weight, times the branch constant."""
    w = o_proj.weight.detach().T.unflatten(0, (z.shape[-2], -1))  # [heads, d_head, d_model]
    return torch.einsum("bphd,hdm->bphm", z.double(), w.double()) * c


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("multiplier", [0.5, 0.22])
def test_queries_values_result_and_weights_of_a_scaled_layer(multiplier: float, bias: bool) -> None:
    """Queries, keys, values, z and the MLP's activations are the HF modules' own values (bit for bit);
    ``attn.hook_result`` is each head's output times the constant, summing with ``b_O`` to ``hook_attn_out``;
    ``W_O``, ``b_O``, ``W_out``, ``b_out`` are the HF parameters times the constant, read live."""
    model = _granite(multiplier, bias)
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    layer = reference.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    heads = model.config.num_attention_heads
    seen = record_heads(
        reference,
        attn,
        {
            "attn": (attn, "out"),
            "mlp.hook_pre": (mlp.gate_proj, "out"),
            "mlp.hook_pre_linear": (mlp.up_proj, "out"),
            "mlp.hook_post": (mlp.down_proj, "in"),
            "mlp": (mlp, "out"),
        },
    )
    _, cache = hm.run_with_cache(input_ids(), names_filter=_in_layer_1)
    c = lambda n: cache[f"blocks.1.{n}"]  # noqa: E731
    for name in ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z"):  # per head
        assert torch.equal(c(name), seen[name]), name
    for name in ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post"):
        assert torch.equal(c(name), seen[name]), name
    assert torch.equal(c("hook_attn_out"), seen["attn"] * multiplier)
    assert torch.equal(c("hook_mlp_out"), seen["mlp"] * multiplier)
    result = _per_head(c("attn.hook_z"), attn.o_proj, multiplier)
    assert relative_error(c("attn.hook_result").double(), result) < 1e-6
    # the weights: the HF parameters times the constant (TransformerLens folds such constants into the weights)
    o_w, down = attn.o_proj, mlp.down_proj
    assert torch.equal(hm.W_O[1], o_w.weight.T.unflatten(0, (heads, -1)) * multiplier)
    assert torch.equal(hm.W_out[1], down.weight.T * multiplier)
    zeros = torch.zeros(model.config.hidden_size)
    assert torch.equal(hm.b_O[1], o_w.bias * multiplier if bias else zeros)
    assert torch.equal(hm.b_out[1], down.bias * multiplier if bias else zeros)
    assert torch.equal(hm.W_Q[1], per_head_weight(attn.q_proj, heads))
    assert torch.equal(hm.W_in[1], mlp.up_proj.weight.T) and torch.equal(hm.W_gate[1], mlp.gate_proj.weight.T)
    # TransformerLens' identities: hook_attn_out = sum(hook_result) + b_O = hook_z @ W_O + b_O, likewise the MLP
    attn_out = c("hook_attn_out").double()
    assert relative_error(c("attn.hook_result").double().sum(-2) + hm.b_O[1].double(), attn_out) < 1e-6
    z_at_w = torch.einsum("bphd,hdm->bpm", c("attn.hook_z"), hm.W_O[1]) + hm.b_O[1]
    assert relative_error(z_at_w.double(), attn_out) < 1e-6
    mlp_out = c("mlp.hook_post") @ hm.W_out[1] + hm.b_out[1]
    assert relative_error(mlp_out.double(), c("hook_mlp_out").double()) < 1e-6
    assert torch.equal(c("hook_resid_mid"), c("hook_resid_pre") + c("hook_attn_out"))
    assert torch.equal(c("hook_resid_post"), c("hook_resid_mid") + c("hook_mlp_out"))
    # live parameters: changing the HF parameter in place changes W_O and W_out (never a stale copy)
    wrapped = model.model.layers[1]
    with torch.no_grad():
        wrapped.self_attn.o_proj.weight.mul_(2.0)
        wrapped.mlp.down_proj.weight.add_(1.0)
    assert torch.equal(hm.W_O[1], wrapped.self_attn.o_proj.weight.T.unflatten(0, (heads, -1)) * multiplier)
    assert torch.equal(hm.W_out[1], wrapped.mlp.down_proj.weight.T * multiplier)
    hm.unwrap()


def _add_to_heads(module: torch.nn.Module, d: Tensor) -> Any:
    """A plain hook adding ``d`` ``[b, p, heads, d_head]`` to a projection's output."""
    return add_to_output(module, d.flatten(-2))


@pytest.mark.parametrize("multiplier", [0.5, 0.22])
def test_edits_of_a_scaled_layer_are_the_plain_hooks_edits(multiplier: float) -> None:
    """Edits of ``hook_q``, ``hook_v`` and ``mlp.hook_post`` are bit for bit the same edits made by plain hooks on
    the HF modules; an edit of ``attn.hook_result`` is its heads' sum added to the attention's contribution where the
    layer adds it (to float rounding: the site adds the difference of the edited and the unedited results' sums)."""
    model = _granite(multiplier)
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    layer = reference.model.layers[1]
    attn = layer.self_attn
    _, cache = hm.run_with_cache(input_ids(), names_filter=_in_layer_1)
    edits = {
        "attn.hook_q": lambda d: _add_to_heads(attn.q_proj, d),
        "attn.hook_v": lambda d: _add_to_heads(attn.v_proj, d),
        "mlp.hook_post": lambda d: add_to_input(layer.mlp.down_proj, d),
    }
    for k, (name, install) in enumerate(edits.items()):
        d = seeded_delta(cache[f"blocks.1.{name}"], 40 + k)
        assert edit_error(hm, reference, f"blocks.1.{name}", d, install(d)) == 0.0, name
    d = seeded_delta(cache["blocks.1.attn.hook_result"], 50)
    ln2 = layer.post_attention_layernorm
    install = sum_edit(layer, ln2, [(attn, multiplier)], [layer.mlp], multiplier, "before0", d.sum(-2))
    error = edit_error(hm, reference, "blocks.1.attn.hook_result", d, install)
    scale = float(logits_with(reference, lambda: []).abs().max())
    assert error <= 1e-5 * scale, error
    hm.unwrap()


def test_gradients_flow_through_edits_of_a_scaled_layer() -> None:
    """A loss backpropagates through an edit of ``hook_attn_out`` (made where the layer adds it) to the layer's
    queries and to the embeddings, and the gradient at ``hook_resid_mid`` is the plain model's gradient at the norm's
    input with the same edit."""
    model = _granite(0.22)
    reference = copy.deepcopy(model)
    hm = wrap_generic(model)
    d = seeded_delta(hm.run_with_cache(input_ids())[1]["blocks.1.hook_attn_out"], 60)
    grads: dict[str, Tensor] = {}

    def keep(name: str) -> Any:
        return lambda t, hook: t.register_hook(lambda g: grads.__setitem__(name, g)) and None

    hm.add_hook("blocks.1.hook_attn_out", lambda t, hook: t + d)
    hm.add_hook("blocks.1.hook_resid_mid", keep("mid"))
    hm.add_hook("blocks.0.attn.hook_q", keep("q"))
    logits = hm(input_ids()).logits
    logits.float().pow(2).mean().backward()
    hm.reset_hooks()
    layer = reference.model.layers[1]
    mids: list[Tensor] = []
    ln2 = layer.post_attention_layernorm
    install = sum_edit(layer, ln2, [(layer.self_attn, 0.22)], [layer.mlp], 0.22, "before0", d)
    handles = install()
    handles.append(
        ln2.register_forward_pre_hook(
            lambda m, a: mids.append(a[0]) or a[0].register_hook(lambda g: grads.__setitem__("plain", g)) and None
        )
    )
    try:
        expected = reference(input_ids()).logits
    finally:
        for h in handles:
            h.remove()
    expected.float().pow(2).mean().backward()
    assert torch.equal(logits.detach(), expected.detach())
    assert grads["q"].abs().sum() > 0
    assert relative_error(grads["mid"], grads["plain"]) < 1e-6
    hm.unwrap()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("point", ["hook_attn_out", "hook_resid_mid", "hook_mlp_out"])
def test_edits_of_a_scaled_layer_under_gradient_checkpointing(point: str, reentrant: bool) -> None:
    """With gradient checkpointing (the layers re-run in the backward pass), an edit where the layer adds its branches
    gives the logits and the gradients of the plain model without checkpointing, the same edit made by plain hooks
    doing the layer's sums, up to rounding (the edit's difference is carried into the MLP module's output, divided
    by the constant, so that the recomputation rebuilds it: measured at most 8e-7 of the largest value)."""
    model = _granite(0.22)
    truth = copy.deepcopy(model)
    hm = wrap_generic(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for m in (model, truth):
        m.config.use_cache = False
        m.train()
    d = seeded_delta(hm.run_with_cache(input_ids())[1][f"blocks.1.{point}"], 70)
    hm.add_hook(f"blocks.1.{point}", lambda t, hook: t + d)
    try:
        logits = hm(input_ids(), use_cache=False).logits
        logits.pow(2).mean().backward()
    finally:
        hm.reset_hooks()
    layer = truth.model.layers[1]
    edits = sum_edits(
        layer, layer.post_attention_layernorm, {"hook_attn_out": (layer.self_attn, 0.22)}, [layer.mlp], 0.22
    )
    handles = edits[point](d)()
    try:
        expected = truth(input_ids(), use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    expected.pow(2).mean().backward()
    assert relative_error(logits, expected) < 1e-5
    for got, want in ((model.model.layers[0], truth.model.layers[0]), (model.model.layers[1], truth.model.layers[1])):
        assert relative_error(got.self_attn.q_proj.weight.grad, want.self_attn.q_proj.weight.grad) < 1e-5
        assert relative_error(got.mlp.down_proj.weight.grad, want.mlp.down_proj.weight.grad) < 1e-5
    hm.unwrap()


def test_a_scaled_mixture_of_experts_gets_what_an_unscaled_one_does() -> None:
    """GraniteMoe with a residual multiplier: the MoE description an unscaled layer gets (routing points, every
    expert's weights), the constant folded into ``W_O``/``b_O`` and the experts' ``W_out``/``b_out`` (the same
    parameters as a model with multiplier 1.0, times 0.22); GraniteMoeShared's MLP of two modules (the experts and a
    shared MLP it adds to theirs) is described too: the same points as with multiplier 1.0, the shared MLP's among
    them, and the constant in ``W_O``."""
    model, unit = (tiny_model("granitemoe", residual_multiplier=m, **GRANITE_MULTIPLIERS) for m in (0.22, 1.0))
    hm, hu = wrap_generic(model), wrap_generic(unit)
    got, unscaled = block_points(hm, 1), block_points(hu, 1)
    assert got == unscaled and "attn.hook_result" in got, sorted(got ^ unscaled)
    experts = "mlp.hook_router_logits" in unscaled  # (transformers 4.x's experts are not described)
    for name in ("W_O", "b_O", "W_out", "b_out")[: 4 if experts else 2]:
        assert torch.equal(getattr(hm, name), getattr(hu, name) * 0.22), name
    for name in ("W_Q", "W_in", "W_gate", "W_router")[: 4 if experts else 1]:
        assert torch.equal(getattr(hm, name), getattr(hu, name)), name
    hm.unwrap()
    hu.unwrap()
    shared, shared_unit = (
        tiny_model("granitemoeshared", residual_multiplier=m, shared_intermediate_size=96) for m in (0.22, 1.0)
    )
    hs, hsu = wrap_generic(shared), wrap_generic(shared_unit)
    got, unscaled = block_points(hs, 1), block_points(hsu, 1)
    assert got == unscaled, sorted(got ^ unscaled)
    assert {"attn.hook_q", "attn.hook_result", "hook_mlp_out", "mlp.shared_expert.hook_post"} <= got
    assert torch.equal(hs.W_O, hsu.W_O * 0.22) and torch.equal(hs.W_Q, hsu.W_Q)
    hs.unwrap()
    hsu.unwrap()


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


class _SkipMLP(torch.nn.Module):
    """``down(tanh(up(x))) + skip(x)``: no gated or plain MLP of one output projection."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down, self.skip = (torch.nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))) + self.skip(x)


def test_the_warning_of_an_undescribed_scaled_layer_names_only_what_is_missing() -> None:
    """GraniteMoeShared's layer (an MLP of two modules added times the constant) whose shared MLP no description reads
    (replaced by a module adding a projection of its input to a plain MLP's output) is not described: the warning
    names as needing a plugin the queries, keys and values, not the norm scales and ``hook_resid_mid`` it serves."""
    model = tiny_model("granitemoeshared", residual_multiplier=0.5, shared_intermediate_size=96, **GRANITE_MULTIPLIERS)
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.shared_mlp = _SkipMLP(model.config.hidden_size)
    hm = wrap_generic(model)
    assert {"blocks.0.ln1.hook_scale", "blocks.0.hook_resid_mid"} <= set(hm.hook_dict)
    needs = summary(hm).split(" need a plugin")[0].rsplit(". ", 1)[-1]
    assert needs.startswith("Queries, keys and values") and "norm scales" not in needs and "resid_mid" not in needs
    hm.unwrap()


def test_a_bfloat16_model_finds_its_constants_where_rounding_moves_the_estimate() -> None:
    """In bfloat16 a small MLP output added to a larger residual leaves the least-squares estimate of its multiplier
    several roundings off (0.20 for 0.22, with transformers' own initialisation): the constants are still tried by
    their distance from it, each by the exact check, so every layer is described as in float32."""
    config = shrink_config(AutoConfig.for_model("granite"))
    for key, value in {"residual_multiplier": 0.22, **GRANITE_MULTIPLIERS}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    full = wrap_generic(model)
    names = list(full.hook_names)
    full.unwrap()
    hm = wrap_generic(model.to(torch.bfloat16))
    assert not findings(model).missing, findings(model).missing
    assert hm.hook_names == names
    assert [(b.attn_scale, b.mlp_scale) for b in hm.block_layouts] == [(0.22, 0.22)] * len(hm.block_layouts)
    hm.unwrap()
