"""The verification's references of the routing and per-expert points of a mixture of experts whose routing weights
scale the experts' *input* (``FusedExperts.scaled_input``, a router returning ``(scores, logits)``: Llama 4's form),
written out in plain PyTorch from the router's output, the experts module's input and output and the experts' live
3-D parameters. Nothing here reads a served point; :mod:`.verify` compares the two sides.

* ``mlp.hook_expert_weights`` ``[b, p, E]``: the router's scores as the model computes them (the sigmoid of the
  selected logits, zeros elsewhere). An edit changes the scores of the experts each token selected (the top-k of the
  logits); the selection stays the router's (``Routing.order="topk_sigmoid"``: an edit at an expert not selected
  is dropped; to send a token to another expert, edit ``mlp.hook_expert_indices``).
* ``mlp.hook_expert_indices`` ``[b, p, k]``: the top-k of the router's logits (``torch.topk``, as the router takes
  it). An edit sends each token to the edited experts, each slot keeping its score: the scores become the old
  slots' scores at the new experts, zeros elsewhere (what the router would return had it chosen those experts).
* ``mlp.experts.{e}.hook_gate`` / ``hook_pre`` / ``hook_post`` ``[n_e, d_mlp]`` and ``hook_result``
  ``[n_e, d_model]``: expert ``e`` on the rows it computes for the tokens that selected it (slot, then token:
  :func:`lensadapters.moe.expert_rows`), its input those tokens' MLP input *times their score* (the experts
  module's input block ``e``: the model scales before the expert), the gate and up products of that input with
  the expert's ``gate_up_proj`` slice, ``act(gate) * up`` and its product with ``down_proj``: the rows of block
  ``e`` of the experts module's output, what the expert adds to ``hook_mlp_out``. An edit recomputes what follows
  the edited step from the live parameters and puts the edited rows into the experts module's output.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.moe import FusedExperts, MoELayout

Tensor = torch.Tensor
Edit = Optional[Callable[[Tensor], Tensor]]

#: the per-expert points of a scaled-input MoE with a reference here, in the order an expert computes them
_STEPS = ("hook_gate", "hook_pre", "hook_post", "hook_result")


class _RouterReference:
    """Plain hooks on the router (``modules``) reading its scores, or the top-k of its logits, and editing them."""

    def __init__(self, router: nn.Module, top_k: int, what: str) -> None:
        self.modules, self.top_k, self.what = (router,), top_k, what

    def install(self, edit: Edit, seen: list[Tensor]) -> list[Any]:
        def post(module: nn.Module, args: tuple, output: Any) -> Any:
            scores, logits = output[0], output[1]
            index = torch.topk(logits, self.top_k, dim=-1).indices
            if self.what == "weights":
                seen.append(scores.detach().clone())
                if edit is None:
                    return None
                selected = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, index, True)
                return (torch.where(selected, edit(scores), scores), *output[1:])
            seen.append(index.clone())
            if edit is None:
                return None
            moved = edit(index)
            return (torch.zeros_like(scores).scatter(-1, moved, scores.gather(-1, index)), *output[1:])

        return [self.modules[0].register_forward_hook(post)]

    def integer_delta(self, index: Tensor) -> Tensor:
        """An edit of the indices ``[..., k]`` for the check: each token's first slot moved to the next expert it
        did not select (none where it selected every expert), so that no expert is in two slots."""
        n = self.n_experts
        first, new = index[..., 0], index[..., 0].clone()
        pending = torch.ones_like(first, dtype=torch.bool)
        for j in range(1, n):
            candidate = (first + j) % n
            free = pending & ~(candidate.unsqueeze(-1) == index).any(-1)
            new = torch.where(free, candidate, new)
            pending &= ~free
        delta = torch.zeros_like(index)
        delta[..., 0] = new - first
        return delta

    n_experts = 0


class _ExpertReference:
    """Plain hooks on the router (recording which tokens selected expert ``e``, in which slot) and on the experts
    module (its input block ``e`` at those rows, the expert's steps written out from its live parameters, an edited
    step's consequences put into block ``e`` of its output)."""

    def __init__(self, router: nn.Module, experts: nn.Module, spec: FusedExperts, top_k: int, e: int, step: str):
        self.modules = (router, experts)
        self.spec, self.top_k, self.e, self.step = spec, top_k, e, step
        #: for an expert no token of the probe selects: every token's first slot sent to it (the scores of that slot
        #: moved there), as an edit of ``mlp.hook_expert_indices`` would (:func:`.verify.check_points`)
        self.routed_here = False

    def _weight(self, name: str) -> Tensor:
        w = getattr(self.modules[1], name)[self.e]
        return w if self.spec.transposed else w.T  # [in, out]

    def install(self, edit: Edit, seen: list[Tensor]) -> list[Any]:
        router, experts = self.modules
        routed: list[Tensor] = []

        def on_router(module: nn.Module, args: tuple, output: Any) -> Any:
            scores, logits = output[0], output[1]
            index = torch.topk(logits, self.top_k, dim=-1).indices
            moved = index.clone()
            if self.routed_here:
                moved[..., 0] = self.e
            _, token = torch.where(moved.T == self.e)  # slot, then token
            routed[:] = [token]
            if not self.routed_here:
                return None
            return (torch.zeros_like(scores).scatter(-1, moved, scores.gather(-1, index)), *output[1:])

        def on_experts(module: nn.Module, args: tuple, output: Tensor) -> Any:
            (token,) = routed
            n = getattr(module, self.spec.gate_up).shape[0]
            block = args[0].unflatten(0, (n, -1))[self.e]
            x = block[token]
            both = x @ self._weight(self.spec.gate_up)
            if self.spec.interleaved:
                gate, up = both[..., ::2], both[..., 1::2]
            else:
                gate, up = both.chunk(2, dim=-1)
            act = getattr(module, self.spec.act)
            values = {"hook_gate": gate, "hook_pre": up}
            values["hook_post"] = act(gate) * up
            values["hook_result"] = values["hook_post"] @ self._weight(self.spec.down)
            seen.append(values[self.step].detach().clone())
            if edit is None:
                return None
            edited = edit(values[self.step])
            if self.step in ("hook_gate", "hook_pre"):
                gate, up = (edited, up) if self.step == "hook_gate" else (gate, edited)
                edited = act(gate) * up
            if self.step != "hook_result":
                edited = edited @ self._weight(self.spec.down)
            out = output.clone()
            out.unflatten(0, (n, -1))[self.e, token] = edited.to(out.dtype)
            return out

        return [router.register_forward_hook(on_router), experts.register_forward_hook(on_experts)]


def scaled_input_reference(get: Callable[[str], nn.Module], moe: MoELayout, rest: str) -> Optional[tuple[Any, bool]]:
    """``(spec of a "hooks" reference, whether the point is [b, p, ...] shown from [b * p, ...])`` of the point
    ``rest`` of a scaled-input MoE (see the module docstring); ``None`` for another point or another MoE."""
    experts = moe.experts
    if not (isinstance(experts, FusedExperts) and experts.scaled_input and moe.router_output == "scores_logits"):
        return None
    if experts.gate_up_bias or experts.down_bias or experts.glu is not None:
        return None
    k = moe.routing.top_k
    if rest in ("mlp.hook_expert_weights", "mlp.hook_expert_indices"):
        ref = _RouterReference(get(moe.router), k, "weights" if rest.endswith("weights") else "indices")
        ref.n_experts = moe.routing.n_experts
        return ref, True
    parts = rest.split(".")
    if len(parts) == 4 and parts[:2] == ["mlp", "experts"] and parts[2].isdigit() and parts[3] in _STEPS:
        e = int(parts[2])
        if e < moe.routing.n_experts:
            return _ExpertReference(get(moe.router), get(experts.module), experts, k, e, parts[3]), False
    return None


# --- a router returning the routing, fused experts called with it (the mixer form's MoE: Nemotron-H, Jamba) ----


def _written_route(routing: Any, probs: Tensor, bias: Optional[Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(top_k_weights, top_k_index)`` of the probabilities ``probs`` ``[tokens, E]``, written out here from the
    :class:`~lensadapters.moe.Routing` fields (plain PyTorch, not the core's routing code): the experts chosen by the
    probabilities (plus ``bias`` for choosing), within the kept groups, weighted by the unbiased probabilities,
    renormalized and scaled as the description says, in ``dtype`` (the router's weights' own)."""
    k = routing.top_k
    if routing.groups is None and bias is None:
        weights, index = torch.topk(probs, k, dim=-1)
    else:
        choice = probs if bias is None else probs + bias
        if routing.groups is not None:
            n_group, topk_group = routing.groups
            per = routing.n_experts // n_group
            grouped = choice.reshape(-1, n_group, per)
            if routing.group_score == "top2_sum":
                score = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                score = grouped.amax(-1)
            kept = torch.topk(score, topk_group, dim=-1, sorted=False).indices
            mask = torch.zeros_like(score, dtype=torch.bool).scatter(1, kept, True).repeat_interleave(per, dim=1)
            choice = choice.masked_fill(~mask, routing.masked_score)
        index = torch.topk(choice, k, dim=-1, sorted=False).indices
        weights = probs.gather(1, index)
    if routing.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + routing.normalize_eps)
    return (weights * routing.scale).to(dtype), index


class _RoutedIndices(_RouterReference):
    """``mlp.hook_expert_indices`` of a router returning ``(logits, top_k_weights, top_k_index)``: its index; an
    edit replaces the index the router returns (each slot keeps its weight), what the experts module is called
    with."""

    def __init__(self, router: nn.Module, n_experts: int) -> None:
        super().__init__(router, 0, "indices")
        self.n_experts = n_experts

    def install(self, edit: Edit, seen: list[Tensor]) -> list[Any]:
        def post(module: nn.Module, args: tuple, output: Any) -> Any:
            seen.append(output[2].clone())
            return None if edit is None else (output[0], output[1], edit(output[2]), *output[3:])

        return [self.modules[0].register_forward_hook(post)]


class _RoutedProbabilities:
    """``mlp.hook_expert_weights`` of a router returning ``(logits, top_k_weights, top_k_index)``: the softmax (or
    sigmoid) of its logits in float32. The routing the description gives of them (:func:`_written_route`) must be
    the router's own, else the reference raises (the point is then not served); an edit replaces the router's
    weights and index by that routing of the edited probabilities."""

    def __init__(self, router: nn.Module, routing: Any, logits: bool = False) -> None:
        #: ``logits``: the reference of ``mlp.hook_router_logits`` instead (the router's logits; an edit routed by
        #: the description), for a router in half precision, where moving its input cannot move its logits exactly
        self.modules, self.routing, self.logits = (router,), routing, logits

    def _bias(self) -> Optional[Tensor]:
        name = self.routing.selection_bias
        return None if name is None else getattr(self.modules[0], name)

    def install(self, edit: Edit, seen: list[Tensor]) -> list[Any]:
        routing = self.routing

        def post(module: nn.Module, args: tuple, output: Any) -> Any:
            logits, weights, index = output[0], output[1], output[2]
            if routing.probabilities == "sigmoid":
                probs = logits.float().sigmoid()
            else:
                probs = torch.softmax(logits.float(), dim=-1)
            own_weights, own_index = _written_route(routing, probs, self._bias(), weights.dtype)
            order, own_order = index.argsort(-1), own_index.argsort(-1)
            same_index = torch.equal(index.gather(-1, order), own_index.gather(-1, own_order))
            if not same_index or not torch.allclose(
                weights.gather(-1, order).float(), own_weights.gather(-1, own_order).float(), rtol=1e-3, atol=1e-6
            ):
                raise RuntimeError("the routing description does not reproduce the router's own routing")
            seen.append((logits if self.logits else probs).detach().clone())
            if edit is None:
                return None
            if self.logits:
                logits = edit(logits)
                probs = logits.float().sigmoid() if routing.probabilities == "sigmoid" else logits.float().softmax(-1)
            else:
                probs = edit(probs)
            new_weights, new_index = _written_route(routing, probs, self._bias(), weights.dtype)
            return (logits, new_weights, new_index, *output[3:])

        return [self.modules[0].register_forward_hook(post)]


class _RoutedExpert:
    """``mlp.experts.{e}.hook_gate`` / ``hook_pre`` / ``hook_post`` / ``hook_result`` of fused experts called as
    ``experts(hidden [tokens, d], top_k_index, top_k_weights)``: expert ``e`` written out from the module's live 3-D
    parameters on the rows of the tokens that chose it (slot, then token), as the call's own arguments route them;
    ``hook_result`` its output times the routing weight, what it adds to the module's output. An edit recomputes the
    steps after it and adds the edited result's difference into the module's output at those tokens."""

    def __init__(self, experts: nn.Module, spec: FusedExperts, e: int, step: str) -> None:
        self.modules, self.spec, self.e, self.step = (experts,), spec, e, step
        #: for an expert no token of the probe selects: every token's first slot sent to it (its weight kept), as an
        #: edit of ``mlp.hook_expert_indices`` would (:func:`.verify.check_points`)
        self.routed_here = False

    def _product(self, x: Tensor, name: str, bias: Optional[str], e: Optional[int] = None) -> Tensor:
        """Expert ``e``'s (default: this one's) product of ``x`` with the parameter ``name`` (and its bias)."""
        module, e = self.modules[0], self.e if e is None else e
        w = getattr(module, name)[e]
        out = x @ w if self.spec.transposed else torch.nn.functional.linear(x, w)
        return out + getattr(module, bias)[e] if bias else out

    def _gate_up(self, x: Tensor, e: Optional[int] = None) -> tuple[Optional[Tensor], Tensor]:
        both = self._product(x, self.spec.gate_up, self.spec.gate_up_bias, e)
        if not self.spec.gated:
            return None, both
        if self.spec.interleaved:
            return both[..., ::2], both[..., 1::2]
        gate, up = both.chunk(2, dim=-1)
        return gate, up

    def _post(self, gate: Optional[Tensor], up: Tensor) -> Tensor:
        act = getattr(self.modules[0], self.spec.act)
        return act(gate) * up if gate is not None else act(up)

    def install(self, edit: Edit, seen: list[Tensor]) -> list[Any]:
        experts, spec, step = self.modules[0], self.spec, self.step

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if not self.routed_here:
                return None
            index = _call_args(args, kwargs)[1].clone()
            index[..., 0] = self.e
            if len(args) > 1:
                return (args[0], index, *args[2:]), kwargs
            return args, {**kwargs, "top_k_index": index}

        def steps(gate: Optional[Tensor], up: Tensor) -> dict[str, Tensor]:
            values = {"hook_pre": up, "hook_post": self._post(gate, up)}
            if gate is not None:
                values["hook_gate"] = gate
            return values

        def post(module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> Any:
            hidden, index, weights = _call_args(args, kwargs)
            slot, token = torch.where(index.T == self.e)
            gate, up = self._gate_up(hidden[token])
            values = steps(gate, up)
            weight = weights[token, slot, None]
            result = self._product(values["hook_post"], spec.down, spec.down_bias) * weight
            values["hook_result"] = result
            seen.append(values[step].detach().clone())
            if edit is None:
                return None
            edited = edit(values[step])
            if step in ("hook_gate", "hook_pre"):
                edited = steps(edited if step == "hook_gate" else gate, edited if step == "hook_pre" else up)[
                    "hook_post"
                ]
            if step != "hook_result":
                edited = self._product(edited, spec.down, spec.down_bias) * weight
            total = torch.promote_types(hidden.dtype, weights.dtype)
            if total == output.dtype:
                return output.index_add(0, token, (edited - result).to(output.dtype))
            # the module sums its experts in a wider dtype than it returns (float32 weights of a bfloat16 model):
            # every expert's result written out and summed so, the edited one in its place, then cast back
            out = torch.zeros(output.shape, dtype=total, device=output.device)
            for e in range(int(getattr(experts, spec.gate_up).shape[0])):
                s, t = torch.where(index.T == e)
                if e == self.e:
                    out.index_add_(0, t, edited.to(total))
                    continue
                h = self._post(*self._gate_up(hidden[t], e))
                out.index_add_(0, t, (self._product(h, spec.down, spec.down_bias, e) * weights[t, s, None]).to(total))
            return out.to(output.dtype)

        return [
            experts.register_forward_pre_hook(pre, with_kwargs=True),
            experts.register_forward_hook(post, with_kwargs=True),
        ]


def _call_args(args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, Tensor]:
    """``(hidden, top_k_index, top_k_weights)`` of a fused experts module's call, positional or by name."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = [*args[:3], *(kwargs[n] for n in names[len(args[:3]) :])]
    return values[0], values[1], values[2]


def routed_reference(get: Callable[[str], nn.Module], moe: MoELayout, rest: str) -> Optional[tuple[Any, bool]]:
    """``(spec of a "hooks" reference, whether the point is [b, p, ...] shown from [b * p, ...])`` of the point
    ``rest`` of a MoE whose router returns ``(logits, top_k_weights, top_k_index)`` and whose fused experts are
    called with them (``mlp.hook_expert_weights`` where the routing selects from the probabilities,
    ``mlp.hook_expert_indices``, the per-expert points where the experts have no custom GLU); ``None`` otherwise."""
    experts = moe.experts
    if not (isinstance(experts, FusedExperts) and not experts.scaled_input and moe.router_output == "routing"):
        return None
    routing = moe.routing
    if rest == "mlp.hook_router_logits":  # in half precision only (else the router's input moved: .references)
        weight = getattr(get(moe.router), "weight", None)
        half = isinstance(weight, Tensor) and weight.dtype in (torch.bfloat16, torch.float16)
        if not half or routing.order != "softmax_topk" or routing.expert_scale is not None:
            return None
        return _RoutedProbabilities(get(moe.router), routing, logits=True), True
    if rest == "mlp.hook_expert_indices":
        return _RoutedIndices(get(moe.router), routing.n_experts), True
    if rest == "mlp.hook_expert_weights":
        if routing.order != "softmax_topk" or routing.expert_scale is not None:
            return None
        return _RoutedProbabilities(get(moe.router), routing), True
    parts = rest.split(".")
    if len(parts) == 4 and parts[:2] == ["mlp", "experts"] and parts[2].isdigit() and parts[3] in _STEPS:
        e = int(parts[2])
        if e < routing.n_experts and experts.glu is None and (experts.gated or parts[3] != "hook_gate"):
            return _RoutedExpert(get(experts.module), experts, e, parts[3]), False
    return None


# --- experts in a ModuleList, the MoE module routing the router's logits itself (transformers 4.x) -------------


class _ListRoutingWeights:
    """``mlp.hook_routing_weights`` of experts in a ``ModuleList`` (:class:`~lensadapters.moe.ExpertModules`, a
    router returning its logits): the routing of the router's logits written out here (:func:`_written_route`, in
    the logits' dtype or float32 as the description says); an edit scales each expert's output rows (slot, then
    token, as the MoE module calls it) by the edited weight over the weight, which the MoE module then multiplies
    by: each expert's output times the edited weight, the selection unchanged."""

    def __init__(self, router: nn.Module, experts: nn.Module, routing: Any) -> None:
        self.modules = (router, *experts.children())
        self.routing = routing

    def install(self, edit: Edit, seen: list[Tensor]) -> list[Any]:
        routing, (router, *experts) = self.routing, self.modules
        state: dict[str, Tensor] = {}

        def on_router(module: nn.Module, args: tuple, output: Any) -> None:
            logits = output if isinstance(output, Tensor) else output[0]
            if routing.probabilities == "sigmoid":
                probs = logits.float().sigmoid()
            else:
                probs = torch.softmax(logits.float(), dim=-1)
            dtype = logits.dtype if routing.weights_dtype == "logits" else torch.float32
            bias = getattr(module, routing.selection_bias) if routing.selection_bias else None
            weights, index = _written_route(routing, probs, bias, dtype)
            seen.append(weights.detach().clone())
            state["index"], state["weights"] = index, weights
            if edit is not None:
                state["edited"] = edit(weights)

        def on_expert(e: int) -> Callable[..., Any]:
            def post(module: nn.Module, args: tuple, output: Tensor) -> Any:
                if edit is None:
                    return None
                slot, token = torch.where(state["index"].T == e)
                ratio = state["edited"][token, slot] / state["weights"][token, slot]
                return output * ratio[:, None].to(output.dtype)

            return post

        handles = [router.register_forward_hook(on_router)]
        handles += [expert.register_forward_hook(on_expert(e)) for e, expert in enumerate(experts)]
        return handles


def list_reference(get: Callable[[str], nn.Module], moe: MoELayout, rest: str) -> Optional[Any]:
    """The reference of the point ``rest`` of a MoE whose experts are a ``ModuleList`` (``ExpertModules``) routed by
    the MoE module from its router's logits: ``mlp.hook_routing_weights`` (:class:`_ListRoutingWeights`: ``("hooks",
    spec)``), an expert's ``hook_gate`` / ``hook_pre`` (``("out", module)``: its gate or up projection's output, the
    rows the MoE module calls it with) and ``hook_post`` (``("in", module)``: its down projection's input); ``None``
    for any other point."""
    from lensadapters.adapters.moe import ExpertModules

    experts = moe.experts
    if not (isinstance(experts, ExpertModules) and moe.router_output == "logits"):
        return None
    if rest == "mlp.hook_routing_weights":
        return "hooks", _ListRoutingWeights(get(moe.router), get(experts.module), moe.routing)
    parts = rest.split(".")
    if len(parts) == 4 and parts[:2] == ["mlp", "experts"] and parts[2].isdigit():
        e = int(parts[2])
        step = {"hook_gate": ("out", experts.gate), "hook_pre": ("out", experts.up), "hook_post": ("in", experts.down)}
        if e < moe.routing.n_experts and parts[3] in step:
            kind, child = step[parts[3]]
            return kind, get(f"{experts.module}.{e}.{child}")
    return None
