"""Experts as two projections applied to rows grouped by expert, routed by a router returning the routing grouped the
same way (:class:`lensadapters.moe.GroupedExperts`, ``router_output="grouped"``: transformers 4.57's GraniteMoe,
GraniteMoeShared and GraniteMoeHybrid, whose ``input_linear``/``output_linear`` hold ``[E, out, in]`` weights): the
automatic description gives their layers the routing points transformers 5 gives them (``mlp.hook_router_logits``,
``mlp.hook_routing_weights``), verified by the probe. Their values are what the HF modules compute (by hand from
them), an edit of each moves the logits as the same plain PyTorch hook on the HF modules does, bit for bit, the
gradients through an edit are the plain hook's, and the experts' weights read from the description give the MoE
module's output. (transformers 5 fuses these experts into ``gate_up_proj``/``down_proj``: skipped there.)"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
import transformers

from lensadapters.adapters.generic import findings
from lensadapters.adapters.generic.verify import check_points
from lensadapters.adapters.moe.experts import bind
from lensadapters.adapters.moe.routing import expert_rows
from lensadapters.moe import GroupedExperts
from lensadapters.testing.every_model_type import input_ids
from lensadapters.testing.generic import check_described_weights
from lensadapters.testing.moe_reference import moe_reference
from lensadapters.testing.strategies import Inputs
from lensadapters.wiring.weights import mlp_weights
from tests.branch_helpers import (
    add_to_output,
    edit_error,
    record,
    relative_error,
    seeded_delta,
    served_and_plain_gradients,
    tiny_model,
    wrap_generic,
)

pytestmark = pytest.mark.skipif(
    not transformers.__version__.startswith("4."), reason="transformers 4.x's grouped experts (5.x fuses them)"
)

ROUTING = ["mlp.hook_router_logits", "mlp.hook_routing_weights"]
#: (model_type, config, the layer whose MLP is checked): GraniteMoeHybrid's attention layer follows a Mamba layer
MODELS = {
    "granitemoe": ({}, 0),
    "granitemoeshared": ({"shared_intermediate_size": 96}, 0),
    "granitemoehybrid": ({"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2}, 1),
}


def _model(model_type: str) -> tuple[torch.nn.Module, int]:
    config, layer = MODELS[model_type]
    return tiny_model(model_type, **config), layer


@pytest.fixture(scope="module", params=list(MODELS))
def wrapped(request: Any) -> Any:
    model, layer = _model(request.param)
    hm = wrap_generic(model)
    yield model, hm, layer
    hm.unwrap()


def _weights_edit(router: torch.nn.Module, d: torch.Tensor) -> Callable[[], list]:
    """A plain hook adding ``d`` ``[tokens, k]`` to the routing weights a grouped router returns (its rows' weights,
    ``order`` the top-k slot of each row)."""
    k = d.shape[-1]

    def hook(module: Any, args: Any, output: Any) -> Any:
        order, gates = output[0], output[2]
        weights = torch.empty_like(gates).scatter(0, order, gates).reshape(-1, k)
        return (*output[:2], (weights + d.to(gates.dtype)).flatten()[order], *output[3:])

    return lambda: [router.register_forward_hook(hook)]


def test_the_routing_points_are_served_on_every_moe_layer(wrapped: Any) -> None:
    model, hm, layer = wrapped
    d = findings(model).description
    assert d is not None
    for i, described in enumerate(d.layers):
        if described is None:  # GraniteMoeHybrid's Mamba layer (the mixer form)
            continue
        assert {f"blocks.{i}.{n}" for n in ROUTING} <= set(hm.hook_names), i
        experts = hm.mlp_layouts[i].experts
        assert isinstance(experts, GroupedExperts), experts
        assert (experts.gate_up, experts.down) == ("input_linear", "output_linear")
    # the probe's verdict on them: value and edit those of the plain references (none refused or unchecked)
    names = [f"blocks.{layer}.{n}" for n in ROUTING]
    assert check_points(hm.wiring, input_ids(), names) == dict.fromkeys(names)
    with torch.no_grad():
        assert torch.equal(hm(input_ids()).logits, model(input_ids()).logits)  # no hooks: the model's own forward


def test_each_routing_point_reads_what_the_hf_modules_compute(wrapped: Any) -> None:
    """``hook_router_logits`` is the router's linear layer's output, ``hook_routing_weights`` the softmax over the
    top-k of those logits, computed here by hand from the router's weight and its input."""
    model, hm, layer = wrapped
    moe = model.model.layers[layer].block_sparse_moe
    seen = record(model, {"x": (moe, "in"), "logits": (moe.router.layer, "out")})
    _, cache = hm.run_with_cache(input_ids(), names_filter=lambda n: n.startswith(f"blocks.{layer}.mlp."))
    x = seen["x"].reshape(-1, seen["x"].shape[-1])
    by_hand = F.linear(x, moe.router.layer.weight).float()
    top, index = by_hand.topk(model.config.num_experts_per_tok, dim=1)
    lead = seen["x"].shape[:-1]
    assert torch.equal(cache[f"blocks.{layer}.mlp.hook_router_logits"], seen["logits"].reshape(*lead, -1))
    assert torch.equal(cache[f"blocks.{layer}.mlp.hook_router_logits"], by_hand.reshape(*lead, -1))
    weights = torch.softmax(top, dim=1).type_as(x)
    assert torch.equal(cache[f"blocks.{layer}.mlp.hook_routing_weights"], weights.reshape(*lead, -1))
    # the experts' weights read from the description (W_in, W_gate, W_out of each expert) give the MoE's output
    W_gate, _ = mlp_weights(hm.wiring, layer, "gate")
    gate_rows, up_rows = moe.input_linear.weight.chunk(2, dim=1)
    assert torch.equal(W_gate, gate_rows.transpose(1, 2))
    assert torch.equal(mlp_weights(hm.wiring, layer, "in")[0], up_rows.transpose(1, 2))
    assert hm.block_layouts[layer].mlp_scale == 1.0  # (W_out includes a branch constant: none here)
    assert torch.equal(mlp_weights(hm.wiring, layer, "out")[0], moe.output_linear.weight.transpose(1, 2))
    out = record(model, {"y": (moe, "out")})["y"]
    expected = moe_reference(hm, layer, x, weights, index).reshape(out.shape)
    assert relative_error(expected.float(), out) < 1e-5


def _router_values(model: torch.nn.Module, moe: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The router's logits, routing weights and expert indices ``[tokens, k]`` (its rows' weights and experts put
    back in top-k order) in one forward of ``model``, recorded at the router's output by a plain hook."""
    seen: dict[str, torch.Tensor] = {}

    def hook(module: Any, args: Any, output: Any) -> None:
        order, gates, logits = output[0], output[2], output[4]
        k = order.numel() // logits.shape[0]
        seen["weights"] = torch.empty_like(gates).scatter(0, order, gates).reshape(-1, k)
        seen["logits"] = logits
        experts = torch.repeat_interleave(torch.arange(len(output[3])), torch.tensor(output[3]))
        seen["index"] = torch.empty_like(order).scatter(0, order, experts).reshape(-1, k)

    handle = moe.router.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(input_ids())
    finally:
        handle.remove()
    return seen


def _plain_edits(
    model: torch.nn.Module, moe: torch.nn.Module
) -> dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], Any]]]:
    """Each routing point's value as the HF modules hold it (``[tokens, ...]``) and its plain-hook edit."""
    seen = _router_values(model, moe)
    k = seen["weights"].shape[-1]
    return {
        "mlp.hook_router_logits": (
            seen["logits"],
            lambda d: add_to_output(moe.router.layer, d.reshape(-1, d.shape[-1])),
        ),
        "mlp.hook_routing_weights": (seen["weights"], lambda d: _weights_edit(moe.router, d.reshape(-1, k))),
    }


@pytest.mark.parametrize("model_type", list(MODELS))
@pytest.mark.parametrize("point", ROUTING)
def test_an_edit_changes_the_logits_as_the_same_plain_hook_does(model_type: str, point: str) -> None:
    """An edit of the logits large enough to change which experts some tokens choose (the router computes its
    routing from them), or of the routing weights: the logits of the same plain hook, bit for bit."""
    model, layer = _model(model_type)
    moe = model.model.layers[layer].block_sparse_moe
    hm = wrap_generic(model)
    try:
        like, install = _plain_edits(model, moe)[point]
        d = seeded_delta(like, 3) * float(like.abs().max())
        if point == "mlp.hook_router_logits":  # the edit changes the selection of some tokens
            k = model.config.num_experts_per_tok
            assert not torch.equal(like.topk(k).indices, (like + d).topk(k).indices)
        assert edit_error(hm, model, f"blocks.{layer}.{point}", d, install(d)) == 0.0
    finally:
        hm.unwrap()


@pytest.mark.parametrize("point", ROUTING)
def test_gradients_through_an_edit_are_the_plain_hooks(wrapped: Any, point: str) -> None:
    model, hm, layer = wrapped
    like, install = _plain_edits(model, model.model.layers[layer].block_sparse_moe)[point]
    served, direct = served_and_plain_gradients(hm, model, f"blocks.{layer}.{point}", like, lambda d: install(d)())
    assert relative_error(served.reshape(direct.shape), direct) < 1e-6


@pytest.mark.parametrize("model_type", ["granitemoe", "granitemoeshared"])
def test_the_generic_contracts_weight_check_holds(model_type: str) -> None:
    """The generic contract's check of the described weights (the experts' read from the grouped projections)."""
    model, _ = _model(model_type)
    hm = wrap_generic(model)
    try:
        assert all(isinstance(getattr(m, "experts", None), GroupedExperts) for m in hm.mlp_layouts)
        ids = input_ids()
        check_described_weights(hm, Inputs(ids, torch.ones_like(ids), [0]))
    finally:
        hm.unwrap()


def test_the_experts_computed_expert_by_expert_give_the_moe_output(wrapped: Any) -> None:
    """The core's expert-by-expert computation of grouped experts (what it runs while per-expert points are hooked),
    from the live projections' weights and the router's routing, sums to the MoE module's output."""
    model, hm, layer = wrapped
    moe = model.model.layers[layer].block_sparse_moe
    seen = record(model, {"x": (moe, "in"), "y": (moe, "out")})
    routing = _router_values(model, moe)
    x = seen["x"].reshape(-1, seen["x"].shape[-1])
    compute = bind(hm.wiring, hm.block_modules[layer], hm.mlp_layouts[layer])
    out = torch.zeros_like(x)
    with torch.no_grad():
        for e in range(model.config.num_local_experts):
            slot, token = expert_rows(routing["index"], e)
            gate, up = compute.gate_up(e, x[token])
            result = compute.down(e, compute.glu(gate, up)) * routing["weights"][token, slot, None]
            out.index_add_(0, token, result)
    assert relative_error(out.reshape(seen["y"].shape), seen["y"]) < 1e-6
