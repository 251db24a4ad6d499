"""Nemotron-H's mixture-of-experts layer, a block of one branch (``x + mixer(norm(x))``, the mixer a MoE), described
by the generic adapter's mixer form: its router's points ``mlp.hook_router_logits`` and ``mlp.hook_routing_weights``
(the routing: sigmoid scores, a selection bias, grouped top-k, renormalized, times ``routed_scaling_factor``, read
from the probe as a :class:`~lensadapters.moe.Routing`) and its shared expert's (an MLP that is not gated:
``mlp.shared_expert.hook_pre``/``hook_post``/``hook_result``) are served, verified at wrap time. Their values are
those of plain PyTorch hooks on the HF modules (the routing weights also recomputed by hand from the router's live
parameters), an edit changes the logits as the same edit made by plain hooks does (an edited routing weight: the MoE
output as the experts written out in plain PyTorch from their 3-D parameters compute it), gradients through an edit
are a plain hook's, and cached generation with an edit is the plain hooks' generation. Before, the layer had no
``mlp.*`` point (the MoE was not described in a block of one branch, and experts that are not gated not at all)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import first_tensor, logits_with, relative_error, seeded_delta, tiny_model, wrap_generic

Tensor = torch.Tensor

pytestmark = pytest.mark.transformers5_only

#: eight experts in two groups of four, one group kept, two experts per token, the weights scaled by 2.5
CONFIG = dict(
    layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
    num_hidden_layers=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)
MOE = 1  # the layer whose only branch is the mixture of experts
ROUTER = ("mlp.hook_router_logits", "mlp.hook_routing_weights")
SHARED = ("mlp.shared_expert.hook_pre", "mlp.shared_expert.hook_post", "mlp.shared_expert.hook_result")


def _model() -> torch.nn.Module:
    model = tiny_model("nemotron_h", **CONFIG)
    gate = model.model.layers[MOE].mixer.gate
    bias = torch.randn(gate.e_score_correction_bias.shape, generator=torch.Generator().manual_seed(3))
    gate.e_score_correction_bias.copy_(0.3 * bias)  # a selection bias that changes the choice (zeros at init)
    return model


@pytest.fixture(scope="module")
def wrapped() -> Any:
    model = _model()
    hm = wrap_generic(model)
    yield model, hm
    hm.unwrap()


def _moe(model: torch.nn.Module) -> torch.nn.Module:
    return model.model.layers[MOE].mixer


def _route(model: torch.nn.Module, logits: Tensor) -> tuple[Tensor, Tensor]:
    """``(weights, indices)`` of router logits ``[tokens, E]``, written out from the config and the router's live
    selection bias: the sigmoid scores, biased for choosing, the groups of the best two-score sum kept, top-k,
    renormalized, scaled."""
    c, gate = model.config, _moe(model).gate
    scores = logits.sigmoid()
    choice = scores + gate.e_score_correction_bias
    groups = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
    kept = groups.topk(2, dim=-1).values.sum(-1).topk(c.topk_group, dim=-1).indices
    mask = torch.zeros(groups.shape[:2], dtype=torch.bool).scatter(1, kept, True)
    choice = choice.masked_fill(~mask.repeat_interleave(c.n_routed_experts // c.n_group, dim=1), float("-inf"))
    index = choice.topk(c.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, index)
    return weights / weights.sum(-1, keepdim=True) * c.routed_scaling_factor, index


def _experts_sum(model: torch.nn.Module, x: Tensor, weights: Tensor, index: Tensor) -> Tensor:
    """The routed experts' weighted sum for the flattened MoE input ``x``, from their 3-D parameters:
    ``down[e] @ relu(up[e] @ x)^2`` (not gated)."""
    experts = _moe(model).experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(index.shape[1]):
            e = int(index[t, slot])
            hidden = torch.relu(F.linear(x[t], experts.up_proj[e])) ** 2
            out[t] = out[t] + weights[t, slot] * F.linear(hidden, experts.down_proj[e])
    return out


def _plain(model: torch.nn.Module) -> dict[str, Tensor]:
    """Each point's value read by plain PyTorch hooks on the HF modules, in one forward."""
    moe = _moe(model)
    seen: dict[str, Tensor] = {}

    def gate(m: Any, a: Any, o: Any) -> None:
        seen["mlp.hook_router_logits"], seen["mlp.hook_routing_weights"], seen["index"] = (t.clone() for t in o)
        seen["in"] = a[0].clone()

    handles = [
        moe.gate.register_forward_hook(gate),
        moe.shared_experts.up_proj.register_forward_hook(lambda m, a, o: seen.__setitem__(SHARED[0], o.clone())),
        moe.shared_experts.down_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__(SHARED[1], a[0].clone())),
        moe.shared_experts.register_forward_hook(lambda m, a, o: seen.__setitem__(SHARED[2], o.clone())),
        moe.register_forward_hook(lambda m, a, o: seen.__setitem__("hook_mlp_out", first_tensor(o).clone())),
    ]
    try:
        with torch.no_grad():
            model(input_ids())
    finally:
        for h in handles:
            h.remove()
    return seen


def test_the_moe_layer_is_served_its_router_and_shared_expert_points(wrapped: Any) -> None:
    _, hm = wrapped
    served = {n.split(".", 2)[2] for n in hm.hook_dict if n.startswith(f"blocks.{MOE}.mlp.")}
    assert served == set(ROUTER + SHARED)  # no hook_gate: the shared expert is not gated
    order = [n.split(".", 2)[2] for n in hm.hook_names if n.startswith(f"blocks.{MOE}.")]
    assert order.index("ln2.hook_normalized") < order.index(ROUTER[0]) < order.index(ROUTER[1])
    assert order.index(ROUTER[1]) < order.index(SHARED[0]) < order.index("hook_mlp_out")


def test_values_are_the_modules_and_the_written_out_routing(wrapped: Any) -> None:
    model, hm = wrapped
    plain = _plain(model)
    _, cache = hm.run_with_cache(input_ids())
    b, p = input_ids().shape
    for name in ROUTER + SHARED + ("hook_mlp_out",):
        got = cache[f"blocks.{MOE}.{name}"]
        assert got.shape[:2] == (b, p), name
        assert relative_error(got.reshape(plain[name].shape), plain[name]) < 1e-6, name
    x = plain["in"].reshape(b * p, -1)
    weights, index = _route(model, F.linear(x, _moe(model).gate.weight))
    assert torch.equal(index.sort(-1).values, plain["index"].sort(-1).values)  # the hand-written routing's choice
    got = cache[f"blocks.{MOE}.mlp.hook_routing_weights"].reshape(b * p, -1)
    dense = torch.zeros(b * p, model.config.n_routed_experts)  # slot by slot with the model's indices
    assert relative_error(dense.scatter(1, plain["index"], got), dense.scatter(1, index, weights)) < 1e-6
    routed = _experts_sum(model, x, plain["mlp.hook_routing_weights"], plain["index"])
    expected = (routed + plain[SHARED[2]].reshape(b * p, -1)).reshape(plain["hook_mlp_out"].shape)
    assert relative_error(cache[f"blocks.{MOE}.hook_mlp_out"], expected) < 1e-5


def _gate_edit(model: torch.nn.Module, change: Callable[[Tensor, Tensor, Tensor], tuple]) -> Callable[[], list]:
    """A plain hook on the router replacing its ``(logits, weights, index)`` by ``change`` of them."""
    return lambda: [_moe(model).gate.register_forward_hook(lambda m, a, o: change(*o))]


def _reference(model: torch.nn.Module, name: str, d: Tensor) -> Callable[[], list]:
    moe = _moe(model)
    if name == "mlp.hook_routing_weights":
        return _gate_edit(model, lambda logits, w, index: (logits, w + d.reshape(w.shape), index))
    if name == "mlp.hook_router_logits":

        def routed(logits: Tensor, w: Tensor, index: Tensor) -> tuple:
            edited = logits + d.reshape(logits.shape)
            return (edited, *_route(model, edited))

        return _gate_edit(model, routed)
    module, side = {
        SHARED[0]: (moe.shared_experts.up_proj, "out"),
        SHARED[1]: (moe.shared_experts.down_proj, "in"),
        SHARED[2]: (moe.shared_experts, "out"),
    }[name]
    if side == "in":
        return lambda: [module.register_forward_pre_hook(lambda m, a: (a[0] + d.reshape(a[0].shape), *a[1:]))]
    return lambda: [module.register_forward_hook(lambda m, a, o: o + d.reshape(o.shape))]


@pytest.mark.parametrize("name", ROUTER + SHARED)
def test_an_edit_changes_the_logits_as_plain_hooks_do(wrapped: Any, name: str) -> None:
    model, hm = wrapped
    _, cache = hm.run_with_cache(input_ids(), names_filter=[f"blocks.{MOE}.{name}"])
    value = cache[f"blocks.{MOE}.{name}"]
    d = seeded_delta(value, 5) * (0.3 if name != "mlp.hook_router_logits" else 0.5)
    edited = hm.run_with_hooks(input_ids(), fwd_hooks=[(f"blocks.{MOE}.{name}", lambda t, hook: t + d)])
    expected = logits_with(model, _reference(model, name, d))
    assert not torch.equal(expected, logits_with(model, lambda: []))  # the edit reaches the logits
    assert relative_error(edited, expected) < 1e-5


def test_edited_routing_weights_give_the_written_out_experts_output(wrapped: Any) -> None:
    """hook_mlp_out under an edit of the routing weights: the experts computed in plain PyTorch from their 3-D
    parameters with the edited weights, plus the shared expert."""
    model, hm = wrapped
    plain = _plain(model)
    b, p = input_ids().shape
    w = plain["mlp.hook_routing_weights"]
    d = seeded_delta(w, 7) * 0.5
    seen: dict[str, Tensor] = {}
    hm.run_with_hooks(
        input_ids(),
        fwd_hooks=[
            (f"blocks.{MOE}.mlp.hook_routing_weights", lambda t, hook: t + d.reshape(t.shape)),
            (f"blocks.{MOE}.hook_mlp_out", lambda t, hook: seen.__setitem__("out", t.clone())),
        ],
    )
    x = plain["in"].reshape(b * p, -1)
    routed = _experts_sum(model, x, w + d, plain["index"])
    expected = (routed + plain[SHARED[2]].reshape(b * p, -1)).reshape(seen["out"].shape)
    assert not torch.allclose(expected, plain["hook_mlp_out"])
    assert relative_error(seen["out"], expected) < 1e-5


@pytest.mark.parametrize("name", ["mlp.hook_routing_weights", "mlp.hook_router_logits", SHARED[0]])
def test_gradients_through_an_edit_are_a_plain_hooks(name: str) -> None:
    model = _model()
    hm = wrap_generic(model)
    try:
        _, cache = hm.run_with_cache(input_ids(), names_filter=[f"blocks.{MOE}.{name}"])
        shape = cache[f"blocks.{MOE}.{name}"].shape
        grads = []
        for served in (True, False):
            d = (seeded_delta(torch.zeros(shape), 9) * 0.1).requires_grad_(True)
            if served:
                with hm.hooks([(f"blocks.{MOE}.{name}", lambda t, hook, d=d: t + d.reshape(t.shape))]):
                    logits = hm(input_ids(), use_cache=False).logits
            else:
                handles = _reference(model, name, d)()
                try:
                    logits = model(input_ids(), use_cache=False).logits
                finally:
                    for h in handles:
                        h.remove()
            logits.pow(2).mean().backward()
            grads.append(d.grad)
        assert grads[1].abs().max() > 0
        assert relative_error(grads[0], grads[1]) < 1e-5
    finally:
        hm.unwrap()


def test_cached_generation_with_an_edit_is_the_plain_hooks(wrapped: Any) -> None:
    model, hm = wrapped
    ids = input_ids()[:1, :4]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    with hm.hooks([(f"blocks.{MOE}.mlp.hook_routing_weights", lambda t, hook: t * torch.tensor([1.5, 0.25]))]):
        got = hm.generate(ids, **kwargs)
    handles = _gate_edit(model, lambda logits, w, index: (logits, w * torch.tensor([1.5, 0.25]), index))()
    try:
        with torch.no_grad():
            want = model.generate(ids, **kwargs)
    finally:
        for h in handles:
            h.remove()
    plain = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert max(relative_error(a, b) for a, b in zip(got.logits, want.logits)) < 1e-5
    assert any(not torch.equal(a, b) for a, b in zip(want.logits, plain.logits))  # the edit reaches every step


def test_no_hook_runs_hf_forward_bitwise(wrapped: Any) -> None:
    model, hm = wrapped
    with torch.no_grad():
        assert torch.equal(hm(input_ids()).logits, model(input_ids()).logits)
