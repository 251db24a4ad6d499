"""Nemotron-H's mixture-of-experts layer, a block of one branch (``x + mixer(norm(x))``, the mixer a MoE), described
by the generic adapter's mixer form: its router's points ``mlp.hook_router_logits`` and ``mlp.hook_routing_weights``
(the routing: sigmoid scores, a selection bias, grouped top-k, renormalized, times ``routed_scaling_factor``, read
from the probe as a :class:`~lensadapters.moe.Routing`) and its shared expert's (an MLP that is not gated:
``mlp.shared_expert.hook_pre``/``hook_post``/``hook_result``) are served, verified at wrap time. Their values are
those of plain PyTorch hooks on the HF modules (the routing weights also recomputed by hand from the router's live
parameters), an edit changes the logits as the same edit made by plain hooks does (an edited routing weight: the MoE
output as the experts written out in plain PyTorch from their 3-D parameters compute it), gradients through an edit
are a plain hook's, and cached generation with an edit is the plain hooks' generation. Before, the layer had no
``mlp.*`` point (the MoE was not described in a block of one branch, and experts that are not gated not at all).

Its router's further points ``mlp.hook_expert_weights`` (the sigmoid scores) and ``mlp.hook_expert_indices``, and
every expert's ``mlp.experts.{e}.hook_pre``/``hook_post``/``hook_result`` (computed only while hooked), are served
too, verified the same way, and the experts' weights are read live from the fused parameters
(``mlp_weights(hm.wiring, layer, role)``); those were absent before. A MoE point that fails its check is refused on
its own (before, one failure dropped both router points)."""

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
ROUTING = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_routing_weights")
STEPS = ("hook_pre", "hook_post", "hook_result")  # no hook_gate: the experts are not gated
EXPERTS = tuple(f"mlp.experts.{e}.{step}" for e in range(CONFIG["n_routed_experts"]) for step in STEPS)
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
    return _route_scores(model, logits.sigmoid())


def _route_scores(model: torch.nn.Module, scores: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_route` from the sigmoid scores (``mlp.hook_expert_weights``)."""
    c, gate = model.config, _moe(model).gate
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


def _expert_steps(model: torch.nn.Module, x: Tensor, weights: Tensor, index: Tensor, e: int) -> dict[str, Tensor]:
    """Expert ``e``'s steps on the rows of the tokens that chose it (slot, then token), written out from its 3-D
    parameters: ``hook_pre`` the up projection, ``hook_post`` its squared ReLU, ``hook_result`` the down projection
    times the routing weight; and the rows' ``token``."""
    experts = _moe(model).experts
    slot, token = torch.where(index.T == e)
    pre = F.linear(x[token], experts.up_proj[e])
    post = torch.relu(pre) ** 2
    result = F.linear(post, experts.down_proj[e]) * weights[token, slot, None]
    return {"hook_pre": pre, "hook_post": post, "hook_result": result, "token": token}


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


def test_the_moe_layer_is_served_its_routing_expert_and_shared_expert_points(wrapped: Any) -> None:
    _, hm = wrapped
    served = {n.split(".", 2)[2] for n in hm.hook_dict if n.startswith(f"blocks.{MOE}.mlp.")}
    assert served == set(ROUTING + EXPERTS + SHARED)  # no hook_gate: neither the experts nor the shared one is gated
    order = [n.split(".", 2)[2] for n in hm.hook_names if n.startswith(f"blocks.{MOE}.")]
    assert order.index("ln2.hook_normalized") < order.index(ROUTING[0])
    assert [order.index(n) for n in ROUTING] == sorted(order.index(n) for n in ROUTING)
    assert order.index(ROUTING[-1]) < order.index(EXPERTS[0]) < order.index(EXPERTS[-1]) < order.index(SHARED[0])
    assert order.index(SHARED[-1]) < order.index("hook_mlp_out")
    costly = {n.split(".", 2)[2] for n, p in hm.hook_dict.items() if p.costly and n.startswith(f"blocks.{MOE}.")}
    assert costly == set(EXPERTS)  # computed only while hooked: not in run_with_cache's default
    _, cache = hm.run_with_cache(input_ids())
    assert not any(".mlp.experts." in n for n in cache.keys()) and f"blocks.{MOE}.{ROUTING[1]}" in cache.keys()


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
    scores = cache[f"blocks.{MOE}.mlp.hook_expert_weights"]
    assert scores.shape == (b, p, model.config.n_routed_experts)
    assert relative_error(scores.reshape(b * p, -1), F.linear(x, _moe(model).gate.weight).sigmoid()) < 1e-6
    assert torch.equal(cache[f"blocks.{MOE}.mlp.hook_expert_indices"].reshape(b * p, -1), plain["index"])


def test_each_experts_points_are_its_written_out_steps(wrapped: Any) -> None:
    """Every expert's points, hooked, are its steps written out from the 3-D parameters on the rows of the tokens
    that chose it (an expert no token chose: no rows); their results sum to the routed experts' output."""
    model, hm = wrapped
    plain = _plain(model)
    b, p = input_ids().shape
    x, w, index = plain["in"].reshape(b * p, -1), plain["mlp.hook_routing_weights"], plain["index"]
    _, cache = hm.run_with_cache(input_ids(), names_filter=[f"blocks.{MOE}.{n}" for n in EXPERTS])
    total = torch.zeros_like(x)
    for e in range(model.config.n_routed_experts):
        want = _expert_steps(model, x, w, index, e)
        for step in STEPS:
            got = cache[f"blocks.{MOE}.mlp.experts.{e}.{step}"]
            assert got.shape == want[step].shape, (e, step)
            if got.numel():
                assert relative_error(got, want[step]) < 1e-6, (e, step)
        total.index_add_(0, want["token"], cache[f"blocks.{MOE}.mlp.experts.{e}.hook_result"])
    assert relative_error(total, _experts_sum(model, x, w, index)) < 1e-5


def _gate_edit(model: torch.nn.Module, change: Callable[[Tensor, Tensor, Tensor], tuple]) -> Callable[[], list]:
    """A plain hook on the router replacing its ``(logits, weights, index)`` by ``change`` of them."""
    return lambda: [_moe(model).gate.register_forward_hook(lambda m, a, o: change(*o))]


def _busiest_expert(model: torch.nn.Module) -> int:
    """The expert the most rows of the probe input go to, not the first or the last (whose checks the others'
    verdicts share at wrap time)."""
    index = _plain(model)["index"]
    counts = torch.bincount(index.flatten(), minlength=model.config.n_routed_experts)[1:-1]
    return int(counts.argmax()) + 1


def _moved_indices(index: Tensor, n: int) -> Tensor:
    """Each token's first slot moved to the next expert it did not choose."""
    new = index.clone()
    for t in range(index.shape[0]):
        e = (int(index[t, 0]) + 1) % n
        while e in index[t].tolist():
            e = (e + 1) % n
        new[t, 0] = e
    return new


def _expert_edit(model: torch.nn.Module, e: int, step: str, d: Tensor) -> Callable[[], list]:
    """A plain hook on the experts module: expert ``e``'s step ``step`` (written out) plus ``d``, the steps after it
    recomputed, the difference of its result added into the module's output at its tokens."""
    experts = _moe(model).experts

    def hook(m: Any, args: tuple, out: Tensor) -> Tensor:
        x, index, weights = args
        steps = _expert_steps(model, x, weights, index, e)
        slot, token = torch.where(index.T == e)
        value = steps[step] + d
        if step == "hook_pre":
            value = torch.relu(value) ** 2
        if step != "hook_result":
            value = F.linear(value, experts.down_proj[e]) * weights[token, slot, None]
        return out.index_add(0, token, value - steps["hook_result"])

    return lambda: [experts.register_forward_hook(hook)]


def _reference(model: torch.nn.Module, name: str, d: Tensor) -> Callable[[], list]:
    moe = _moe(model)
    if name.startswith("mlp.experts."):
        _, _, e, step = name.split(".")
        return _expert_edit(model, int(e), step, d)
    if name == "mlp.hook_expert_weights":
        return _gate_edit(model, lambda logits, w, index: (logits, *_route_scores(model, logits.sigmoid() + d)))
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


def _resolved(model: torch.nn.Module, name: str) -> str:
    """``EXPERT`` in a point's name: the busiest expert's number."""
    return name.replace("EXPERT", str(_busiest_expert(model)))


@pytest.mark.parametrize("name", ROUTING + SHARED + tuple(f"mlp.experts.EXPERT.{step}" for step in STEPS))
def test_an_edit_changes_the_logits_as_plain_hooks_do(wrapped: Any, name: str) -> None:
    model, hm = wrapped
    name = _resolved(model, name)
    if name == "mlp.hook_expert_indices":  # an integer point: each token's first slot sent to another expert
        _, cache = hm.run_with_cache(input_ids(), names_filter=[f"blocks.{MOE}.{name}"])
        value = cache[f"blocks.{MOE}.{name}"]
        moved = _moved_indices(value.reshape(-1, value.shape[-1]), model.config.n_routed_experts)
        edited = hm.run_with_hooks(
            input_ids(), fwd_hooks=[(f"blocks.{MOE}.{name}", lambda t, hook: moved.view(t.shape))]
        )
        expected = logits_with(model, _gate_edit(model, lambda logits, w, index: (logits, w, moved)))
        assert not torch.equal(expected, logits_with(model, lambda: []))
        assert relative_error(edited, expected) < 1e-5
        return
    _, cache = hm.run_with_cache(input_ids(), names_filter=[f"blocks.{MOE}.{name}"])
    value = cache[f"blocks.{MOE}.{name}"]
    d = seeded_delta(value, 5) * (0.3 if name != "mlp.hook_router_logits" else 0.5)
    edited = hm.run_with_hooks(input_ids(), fwd_hooks=[(f"blocks.{MOE}.{name}", lambda t, hook: t + d)])
    flat = d.reshape(-1, d.shape[-1]) if name == "mlp.hook_expert_weights" else d
    expected = logits_with(model, _reference(model, name, flat))
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


@pytest.mark.parametrize(
    "name", ["mlp.hook_routing_weights", "mlp.hook_router_logits", SHARED[0], "mlp.experts.EXPERT.hook_pre"]
)
def test_gradients_through_an_edit_are_a_plain_hooks(name: str) -> None:
    model = _model()
    hm = wrap_generic(model)
    name = _resolved(model, name)
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


def test_expert_weights_are_read_live_from_the_fused_parameters(wrapped: Any) -> None:
    """``mlp_weights(hm.wiring, layer, role)``: every expert's up (``in``) and down (``out``) projection in
    TransformerLens' shapes, the fused parameters as they are now; no gate weight (the experts are not gated); the
    router's matrix; and ``hook_pre`` of an expert is its rows times its W_in."""
    from lensadapters.errors import WeightUnavailableError
    from lensadapters.moe import router_weight
    from lensadapters.weights import mlp_weights

    model, hm = wrapped
    experts = _moe(model).experts
    W_in, b_in = mlp_weights(hm.wiring, MOE, "in")
    W_out, b_out = mlp_weights(hm.wiring, MOE, "out")
    assert torch.equal(W_in, experts.up_proj.transpose(-2, -1)) and not b_in.any()
    assert torch.equal(W_out, experts.down_proj.transpose(-2, -1)) and not b_out.any()
    assert torch.equal(router_weight(hm.wiring, MOE), _moe(model).gate.weight.T)
    with pytest.raises(WeightUnavailableError, match="not gated"):
        mlp_weights(hm.wiring, MOE, "gate")
    with pytest.raises(AttributeError, match="mlp_weights"):  # dense and MoE layers: read per layer
        _ = hm.W_in
    e = _busiest_expert(model)
    plain = _plain(model)
    b, p = input_ids().shape
    steps = _expert_steps(model, plain["in"].reshape(b * p, -1), plain["mlp.hook_routing_weights"], plain["index"], e)
    _, cache = hm.run_with_cache(input_ids(), names_filter=[f"blocks.{MOE}.mlp.experts.{e}.hook_pre"])
    rows = plain["in"].reshape(b * p, -1)[steps["token"]]
    assert relative_error(cache[f"blocks.{MOE}.mlp.experts.{e}.hook_pre"], rows @ W_in[e]) < 1e-6
    before = experts.up_proj.detach().clone()
    try:
        with torch.no_grad():
            experts.up_proj.mul_(2.0)
        assert torch.equal(mlp_weights(hm.wiring, MOE, "in")[0], 2.0 * before.transpose(-2, -1))  # live
    finally:
        with torch.no_grad():
            experts.up_proj.copy_(before)


def test_a_router_point_that_fails_its_check_is_refused_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reference planted wrong for ``mlp.hook_routing_weights`` (twice the weights the experts are called with):
    that point is not served, the warning names it and why, and ``mlp.hook_router_logits`` (and the others) still
    are, exactly."""
    import warnings

    from lensadapters import HookedModel, Registry
    from lensadapters.adapters.generic import plugin
    from lensadapters.adapters.generic.probe import PROBE_LENGTH
    from lensadapters.adapters.generic.references import Reference, _unflat

    own = plugin.internal_reference

    def planted(hooked: Any, layer: torch.nn.Module, i: int, rest: str) -> Any:
        if i == MOE and rest == "mlp.hook_routing_weights":
            twice = lambda t: 2 * t.reshape(-1, PROBE_LENGTH, t.shape[-1])  # noqa: E731
            return Reference("arg", layer.get_submodule("mixer.experts"), twice, _unflat, spec=2)
        return own(hooked, layer, i, rest)

    monkeypatch.setattr(plugin, "internal_reference", planted)
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookedModel.wrap(model, registry=Registry())
    try:
        served = {n.split(".", 2)[2] for n in hm.hook_dict if n.startswith(f"blocks.{MOE}.mlp.")}
        assert served == set(ROUTING + EXPERTS + SHARED) - {"mlp.hook_routing_weights"}
        text = " ".join(str(w.message) for w in caught)
        assert f"blocks.{MOE}.mlp.hook_routing_weights: its value is not the reference's (arg of" in text
        plain = _plain(model)
        _, cache = hm.run_with_cache(input_ids(), names_filter=[f"blocks.{MOE}.mlp.hook_router_logits"])
        got = cache[f"blocks.{MOE}.mlp.hook_router_logits"]
        assert (
            relative_error(got.reshape(plain["mlp.hook_router_logits"].shape), plain["mlp.hook_router_logits"]) < 1e-6
        )
        d = seeded_delta(got, 5) * 0.5
        edited = hm.run_with_hooks(
            input_ids(), fwd_hooks=[(f"blocks.{MOE}.mlp.hook_router_logits", lambda t, hook: t + d)]
        )
        assert relative_error(edited, logits_with(model, _reference(model, "mlp.hook_router_logits", d))) < 1e-5
    finally:
        hm.unwrap()


def test_in_bfloat16_the_moe_layer_keeps_every_point_and_edits_as_plain_hooks() -> None:
    """The model in bfloat16 (the router computes its logits in float32, the experts sum in float32 and return
    bfloat16): every MoE point is still served (before, the experts' check refused the MoE in bfloat16, and the layer
    had no ``mlp.*`` point), reading them leaves the logits bit for bit, the scores are the sigmoid of the router's
    float32 logits, and an edit of an expert's result moves the logits as the same edit by a plain hook (the experts'
    float32 sum written out)."""
    model = _model().to(torch.bfloat16)
    hm = wrap_generic(model)
    try:
        served = {n.split(".", 2)[2] for n in hm.hook_dict if n.startswith(f"blocks.{MOE}.mlp.")}
        assert served == set(ROUTING + EXPERTS + SHARED)
        plain = _plain(model)
        with torch.no_grad():
            want = model(input_ids()).logits
        e = _busiest_expert(model)
        names = [f"blocks.{MOE}.{n}" for n in ROUTING] + [f"blocks.{MOE}.mlp.experts.{e}.{s}" for s in STEPS]
        logits, cache = hm.run_with_cache(input_ids(), names_filter=names)
        assert torch.equal(logits, want)
        b, p = input_ids().shape
        x = plain["in"].reshape(b * p, -1)
        scores = F.linear(x.float(), _moe(model).gate.weight.float()).sigmoid()
        assert relative_error(cache[f"blocks.{MOE}.mlp.hook_expert_weights"].reshape(b * p, -1), scores) < 1e-6
        result = f"blocks.{MOE}.mlp.experts.{e}.hook_result"
        d = seeded_delta(cache[result], 5) * 0.3
        edited = hm.run_with_hooks(input_ids(), fwd_hooks=[(result, lambda t, hook: t + d)])
        experts = _moe(model).experts

        def summed(m: Any, args: tuple, out: Tensor) -> Tensor:  # the float32 sum with the edit, cast back
            h, index, weights = args
            total = torch.zeros(out.shape, dtype=torch.float32)
            for k in range(model.config.n_routed_experts):
                steps = _expert_steps(model, h, weights, index, k)
                value = steps["hook_result"] + (d if k == e else 0)
                total.index_add_(0, steps["token"], value.float())
            return total.to(out.dtype)

        expected = logits_with(model, lambda: [experts.register_forward_hook(summed)])
        assert not torch.equal(expected, want)
        assert relative_error(edited, expected) < 2e-2  # bfloat16 after the MoE: its rounding
        # the attention-only block keeps its head inputs and hook_result (before, refused in bfloat16: the check's
        # floor was float32's, the logits being upcast, while the model rounds to bfloat16 before them)
        attention = {n.split(".", 2)[2] for n in hm.hook_dict if n.startswith("blocks.2.")}
        assert {"hook_q_input", "hook_k_input", "hook_v_input", "attn.hook_result"} <= attention
        _, cache = hm.run_with_cache(input_ids(), names_filter=["blocks.2.hook_q_input"])
        d = seeded_delta(cache["blocks.2.hook_q_input"], 6) * 3.0
        edited = hm.run_with_hooks(input_ids(), fwd_hooks=[("blocks.2.hook_q_input", lambda t, hook: t + d)])
        layer = model.model.layers[2]
        heads, resid = d.shape[2], []

        def per_head(m: Any, a: Any, out: Tensor) -> Tensor:  # head h's query from norm(resid_pre + d[..., h, :])
            own = [m(layer.norm(resid[0] + d[:, :, h])).unflatten(-1, (heads, -1)) for h in range(heads)]
            return torch.stack([q[:, :, h] for h, q in enumerate(own)], dim=2).flatten(-2)

        def hooks() -> list:
            busy: list = []

            def on_q(m: Any, a: Any, out: Tensor) -> Any:
                if busy:
                    return None
                busy.append(1)
                try:
                    return per_head(m, a, out)
                finally:
                    busy.clear()

            return [
                layer.norm.register_forward_pre_hook(
                    lambda m, a: None if busy else resid.__setitem__(slice(None), [a[0]])
                ),
                layer.mixer.q_proj.register_forward_hook(on_q),
            ]

        expected = logits_with(model, hooks)
        assert not torch.equal(expected, want)
        assert relative_error(edited, expected) < 2e-2
    finally:
        hm.unwrap()
