"""A mixture of experts whose routing weights scale the experts' *input* (Llama 4's: a linear router, the sigmoid of
the top-k logits as scores, zeros elsewhere, every expert run on its scaled copy of the input, summed, plus a shared
expert on the unscaled input), described by the generic adapter (``FusedExperts.scaled_input``, ``Routing.order=
"topk_sigmoid"``, ``router_output="scores_logits"``): its routing points read what plain PyTorch hooks read, an edit
there changes the logits exactly as the same edit inside a hand-written MoE forward, gradients through an edit match
finite differences, and the experts' weights are the live parameters'. The shared expert's points
(``mlp.shared_expert.*``) read and edit as plain hooks on its modules do; in bfloat16 the routing and shared-expert
points are served, read HF's own computation bitwise and edit as plain hooks do, bitwise. Top-2 routing, so that
slots matter."""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lensadapters import HookedModel
from lensadapters.adapters.generic import findings
from lensadapters.moe import FusedExperts, MoELayout
from lensadapters.testing import assert_close
from lensadapters.testing.every_model_type import input_ids
from lensadapters.testing.moe_reference import moe_reference
from lensadapters.testing.scan_checks import check_gradient_through_an_edit
from lensadapters.wiring.weights import mlp_weights
from tests.llama4_helpers import TOP_K, llama4_model, llama4_parts, llama4_wrap

POINTS = ("mlp.hook_router_logits", "mlp.hook_routing_weights")


def _moe_layers(hm: HookedModel) -> list[int]:
    return [i for i, layout in enumerate(hm.mlp_layouts) if isinstance(layout, MoELayout)]


@pytest.fixture(scope="module", params=["llama4_text", "llama4"])
def wrapped(request: Any) -> Any:
    model = llama4_model(request.param)
    hm = llama4_wrap(model)
    yield request.param, model, hm
    hm.unwrap()


def _hand_written_moe(
    hm: HookedModel,
    layer: int,
    logits_edit: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    weights_edit: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Any:
    """A forward hook replacing the MoE module's output by a hand-written MoE forward from the HF modules' parameters
    (router, the experts' 3-D parameters, the shared expert), with the edits made inside it."""
    moe, router, experts, shared = llama4_parts(hm, layer)
    m = experts.gate_up_proj.shape[-1] // 2

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        x = args[0].reshape(-1, args[0].shape[-1])
        logits = F.linear(x, router.weight)
        logits = logits_edit(logits) if logits_edit is not None else logits
        top, index = torch.topk(logits, TOP_K, dim=-1)
        weights = torch.sigmoid(top)
        weights = weights_edit(weights) if weights_edit is not None else weights
        out = shared(x)
        for slot in range(TOP_K):
            for e in range(experts.gate_up_proj.shape[0]):
                rows = index[:, slot] == e
                xs = x[rows] * weights[rows, slot, None]
                gate_up = xs @ experts.gate_up_proj[e]
                h = experts.act_fn(gate_up[:, :m]) * gate_up[:, m:]
                out = out.index_add(0, rows.nonzero()[:, 0], h @ experts.down_proj[e])
        return (out, logits)

    return moe.register_forward_hook(hook)


def test_the_moe_is_described_with_its_routing_points_and_says_what_it_leaves(wrapped: Any) -> None:
    """Every MoE layer: experts scaled at their input, select-first sigmoid routing, the shared expert; the routing
    points are served, the probabilities of every expert, the indices and the per-expert points too (verified
    against plain hooks on the router and the experts module), and nothing is missing."""
    model_type, model, hm = wrapped
    layers = _moe_layers(hm)
    assert layers == list(range(len(hm.block_modules))), findings(model).missing
    layout = hm.mlp_layouts[layers[0]]
    assert isinstance(layout.experts, FusedExperts) and layout.experts.scaled_input and layout.experts.transposed
    assert layout.routing.order == "topk_sigmoid" and layout.routing.top_k == TOP_K
    assert layout.router_output == "scores_logits"
    names = set(hm.hook_names)
    for i in layers:
        assert {f"blocks.{i}.{p}" for p in POINTS} <= names
        assert f"blocks.{i}.mlp.hook_expert_indices" in names
        assert f"blocks.{i}.mlp.experts.0.hook_result" in names
    missing = findings(model).missing
    assert "mlp.hook_pre and mlp.hook_post (and the MLP weights)" not in missing
    assert "unverified" not in missing, missing


def test_reads_are_the_plain_hooks_values_and_leave_the_output_bitwise(wrapped: Any) -> None:
    """The router's logits (its second output) and the scores at their top-k, read by a plain forward hook, are the
    points' values bitwise; with the points read, and with no hook at all, the logits are HF's own, bitwise."""
    _, model, hm = wrapped
    ids = input_ids()
    layer = _moe_layers(hm)[-1]
    _, router, _, _ = llama4_parts(hm, layer)
    seen: list = []
    handle = router.register_forward_hook(lambda m, a, out: seen.append((out[0].clone(), out[1].clone())))
    with torch.no_grad():
        own = model(ids).logits
        plain = hm(ids).logits
        read, cache = hm.run_with_cache(ids, names_filter=[f"blocks.{layer}.{p}" for p in POINTS])
    handle.remove()
    scores, logits = seen[0]
    assert torch.equal(plain, own) and torch.equal(read, own)
    assert torch.equal(cache[f"blocks.{layer}.mlp.hook_router_logits"], logits.reshape(*ids.shape, -1))
    top = logits.topk(TOP_K, dim=-1).indices
    weights = cache[f"blocks.{layer}.mlp.hook_routing_weights"]
    assert weights.shape == (*ids.shape, TOP_K)
    assert torch.equal(weights, scores.gather(-1, top).reshape(weights.shape))
    assert torch.equal(weights, torch.sigmoid(logits.gather(-1, top)).reshape(weights.shape))


@pytest.mark.parametrize("point", POINTS)
def test_an_edit_changes_the_output_as_the_same_edit_in_a_hand_written_moe(wrapped: Any, point: str) -> None:
    """An edit of the routing weights (or of the logits, re-routed: top-k and sigmoid) changes the model's logits as
    the same edit inside a hand-written MoE forward from the HF modules' parameters does; the hand-written forward
    unedited is the model's."""
    _, model, hm = wrapped
    ids = input_ids()
    layer = _moe_layers(hm)[0]
    n = model.config.get_text_config().num_local_experts
    g = torch.Generator().manual_seed(5)
    delta = torch.randn(*ids.shape, TOP_K if point.endswith("weights") else n, generator=g) * 0.5
    with torch.no_grad():
        own = model(ids).logits
        handle = _hand_written_moe(hm, layer)
        try:
            hand = model(ids).logits
        finally:
            handle.remove()
        assert_close(hand, own, "the hand-written MoE forward")
        edited = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.{layer}.{point}", lambda t, hook: t + delta)])

        def edit(t: torch.Tensor) -> torch.Tensor:
            return t + delta.reshape(t.shape)

        kw = {"weights_edit": edit} if point.endswith("weights") else {"logits_edit": edit}
        handle = _hand_written_moe(hm, layer, **kw)  # type: ignore[arg-type]
        try:
            by_hand = model(ids).logits
        finally:
            handle.remove()
    assert (edited - own).abs().max() > 1e-3
    assert_close(edited, by_hand, f"{point} edited")


def test_the_experts_weights_are_the_live_parameters_and_give_the_moe_output(wrapped: Any) -> None:
    """``W_gate``/``W_in`` are the gate and up halves of ``gate_up_proj`` (stored ``[E, d, 2 * d_mlp]``), ``W_out``
    is ``down_proj``; the MoE output computed from them (float64, the weights scaling each expert's input) and the
    shared expert is the MoE module's."""
    _, _, hm = wrapped
    layer = _moe_layers(hm)[0]
    moe, _, experts, _ = llama4_parts(hm, layer)
    m = experts.gate_up_proj.shape[-1] // 2
    W_gate, W_in, W_out = (mlp_weights(hm.wiring, layer, role)[0] for role in ("gate", "in", "out"))
    assert torch.equal(W_gate, experts.gate_up_proj[..., :m]) and torch.equal(W_in, experts.gate_up_proj[..., m:])
    assert torch.equal(W_out, experts.down_proj)
    x = torch.randn(7, W_in.shape[1], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, logits = moe(x)
    top, index = logits.topk(TOP_K, dim=-1)
    expected = moe_reference(hm, layer, x, torch.sigmoid(top), index)
    assert_close(expected.float(), out, "the MoE output from the read weights")


def test_an_expert_chosen_twice_is_computed_in_each_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's site as a plugin declaring this MoE gets it (the generic adapter does not serve the indices, which
    have no plain reference: here its verification is switched off): an index edit sending every token to one
    expert in both slots, which the scores cannot carry, makes the core compute the experts itself, each slot on the
    input scaled by its own weight, as the hand-written MoE does."""
    monkeypatch.setattr("lensadapters.adapters.generic.plugin.verify_description", lambda hooked: {})
    model = llama4_model("llama4_text")
    hm = llama4_wrap(model)
    ids = input_ids()
    layer = _moe_layers(hm)[0]
    moe, router, experts, shared = llama4_parts(hm, layer)
    point = f"blocks.{layer}.mlp.hook_expert_indices"

    def same_expert(t: torch.Tensor, hook: Any) -> torch.Tensor:
        return torch.zeros_like(t)  # expert 0 in every slot

    with torch.no_grad():
        own = model(ids).logits
        edited = hm.run_with_hooks(ids, fwd_hooks=[(point, same_expert)])
        m = experts.gate_up_proj.shape[-1] // 2

        def by_hand(module: nn.Module, args: tuple, output: Any) -> Any:
            x = args[0].reshape(-1, args[0].shape[-1])
            logits = F.linear(x, router.weight)
            weights = torch.sigmoid(logits.topk(TOP_K, dim=-1).values)
            out = shared(x)
            for slot in range(TOP_K):
                gate_up = (x * weights[:, slot, None]) @ experts.gate_up_proj[0]
                out = out + (experts.act_fn(gate_up[:, :m]) * gate_up[:, m:]) @ experts.down_proj[0]
            return (out, logits)

        handle = moe.register_forward_hook(by_hand)
        try:
            expected = model(ids).logits
        finally:
            handle.remove()
    hm.unwrap()
    assert (edited - own).abs().max() > 1e-3
    assert_close(edited, expected, "one expert in both slots")


def test_gradients_through_a_routing_weights_edit_match_finite_differences() -> None:
    """Float64: the gradient of the final norm's input through an edit of the routing weights (through the scores
    into the experts' scaled input) matches finite differences, and is not zero."""
    model = llama4_model("llama4_text", torch.float64)
    hm = llama4_wrap(model)
    layer = _moe_layers(hm)[-1]  # no MoE after it: a later router's float32 sigmoid would round the differences
    norm = model.get_submodule(hm.layout.ln_final)
    try:
        check_gradient_through_an_edit(hm, input_ids()[:1, :5], f"blocks.{layer}.{POINTS[1]}", norm, at_input=True)
    finally:
        hm.unwrap()


def test_gradients_through_a_logits_edit_match_the_hand_written_moe_and_finite_differences() -> None:
    """Float64, an edit of the router's logits at one position along a fixed direction: its gradient equals the
    gradient through the same edit in the hand-written MoE forward, and central finite differences. The model takes
    the sigmoid of the selected logits in float32 even in float64 (as HF's router does), so the finite differences
    take a step of 1e-4 and agree to 1e-2 relative (float32 rounding over the step), not the 1e-6 step of
    ``check_gradient_through_an_edit``."""
    model = llama4_model("llama4_text", torch.float64)
    hm = llama4_wrap(model)
    ids = input_ids()[:1, :5]
    layer = _moe_layers(hm)[-1]  # no MoE after it: a later router's float32 sigmoid would round the differences
    norm = model.get_submodule(hm.layout.ln_final)
    n = model.config.num_local_experts
    direction = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def moved(t: torch.Tensor, scale: torch.Tensor, position: Optional[int]) -> torch.Tensor:
        t = t.clone()
        if position is None:  # the hand-written forward's flat [tokens, experts] logits
            t[2] = t[2] + scale * direction
        else:
            t[:, 2] = t[:, 2] + scale * direction
        return t

    def loss(scale: torch.Tensor, by_hand: bool) -> torch.Tensor:
        seen: list = []
        handles = [norm.register_forward_pre_hook(lambda m, a: seen.append(a[0]))]
        if by_hand:
            handles.append(_hand_written_moe(hm, layer, logits_edit=lambda t: moved(t, scale, None)))
            model(ids, use_cache=False)
        else:
            with hm.hooks([(f"blocks.{layer}.{POINTS[0]}", lambda t, hook: moved(t, scale, 2))]):
                hm(ids, use_cache=False)
        for handle in handles:
            handle.remove()
        return seen[0].pow(2).sum()

    try:
        scale = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
        (grad,) = torch.autograd.grad(loss(scale, False), scale)
        (hand,) = torch.autograd.grad(loss(scale, True), scale)
        with torch.no_grad():
            step = 1e-4
            numeric = (loss(scale + step, False) - loss(scale - step, False)) / (2 * step)
    finally:
        hm.unwrap()
    assert grad.abs() > 1e-6
    torch.testing.assert_close(grad, hand, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(grad, numeric, rtol=1e-2, atol=1e-9)


# --- the shared expert's points ----------------------------------------------------------------------------------

SHARED = tuple(f"mlp.shared_expert.{p}" for p in ("hook_gate", "hook_pre", "hook_post", "hook_result"))


def _shared_modules(hm: HookedModel, layer: int) -> dict[str, tuple[nn.Module, bool]]:
    """Each shared-expert point's HF module and whether the point is its input (else its output)."""
    shared = llama4_parts(hm, layer)[3]
    return {
        SHARED[0]: (shared.gate_proj, False),
        SHARED[1]: (shared.up_proj, False),
        SHARED[2]: (shared.down_proj, True),
        SHARED[3]: (shared, False),
    }


def _plain_edit(module: nn.Module, is_input: bool, delta: torch.Tensor) -> Any:
    """A plain PyTorch hook adding ``delta`` (in the point's ``[b, p, ...]`` shape) to the module's flattened input or
    output."""
    if is_input:
        return module.register_forward_pre_hook(lambda m, args: (args[0] + delta.reshape(args[0].shape),))
    return module.register_forward_hook(lambda m, args, out: out + delta.reshape(out.shape))


def test_the_shared_expert_is_served_with_the_names_other_moe_families_use(wrapped: Any) -> None:
    """The shared expert (a gated MLP the MoE module runs after its routed experts, on the flattened input) has
    Qwen 3.5's shared-expert points, after the routing points and before ``hook_mlp_out``, in every MoE layer."""
    _, _, hm = wrapped
    names = list(hm.hook_names)
    for i in _moe_layers(hm):
        order = [names.index(f"blocks.{i}.{p}") for p in (*POINTS, *SHARED, "hook_mlp_out")]
        assert order == sorted(order)


def test_the_shared_experts_points_are_its_modules_values_and_edit_as_plain_hooks_do(wrapped: Any) -> None:
    """Each shared-expert point reads what a plain hook on its HF module reads (the projections' outputs, the down
    projection's input, the shared expert's output before the MoE module adds the routed experts into it in place),
    shown as ``[b, p, ...]``; reading them leaves the logits HF's, bitwise; adding a delta there moves the logits
    bitwise as adding it with a plain PyTorch hook on that module does."""
    _, model, hm = wrapped
    ids = input_ids()
    layer = _moe_layers(hm)[0]
    modules = _shared_modules(hm, layer)
    seen: dict[str, torch.Tensor] = {}

    def record(point: str, value: torch.Tensor) -> None:
        seen[point] = value.clone()

    handles = []
    for point, (module, is_input) in modules.items():
        if is_input:
            handles.append(module.register_forward_pre_hook(lambda m, a, p=point: record(p, a[0])))
        else:
            handles.append(module.register_forward_hook(lambda m, a, o, p=point: record(p, o)))
    with torch.no_grad():
        own = model(ids).logits
        read, cache = hm.run_with_cache(ids, names_filter=[f"blocks.{layer}.{p}" for p in SHARED])
    for handle in handles:
        handle.remove()
    assert torch.equal(read, own)
    for point in SHARED:
        value = cache[f"blocks.{layer}.{point}"]
        assert value.shape[:2] == ids.shape
        assert torch.equal(value, seen[point].reshape(value.shape)), point
    g = torch.Generator().manual_seed(7)
    for point, (module, is_input) in modules.items():
        delta = torch.randn(cache[f"blocks.{layer}.{point}"].shape, generator=g) * 0.5
        with torch.no_grad():
            edited = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.{layer}.{point}", lambda t, hook, d=delta: t + d)])
            handle = _plain_edit(module, is_input, delta)
            try:
                by_hand = model(ids).logits
            finally:
                handle.remove()
        assert (edited - own).abs().max() > 1e-3, point
        assert torch.equal(edited, by_hand), point


def test_gradients_through_a_shared_expert_edit_match_finite_differences() -> None:
    """Float64: the gradient of the final norm's input through an edit of the shared expert's hidden, and of its
    output (served on a copy), matches finite differences, and is not zero."""
    model = llama4_model("llama4_text", torch.float64)
    hm = llama4_wrap(model)
    layer = _moe_layers(hm)[-1]  # no MoE after it: a later router's float32 sigmoid would round the differences
    norm = model.get_submodule(hm.layout.ln_final)
    try:
        for point in (SHARED[2], SHARED[3]):
            check_gradient_through_an_edit(hm, input_ids()[:1, :5], f"blocks.{layer}.{point}", norm, at_input=True)
    finally:
        hm.unwrap()


# --- bfloat16 ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16() -> Any:
    model = llama4_model("llama4_text", torch.bfloat16)
    hm = llama4_wrap(model)
    yield model, hm
    hm.unwrap()


def test_a_bfloat16_model_keeps_its_routing_and_shared_expert_points(bf16: Any) -> None:
    """In bfloat16 the routing and shared-expert points are still served (verified on the bfloat16 probe), and the
    model's logits with none hooked are HF's, bitwise."""
    model, hm = bf16
    names = set(hm.hook_names)
    for i in _moe_layers(hm):
        assert {f"blocks.{i}.{p}" for p in (*POINTS, *SHARED)} <= names
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, model(ids).logits)


def test_bfloat16_values_are_hfs_computation_from_its_modules(bf16: Any) -> None:
    """The points' values, in bfloat16, bitwise what the HF modules compute from the MoE module's (flattened) input,
    the way HF computes it: the router's product, the sigmoid in float32 of the top-k logits cast back, the shared
    expert's projections, ``act(gate) * up`` and its output."""
    model, hm = bf16
    ids = input_ids()
    layer = _moe_layers(hm)[0]
    moe, router, _, shared = llama4_parts(hm, layer)
    inputs: list = []
    handle = moe.register_forward_pre_hook(lambda m, a: inputs.append(a[0].clone()))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=[f"blocks.{layer}.{p}" for p in (*POINTS, *SHARED)])
    handle.remove()
    with torch.no_grad():
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        assert x.dtype == torch.bfloat16
        logits = F.linear(x, router.weight)
        top = torch.topk(logits, TOP_K, dim=1).values
        gate, up = shared.gate_proj(x), shared.up_proj(x)
        post = shared.activation_fn(gate) * up
        expected = {
            POINTS[0]: logits,
            POINTS[1]: torch.sigmoid(top.float()).to(top.dtype),
            SHARED[0]: gate,
            SHARED[1]: up,
            SHARED[2]: post,
            SHARED[3]: shared.down_proj(post),
        }
    for point, value in expected.items():
        got = cache[f"blocks.{layer}.{point}"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, value.reshape(got.shape)), point


def test_bfloat16_edits_equal_plain_torch_hook_edits_bitwise(bf16: Any) -> None:
    """In bfloat16, an edit of the logits (re-routed), of the routing weights or of a shared-expert point moves the
    model's logits bitwise as the same edit made by a plain PyTorch hook on the HF module: the router's output
    recomputed from the edited logits as the router computes it, the scores with the edited weights at the top-k,
    the shared expert's module's input or output."""
    model, hm = bf16
    ids = input_ids()
    layer = _moe_layers(hm)[0]
    _, router, _, _ = llama4_parts(hm, layer)
    n = model.config.num_local_experts
    with torch.no_grad():
        own = model(ids).logits
        _, cache = hm.run_with_cache(ids, names_filter=[f"blocks.{layer}.{p}" for p in SHARED])

    def logits_edit(delta: torch.Tensor) -> Any:
        def hook(m: nn.Module, args: tuple, out: Any) -> Any:
            logits = out[1] + delta.reshape(out[1].shape)
            top, index = torch.topk(logits, TOP_K, dim=1)
            scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)
            return (torch.sigmoid(scores.float()).to(scores.dtype), logits)

        return router.register_forward_hook(hook)

    def weights_edit(delta: torch.Tensor) -> Any:
        def hook(m: nn.Module, args: tuple, out: Any) -> Any:
            scores, logits = out
            index = torch.topk(logits, TOP_K, dim=-1).indices
            weights = scores.gather(-1, index) + delta.reshape(index.shape)
            return (scores.scatter(-1, index, weights), logits)

        return router.register_forward_hook(hook)

    shapes = {POINTS[0]: (*ids.shape, n), POINTS[1]: (*ids.shape, TOP_K)}
    shapes.update({p: tuple(cache[f"blocks.{layer}.{p}"].shape) for p in SHARED})
    plain: dict[str, Callable[[torch.Tensor], Any]] = {POINTS[0]: logits_edit, POINTS[1]: weights_edit}
    for point, (module, is_input) in _shared_modules(hm, layer).items():
        plain[point] = lambda delta, module=module, is_input=is_input: _plain_edit(module, is_input, delta)
    g = torch.Generator().manual_seed(11)
    for point, make in plain.items():
        delta = (torch.randn(shapes[point], generator=g) * 0.5).to(torch.bfloat16)
        with torch.no_grad():
            edited = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.{layer}.{point}", lambda t, hook, d=delta: t + d)])
            handle = make(delta)
            try:
                by_hand = model(ids).logits
            finally:
                handle.remove()
        assert (edited.float() - own.float()).abs().max() > 1e-3, point
        assert torch.equal(edited, by_hand), point
