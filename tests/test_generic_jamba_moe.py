"""Jamba's mixture-of-experts layers (a Mamba or attention mixer, then a MoE MLP), described by the generic adapter's
mixer form. Under transformers 5.x (a router returning ``(logits, top_k_weights, top_k_index)``, gated experts in
3-D parameters) every MoE point is served, verified at wrap time: ``mlp.hook_expert_weights`` is the softmax of the
router's logits and an edit of it routes as the model's own top-k would (the routing written out here), an expert's
``hook_gate`` is its gate rows written out from ``gate_up_proj`` and an edit of it moves the logits as the same edit
made by a plain hook on the experts module. Before, only ``mlp.hook_router_logits`` and ``hook_routing_weights`` were
served. Under transformers 4.x (experts in a ``ModuleList`` of gated MLPs, the MoE module routing the router's logits
itself) the routing points ``mlp.hook_router_logits`` / ``hook_routing_weights`` and each expert's ``hook_gate`` /
``hook_pre`` / ``hook_post`` are served (before, none: the warning said the experts were not described);
``tests/test_generic_expert_list.py`` checks their values, edits and gradients."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from lensadapters import HookedModel, Registry
from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import relative_error, seeded_delta, tiny_model

Tensor = torch.Tensor

MOE = 1  # expert_layer_period 2, offset 1: layers 1 and 3
FIVE = not transformers.__version__.startswith("4.")


@pytest.fixture(scope="module")
def wrapped() -> Any:
    model = tiny_model("jamba", use_mamba_kernels=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model, registry=Registry())
    yield model, hm, " ".join(str(w.message) for w in caught)
    hm.unwrap()


def _logits(model: torch.nn.Module, hooks: list) -> Tensor:
    """The model's logits with plain hooks (removed after; no cache: the tiny model's layers are all Mamba, whose
    cache alone transformers 5.x cannot size)."""
    try:
        with torch.no_grad():
            return model(input_ids(), use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()


def _moe(model: torch.nn.Module) -> Any:
    return model.model.layers[MOE].feed_forward


def test_the_moe_layers_points_or_why_not(wrapped: Any) -> None:
    model, hm, text = wrapped
    served = {n.split(".", 2)[2] for n in hm.hook_dict if n.startswith(f"blocks.{MOE}.mlp.")}
    n = model.config.num_experts
    if not FIVE:
        steps4 = ("hook_gate", "hook_pre", "hook_post")
        assert served == {f"mlp.{p}" for p in ("hook_router_logits", "hook_routing_weights")} | {
            f"mlp.experts.{e}.{s}" for e in range(n) for s in steps4
        }
        assert "No mlp.* points" not in text
        return
    steps = ("hook_gate", "hook_pre", "hook_post", "hook_result")
    routing = ("hook_router_logits", "hook_expert_weights", "hook_expert_indices", "hook_routing_weights")
    assert served == {f"mlp.{p}" for p in routing} | {f"mlp.experts.{e}.{s}" for e in range(n) for s in steps}


def _plain(model: torch.nn.Module) -> dict[str, Tensor]:
    seen: dict[str, Tensor] = {}

    def router(m: Any, a: Any, o: Any) -> None:
        seen["in"], (seen["logits"], seen["weights"], seen["index"]) = a[0].clone(), (t.clone() for t in o)

    _logits(model, [_moe(model).router.register_forward_hook(router)])
    return seen


def _route(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Jamba's routing of probabilities: the top-k, not renormalized."""
    weights, index = torch.topk(probs, k, dim=-1)
    return weights, index


@pytest.mark.transformers5_only
def test_expert_weights_are_the_softmax_and_an_edit_routes_as_the_model(wrapped: Any) -> None:
    model, hm, _ = wrapped
    plain = _plain(model)
    name = f"blocks.{MOE}.mlp.hook_expert_weights"
    _, cache = hm.run_with_cache(input_ids(), names_filter=[name], use_cache=False)
    probs = torch.softmax(plain["logits"].float(), dim=-1)
    assert relative_error(cache[name].reshape(probs.shape), probs) < 1e-6
    d = seeded_delta(cache[name], 3) * 0.3
    edited = hm.run_with_hooks(input_ids(), fwd_hooks=[(name, lambda t, hook: t + d)], use_cache=False)
    k = model.config.num_experts_per_tok
    flat = d.reshape(probs.shape)

    def reroute(m: Any, a: Any, o: Any) -> tuple:
        return (o[0], *_route(torch.softmax(o[0].float(), dim=-1) + flat, k))

    expected = _logits(model, [_moe(model).router.register_forward_hook(reroute)])
    assert not torch.equal(expected, _logits(model, []))
    assert relative_error(edited, expected) < 1e-5


@pytest.mark.transformers5_only
def test_an_experts_gate_is_written_out_and_an_edit_is_a_plain_hooks(wrapped: Any) -> None:
    model, hm, _ = wrapped
    plain = _plain(model)
    experts = _moe(model).experts
    e = int(torch.bincount(plain["index"].flatten()).argmax())
    slot, token = torch.where(plain["index"].T == e)
    gate, up = F.linear(plain["in"][token], experts.gate_up_proj[e]).chunk(2, dim=-1)
    name = f"blocks.{MOE}.mlp.experts.{e}.hook_gate"
    _, cache = hm.run_with_cache(input_ids(), names_filter=[name], use_cache=False)
    assert relative_error(cache[name], gate) < 1e-6
    d = seeded_delta(gate, 4) * 0.3
    edited = hm.run_with_hooks(input_ids(), fwd_hooks=[(name, lambda t, hook: t + d)], use_cache=False)

    def hook(m: Any, args: tuple, out: Tensor) -> Tensor:
        x, index, weights = args
        s, t = torch.where(index.T == e)
        g, u = F.linear(x[t], experts.gate_up_proj[e]).chunk(2, dim=-1)
        w = weights[t, s, None]
        old = F.linear(experts.act_fn(g) * u, experts.down_proj[e]) * w
        new = F.linear(experts.act_fn(g + d) * u, experts.down_proj[e]) * w
        return out.index_add(0, t, new - old)

    expected = _logits(model, [experts.register_forward_hook(hook)])
    assert not torch.equal(expected, _logits(model, []))
    assert relative_error(edited, expected) < 1e-5
