"""The MLPs the dense description (:func:`.describe._describe_mlp`) does not cover: mixtures of experts.

A layer whose MLP is a mixture of experts (a ``ModuleList`` of expert MLPs, or 3-D expert parameters) is described
as a :class:`~lensadapters.moe.MoELayout`, the description the core's MoE plugins declare, where the MoE module run
on the probe's MLP input shows every part of it (nothing is taken from a table of names):

* **experts**: the one module inside the MoE module with 3-D ``gate_up_proj`` ``[E, 2 * d_mlp, d]`` and
  ``down_proj`` ``[E, d, d_mlp]`` parameters (or both stored transposed) and an ``act_fn``, called with the
  flattened hidden states, the top-k expert indices and their weights; the sum over its experts of
  ``weight * down(act(gate) * up)``, with the gate and up rows one after the other or interleaved, is its output.
  Or, with no ``gate_up_proj``, a 3-D ``up_proj`` ``[E, d_mlp, d]``: experts that are not gated, the sum of
  ``weight * down(act(up))`` (``FusedExperts(gated=False)``, Nemotron-H's).
  Or (the routing weights scaling the experts' *input*, ``FusedExperts.scaled_input``) called with one tensor
  ``[E * tokens, d]``, block ``e`` the flattened MLP input times the scores the router returned for expert ``e``,
  each block of its output ``down(act(gate) * up)`` of that block by expert ``e`` (zero where the score is);
  Or (:class:`~lensadapters.moe.GroupedExperts`, with no such module) two modules holding nothing but a 3-D
  ``weight`` ``[E, out, in]``, each called with the rows of the chosen experts grouped by expert and the number of
  rows of each (``F.linear`` of each group with its expert's weight), the first ``[E, 2 * d_mlp, d]``, the second
  ``[E, d, d_mlp]``, and an activation module of the MoE module under which the MoE module's output is the weighted
  sum of ``down(act(gate) * up)``, ``gate`` the first half of the first projection's output; their router (the
  module around the linear layer computing the logits) returns ``(order, row tokens, row weights, rows per expert,
  logits)``, the routing grouped the same way (``router_output="grouped"``, its logits the linear layer's output);
  Or (:class:`~lensadapters.moe.ExpertModules`, transformers 4.x, no 3-D parameters) the one ``ModuleList`` of the
  MoE module, each expert in it three linear layers (two reading ``d``, one writing it) and a parameterless
  activation under which the expert's output on every token of the probe is ``down(act(gate(x)) * up(x))`` for one
  assignment only, each called with the rows of the tokens the routing sends it (slot, then token) and the MoE
  module's output the sum of their outputs times the routing weights; their router returns its logits alone
  (``router_output="logits"``: the MoE module routes them); a shared expert added as it is, or (transformers 4.x's
  Qwen2-MoE) times the sigmoid of a one-output child's logit, both reading the MLP input (``MoELayout.shared_gate``);
* **router**: the module inside the MoE module with a ``[E, d]`` weight, called with the MLP input alone, whose output
  is ``F.linear`` of the flattened MLP input (its own bias included): the per-expert logits. It returns them alone
  (the MoE module routes them) or with the routing the experts get (``(logits, weights, indices)``), or (experts
  with a scaled input) ``(scores, logits)``, the scores ``[tokens, E]`` the probabilities of a select-first routing
  (the routing weights at the selected experts, zeros elsewhere);
* **routing**: the :class:`~lensadapters.moe.Routing` (softmax or sigmoid, top-k before or after either, renormalized or
  not, in float32 or the logits' dtype, a constant of the config multiplying the weights, a ``[E]`` attribute of the
  router added for choosing, the experts chosen within groups, ``Routing.groups`` two integers of the config: the
  number of equal groups and how many of them are kept) under which the logits give exactly the indices, and the
  weights, the experts get;
* **shared expert**: none when the MoE module's output is its experts' output, or the one other module inside the MoE
  module, reading the MLP input (flattened or not), whose output the MoE module adds to it.

What fails leaves the MoE opaque (:class:`~lensadapters.hooks.specs.OpaqueMLP`): the layer keeps the rest of its
description (attention, norms, the residual points), its MLP module's output is ``hook_mlp_out``, and it has no
``mlp.*`` point; the warning says why. A described MoE's routing and expert points are then verified like every other
point (:mod:`.verify`): those without a plain PyTorch reference are not served.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Callable, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lensadapters.adapters.generic.probe import Recording, _close, _tolerances
from lensadapters.adapters.moe import ExpertModules, FusedExperts, GroupedExperts, MoELayout, Routing
from lensadapters.adapters.moe.routing import route, ungrouped
from lensadapters.hooks.sites.base import first_input, first_output
from lensadapters.hooks.specs import OpaqueMLP

Tensor = torch.Tensor


class _Refused(Exception):
    """The MoE cannot be described: the message says which claim failed."""


def is_mixture(module: nn.Module) -> bool:
    """Whether ``module`` holds experts: a ``ModuleList`` of MLPs (one expert too: a config may have one, as
    transformers 4.x's HunYuan-MoE default), or 3-D expert parameters (transformers 5)."""
    return any(isinstance(m, nn.ModuleList) and len(m) >= 1 for m in module.modules()) or any(
        p.dim() == 3 for p in module.parameters()
    )


def _copied(output: Any) -> Any:
    """A module's output with its tensors (or a tuple's) cloned."""
    if isinstance(output, Tensor):
        return output.clone()
    if isinstance(output, tuple):
        return tuple(t.clone() if isinstance(t, Tensor) else t for t in output)
    return output


def _run_alone(moe: nn.Module, x: Tensor) -> tuple[Any, dict[str, tuple[tuple, dict, Any]]]:
    """The MoE module's output on ``x`` in eval mode (no router jitter), and each of its submodules' first call
    ``(args, kwargs, output)``; the modules' training flags are restored."""
    calls: dict[str, tuple[tuple, dict, Any]] = {}
    handles = []
    modes = {m: m.training for m in moe.modules()}
    for name, module in moe.named_modules():
        if name:

            def hook(m: nn.Module, args: tuple, kwargs: dict, output: Any, name: str = name) -> None:
                if name not in calls:  # a copy: the MoE module may add to a child's output in place (a shared expert)
                    calls[name] = (args, kwargs, _copied(output))

            handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        moe.eval()
        with torch.no_grad():
            out = moe(x)
    finally:
        for h in handles:
            h.remove()
        for module, training in modes.items():
            module.training = training
    return out, calls


def _expert_output(experts: nn.Module, spec: FusedExperts, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
    """The experts' weighted sum as ``spec`` computes it, in float64."""
    gate_up, down = (getattr(experts, n).detach().double() for n in (spec.gate_up, spec.down))
    if spec.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    act = getattr(experts, spec.act)
    xs, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for slot in range(index.shape[-1]):
        e = index[:, slot]
        both = torch.einsum("tod,td->to", gate_up[e], xs)
        if not spec.gated:  # down(act(up)): no gate
            h = act(both.to(x.dtype)).double()
            out += weights[:, slot, None].double() * torch.einsum("tdm,tm->td", down[e], h)
            continue
        gate, up = (both[:, ::2], both[:, 1::2]) if spec.interleaved else both.chunk(2, dim=-1)
        h = act(gate.to(x.dtype)).double() * up
        out += weights[:, slot, None].double() * torch.einsum("tdm,tm->td", down[e], h)
    return out


def _scaled_expert_output(experts: nn.Module, spec: FusedExperts, routed: Tensor, n: int) -> Tensor:
    """Each block of the experts' output as ``spec`` computes it on its block of ``routed`` ``[n * tokens, d]``
    (expert ``e`` on block ``e``), in float64."""
    gate_up, down = (getattr(experts, name).detach().double() for name in (spec.gate_up, spec.down))
    if spec.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    act = getattr(experts, spec.act)
    blocks = routed.double().unflatten(0, (n, -1))
    both = torch.einsum("eod,etd->eto", gate_up, blocks)
    gate, up = (both[..., ::2], both[..., 1::2]) if spec.interleaved else both.chunk(2, dim=-1)
    h = act(gate.to(routed.dtype)).double() * up
    return torch.einsum("edm,etm->etd", down, h).flatten(0, 1)


def _close_in_half(computed: Tensor, observed: Tensor) -> bool:
    """For experts computed in half precision (bfloat16, float16): ``computed`` (float64) is ``observed`` up to that
    dtype's rounding *of the output's scale* (``1e-2`` of its largest magnitude): the model rounds the up projection,
    its activation and the down projection each to the half dtype, so an output summed from larger terms carries their
    rounding, not its own (an elementwise relative tolerance refuses every such expert)."""
    if observed.dtype not in (torch.bfloat16, torch.float16) or computed.shape != observed.shape:
        return False
    scale = float(observed.double().abs().max())
    atol = _tolerances(observed.dtype)[0] * max(scale, 1e-6)
    return bool(torch.allclose(computed.double(), observed.double(), atol=atol, rtol=0.0))


def _fused_layout(
    path: str,
    scaled_input: bool,
    compute: Callable[[FusedExperts], Tensor],
    observed: Tensor,
    why_not: str,
    gate_up: str = "gate_up_proj",
) -> FusedExperts:
    """The one :class:`FusedExperts` layout of the experts at ``path`` (transposed or not, gate/up interleaved or
    not; ``gate_up="up_proj"``: experts that are not gated, ``FusedExperts.gated``) under which ``compute`` (the
    experts' output recomputed from their parameters) gives the ``observed`` output; ``_Refused`` with ``why_not``
    where none does."""
    gated = gate_up == "gate_up_proj"
    for transposed, interleaved in itertools.product((False, True), (False, True) if gated else (False,)):
        candidate = FusedExperts(
            path, gate_up, transposed=transposed, interleaved=interleaved, scaled_input=scaled_input, gated=gated
        )
        try:
            computed = compute(candidate)
        except RuntimeError:  # the parameters' shapes do not fit this layout
            continue
        if _close(computed, observed.double()) or _close_in_half(computed, observed):
            return candidate
    raise _Refused(why_not)


def _routings(n: int, k: int, config: Any, router: nn.Module) -> list[Routing]:
    """Every routing the search tries (see the module docstring)."""
    values: dict[str, Any] = getattr(config, "to_dict", lambda: {})()
    scales = [1.0] + sorted(
        {float(v) for v in values.values() if isinstance(v, float) and not isinstance(v, bool) and v not in (0.0, 1.0)}
    )
    # the router's [E] attributes first: where one is zero on the probe, the routing still reads it live
    biases: list[Optional[str]] = [
        name
        for name, t in itertools.chain(router.named_parameters(recurse=False), router.named_buffers(recurse=False))
        if t.dim() == 1 and t.shape[0] == n and name != "bias"
    ] + [None]
    # grouped choice (Routing.groups): n_group, topk_group two integers of the config, the groups of equal size
    integers = sorted({v for v in values.values() if isinstance(v, int) and not isinstance(v, bool) and v >= 1})
    groupings: list[Optional[tuple[int, int, str]]] = [None] + [
        (g, keep, score)
        for g in integers
        if 1 < g <= n and n % g == 0
        for keep in integers
        if keep < g
        for score in ("top2_sum", "max")
        if score == "max" or n // g >= 2
    ]
    out = []
    for grouping, probabilities, order, normalize, dtype, scale, bias in itertools.product(
        groupings,
        ("softmax", "sigmoid"),
        ("softmax_topk", "topk_softmax", "topk_sigmoid"),
        (True, False),
        ("logits", "float32"),
        scales,
        biases,
    ):
        select_first = order != "softmax_topk"
        if select_first and (normalize or scale != 1.0 or bias is not None or grouping is not None):
            continue
        if select_first and probabilities != ("sigmoid" if order == "topk_sigmoid" else "softmax"):
            continue
        out.append(
            Routing(
                n,
                k,
                normalize=normalize,
                probabilities=probabilities,  # type: ignore[arg-type]
                weights_dtype=dtype,  # type: ignore[arg-type]
                order=order,  # type: ignore[arg-type]
                selection_bias=bias,
                scale=scale,
                groups=grouping[:2] if grouping is not None else None,
                group_score=grouping[2] if grouping is not None else "top2_sum",  # type: ignore[arg-type]
            )
        )
    return out


def describe_moe(model: nn.Module, layer: nn.Module, i: int, mlp: str, rec: Recording) -> MoELayout:
    """The :class:`MoELayout` of layer ``i``'s MLP ``mlp`` (see the module docstring); ``_Refused`` with why not."""
    moe = layer.get_submodule(mlp)
    x, y = rec.inner.get((i, mlp), (None, None))
    if x is None or y is None:
        raise _Refused("the probe saw no input or output of the MoE module")
    found = [
        (n, m, up)
        for n, m in moe.named_modules()
        for up in ("gate_up_proj", "up_proj")
        if n
        and all(isinstance(getattr(m, p, None), Tensor) and getattr(m, p).dim() == 3 for p in (up, "down_proj"))
        and callable(getattr(m, "act_fn", None))
        and (up == "gate_up_proj" or not isinstance(getattr(m, "gate_up_proj", None), Tensor))
    ]
    if not found and _grouped_projections(moe):
        return _describe_grouped(model, moe, mlp, x, y)
    if not found and _expert_lists(moe):
        return _describe_list(model, moe, mlp, x, y)
    if len(found) != 1:
        raise _Refused(
            "no single experts module with 3-D gate_up_proj (or up_proj) and down_proj parameters and an act_fn"
        )
    experts_path, experts, up_name = found[0]
    gated = up_name == "gate_up_proj"
    out, calls = _run_alone(moe, x)
    if not _close(first_output(out), y) or experts_path not in calls:
        raise _Refused("the MoE module run alone on its probe input does not give its output, or runs no experts")
    args, kwargs, experts_out = calls[experts_path]
    flat = x.reshape(-1, x.shape[-1])
    n = int(getattr(experts, up_name).shape[0])
    if len(args) == 1 and not kwargs and isinstance(experts_out, Tensor):
        if not gated:
            raise _Refused("experts that are not gated, called with their input scaled, are not described")
        return _describe_scaled(model, moe, mlp, experts_path, experts, calls, flat, y, n)
    if len(args) != 3 or kwargs or not isinstance(experts_out, Tensor):
        raise _Refused("the experts module is not called with (hidden states, top-k indices, top-k weights)")
    hidden, index, weights = args
    if not (_close(hidden, flat) and index.dim() == weights.dim() == 2 and not index.is_floating_point()):
        raise _Refused("the experts module is not called with the flattened MLP input, top-k indices and weights")
    k = int(index.shape[-1])
    router_path, router, r_out, logits = _router(moe, calls, flat, n, at=0)
    if isinstance(r_out, Tensor):
        router_output = "logits"
    elif (
        isinstance(r_out, tuple) and len(r_out) >= 3 and torch.equal(r_out[2], index) and torch.equal(r_out[1], weights)
    ):
        router_output = "routing"
    else:
        raise _Refused("the router returns neither its logits nor (logits, weights, indices) the experts get")
    routing = None
    for candidate in _routings(n, k, model.config, router):
        bias = getattr(router, candidate.selection_bias) if candidate.selection_bias else None
        _, w, idx = route(candidate, logits, bias)
        if torch.equal(idx, index) and w.dtype == weights.dtype and _close(w, weights):
            routing = candidate
            break
    if routing is None:
        raise _Refused(
            "no softmax or sigmoid top-k routing of the router's logits gives the experts' indices and weights"
        )
    spec = _fused_layout(
        experts_path,
        False,
        lambda candidate: _expert_output(experts, candidate, hidden, index, weights),
        experts_out,
        "the experts' output is not the weighted sum of down(act(gate) * up) of the chosen experts"
        if gated
        else "the experts' output is not the weighted sum of down(act(up)) of the chosen experts",
        gate_up=up_name,
    )
    shared = _shared(calls, (experts_path, router_path), flat, experts_out.reshape(y.shape), y)
    prefix = f"{mlp}."
    return MoELayout(
        router=prefix + router_path,
        routing=routing,
        experts=replace(spec, module=prefix + spec.module),
        router_output=router_output,  # type: ignore[arg-type]
        shared=prefix + shared if shared is not None else None,
    )


def _router(
    moe: nn.Module, calls: dict[str, tuple[tuple, dict, Any]], flat: Tensor, n: int, at: int
) -> tuple[str, nn.Module, Any, Tensor]:
    """``(path, module, output, logits)`` of the one module of the MoE called with the flattened MLP input alone whose
    output (its element ``at``, of a tuple) is ``F.linear`` of that input with its ``[n, d]`` weight (and bias)."""
    routers = []
    for name, module in moe.named_modules():
        weight = getattr(module, "weight", None)
        if name not in calls or not isinstance(weight, Tensor) or tuple(weight.shape) != (n, flat.shape[-1]):
            continue
        r_args, r_kwargs, r_out = calls[name]
        bias = getattr(module, "bias", None)
        logits = r_out[at] if at and isinstance(r_out, tuple) and len(r_out) > at else None
        logits = first_output(r_out) if at == 0 else logits
        if (
            isinstance(logits, Tensor)
            and r_args
            and isinstance(r_args[0], Tensor)
            and _close(r_args[0].reshape(flat.shape), flat)
            and _close(logits, F.linear(flat, weight, bias))
        ):
            routers.append((name, module, r_out, logits, len(r_args) + len(r_kwargs)))
    if len(routers) != 1:
        raise _Refused("no single module of the MoE maps the flattened MLP input to per-expert logits")
    router_path, router, r_out, logits, given = routers[0]
    if given != 1:  # a routing that reads what the MoE module hands it (a selection bias) is not a Routing's
        raise _Refused("the router is called with more than the MLP input")
    return router_path, router, r_out, logits


def _shared(
    calls: dict[str, tuple[tuple, dict, Any]], excluded: tuple[str, ...], flat: Tensor, routed: Tensor, y: Tensor
) -> Optional[str]:
    """The MoE module's shared expert: ``None`` when its output ``y`` is the routed experts' sum ``routed``, else the
    one other child reading the MLP input (flattened or not) whose output it adds (``_Refused`` where none does).
    Where both hold up to the dtype's rounding (a bfloat16 MoE whose output is smaller than that rounding's absolute
    tolerance), the one that misses ``y`` by less: a shared expert the module adds, not the routed sum alone."""
    missed = float((routed.double() - y.double()).abs().max()) if routed.shape == y.shape else float("inf")
    shared = None
    for name, (s_args, s_kwargs, s_out) in calls.items():
        if "." in name or name in excluded or not isinstance(s_out, Tensor):
            continue
        read = first_input(s_args, s_kwargs)  # the MLP input, flattened or not
        if not (isinstance(read, Tensor) and read.numel() == flat.numel() and s_out.numel() == y.numel()):
            continue
        both = routed + s_out.reshape(y.shape)
        if _close(read.reshape(flat.shape), flat) and _close(both, y):
            error = float((both.double() - y.double()).abs().max())
            if error < missed:
                shared, missed = name, error
    if shared is None and not _close(routed, y):
        raise _Refused("the MoE module's output is not its experts' output (plus one shared expert's output)")
    return shared


def _describe_scaled(
    model: nn.Module,
    moe: nn.Module,
    mlp: str,
    experts_path: str,
    experts: nn.Module,
    calls: dict[str, tuple[tuple, dict, Any]],
    flat: Tensor,
    y: Tensor,
    n: int,
) -> MoELayout:
    """The :class:`MoELayout` of a MoE whose routing weights scale its experts' input (``FusedExperts.scaled_input``,
    the router returning ``(scores, logits)``, ``n`` experts: see the module docstring); ``_Refused`` with why not."""
    (routed,), _, experts_out = calls[experts_path]
    if not (isinstance(routed, Tensor) and routed.shape == (n * flat.shape[0], flat.shape[-1])):
        raise _Refused("the experts module is called with one tensor that is not [experts * tokens, d_model]")
    router_path, router, r_out, logits = _router(moe, calls, flat, n, at=1)
    scores = r_out[0] if isinstance(r_out, tuple) and len(r_out) == 2 else None
    if not (isinstance(scores, Tensor) and scores.shape == logits.shape and scores.is_floating_point()):
        raise _Refused("the router of experts called with one tensor does not return (scores, logits)")
    if not _close(routed, flat.repeat(n, 1) * scores.T.reshape(-1, 1)):
        raise _Refused("the experts' input is not the MLP input times each expert's score, expert by expert")
    chosen = scores != 0
    counts = chosen.sum(-1)
    if not (counts.min() == counts.max() and int(counts.max()) >= 1):
        raise _Refused("the router's scores do not select the same number of experts for every token")
    k = int(counts.max())
    routing = None
    for candidate in _routings(n, k, model.config, router):
        if candidate.order == "softmax_topk" or candidate.selection_bias is not None:
            continue  # the scores are the probabilities of every expert: those of a routing that selects first
        probs, _, idx = route(candidate, logits)
        same = probs.dtype == scores.dtype and torch.equal(probs == 0, ~chosen) and _close(probs, scores)
        if same and torch.equal(idx, logits.topk(k, -1).indices):
            routing = candidate
            break
    if routing is None:
        raise _Refused("no top-k softmax or sigmoid of the router's logits gives the scores it returns")
    spec = _fused_layout(
        experts_path,
        True,
        lambda candidate: _scaled_expert_output(experts, candidate, routed, n),
        experts_out,
        "each expert's block of the experts' output is not down(act(gate) * up) of its block of input",
    )
    unchosen = (~chosen).T.reshape(-1)
    if experts_out[unchosen].count_nonzero():  # an expert not chosen must add nothing (no biases)
        raise _Refused("an expert not chosen adds a non-zero output (its input scaled to zero)")
    summed = experts_out.unflatten(0, (n, -1)).sum(0).reshape(y.shape)
    shared = _shared(calls, (experts_path, router_path), flat, summed, y)
    prefix = f"{mlp}."
    return MoELayout(
        router=prefix + router_path,
        routing=routing,
        experts=FusedExperts(
            prefix + spec.module, transposed=spec.transposed, interleaved=spec.interleaved, scaled_input=True
        ),
        router_output="scores_logits",
        shared=prefix + shared if shared is not None else None,
    )


def _grouped_projections(moe: nn.Module) -> list[str]:
    """The modules of the MoE holding a 3-D ``weight`` and no other parameter (experts' projections applied to rows
    grouped by expert, :class:`~lensadapters.moe.GroupedExperts`)."""
    return [
        name
        for name, m in moe.named_modules()
        if name
        and isinstance(getattr(m, "weight", None), Tensor)
        and m.weight.dim() == 3
        and [n for n, _ in m.named_parameters()] == ["weight"]
    ]


def _grouped_call(call: tuple[tuple, dict, Any], weight: Tensor) -> Optional[list[int]]:
    """The rows per expert of a call ``(args, kwargs, output)`` of a grouped projection: called with ``(rows,
    rows_per_expert)`` and returning each expert's group of rows times its weight (``F.linear``); ``None`` if not."""
    args, kwargs, out = call
    if kwargs or len(args) != 2 or not isinstance(args[0], Tensor) or not isinstance(out, Tensor):
        return None
    rows, sizes = args
    if not (isinstance(sizes, (list, tuple)) and all(isinstance(n, int) for n in sizes)):
        return None
    if len(sizes) != weight.shape[0] or sum(sizes) != rows.shape[0] or rows.dim() != 2:
        return None
    try:
        computed = torch.cat([F.linear(part, weight[e]) for e, part in enumerate(rows.split(list(sizes)))])
    except RuntimeError:  # the weight's shape does not fit the rows
        return None
    return list(sizes) if _close(computed, out) else None


def _grouped_output(
    gate_up: Tensor, down: Tensor, act: Callable[[Tensor], Tensor], flat: Tensor, index: Tensor, weights: Tensor
) -> Tensor:
    """The weighted sum of the chosen experts' ``down(act(gate) * up)``, ``gate_up`` ``[E, 2 * d_mlp, d]`` (gate rows
    then up rows) and ``down`` ``[E, d, d_mlp]``, in float64."""
    gu, dn, xs = gate_up.detach().double(), down.detach().double(), flat.double()
    out = torch.zeros(flat.shape, dtype=torch.float64, device=flat.device)
    for slot in range(index.shape[-1]):
        e = index[:, slot]
        gate, up = torch.einsum("tod,td->to", gu[e], xs).chunk(2, dim=-1)
        h = act(gate.to(flat.dtype)).double() * up
        out += weights[:, slot, None].double() * torch.einsum("tdm,tm->td", dn[e], h)
    return out


def _describe_grouped(model: nn.Module, moe: nn.Module, mlp: str, x: Tensor, y: Tensor) -> MoELayout:
    """The :class:`MoELayout` of a MoE whose experts are two projections applied to rows grouped by expert
    (:class:`~lensadapters.moe.GroupedExperts`) and whose router returns the routing grouped the same way
    (``router_output="grouped"``): every claim checked on the probe's MLP input; ``_Refused`` with why not."""
    out, calls = _run_alone(moe, x)
    if not _close(first_output(out), y):
        raise _Refused("the MoE module run alone on its probe input does not give its output")
    flat = x.reshape(-1, x.shape[-1])
    projections: list[tuple[str, Tensor, list[int]]] = []
    for name in _grouped_projections(moe):
        weight = moe.get_submodule(name).get_parameter("weight")
        sizes = _grouped_call(calls[name], weight) if name in calls else None
        if sizes is not None:
            projections.append((name, weight, sizes))
    if len(projections) != 2 or projections[0][2] != projections[1][2]:
        raise _Refused("the MoE module does not run two projections on the same rows grouped by expert")
    (up_path, gate_up, sizes), (down_path, down, _) = sorted(
        projections, key=lambda p: p[1].shape[-1] != flat.shape[-1]
    )
    n, d = int(gate_up.shape[0]), flat.shape[-1]
    d_mlp = int(down.shape[-1])
    if tuple(gate_up.shape) != (n, 2 * d_mlp, d) or tuple(down.shape) != (n, d, d_mlp):
        raise _Refused("the grouped projections are not [E, 2 * d_mlp, d_model] and [E, d_model, d_mlp]")
    logits_path, _, _, logits = _router(moe, calls, flat, n, at=0)
    routers = [
        (name, call[2])
        for name, call in calls.items()
        if logits_path.startswith(f"{name}.")
        and isinstance(call[2], tuple)
        and len(call[2]) == 5
        and len(call[0]) == 1
        and not call[1]
        and _close(call[0][0], flat)
    ]
    if len(routers) != 1:
        raise _Refused("no module around the router's linear layer returns the routing grouped by expert")
    router_path, (order, row_tokens, row_weights, rows_per_expert, router_logits) = routers[0]
    tokens = flat.shape[0]
    k = order.numel() // tokens if isinstance(order, Tensor) else 0
    grouped_form = (
        k >= 1
        and isinstance(order, Tensor)
        and not order.is_floating_point()
        and order.shape == (k * tokens,)
        and torch.equal(torch.sort(order).values, torch.arange(order.numel(), device=order.device))
        and isinstance(router_logits, Tensor)
        and _close(router_logits, logits.to(router_logits.dtype))
        and isinstance(rows_per_expert, (list, tuple))
        and list(rows_per_expert) == sizes
        and isinstance(row_tokens, Tensor)
        and torch.equal(row_tokens, order.div(k, rounding_mode="trunc"))
        and isinstance(row_weights, Tensor)
        and row_weights.shape == order.shape
    )
    if not grouped_form:
        raise _Refused("the router does not return (order, row tokens, row weights, rows per expert, logits)")
    weights, index = ungrouped(order, row_weights, list(rows_per_expert), k)
    routing = None
    for candidate in _routings(n, k, model.config, moe.get_submodule(router_path)):
        if candidate.selection_bias is not None:
            continue
        _, w, idx = route(candidate, router_logits)
        if torch.equal(idx, index) and _close(w.to(weights.dtype), weights):
            routing = candidate
            break
    if routing is None:
        raise _Refused("no softmax or sigmoid top-k routing of the router's logits gives the experts' routing")
    excluded = {router_path, logits_path, up_path, down_path}
    acts = [
        name
        for name, module in moe.named_children()
        if name not in excluded and callable(module) and not list(module.parameters())
    ]
    first = first_output(out)
    moe_out = first.reshape(flat.shape) if isinstance(first, Tensor) and first.numel() == flat.numel() else None
    routed = [
        name
        for name in acts
        if _close(_grouped_output(gate_up, down, moe.get_submodule(name), flat, index, weights), moe_out)
    ]
    if len(routed) != 1:
        raise _Refused("the MoE module's output is not the weighted sum of down(act(gate) * up) of the chosen experts")
    prefix = f"{mlp}."
    return MoELayout(
        router=prefix + router_path,
        routing=routing,
        experts=GroupedExperts(mlp, gate_up=up_path, down=down_path, act=routed[0]),
        router_output="grouped",
        router_logits=prefix + logits_path,
    )


# --- experts in a ModuleList (transformers 4.x): the MoE module routes the router's logits itself ---------------


def _expert_lists(moe: nn.Module) -> list[str]:
    """The ``ModuleList`` s of the MoE module holding one module or more (a list of expert MLPs)."""
    return [name for name, m in moe.named_modules() if name and isinstance(m, nn.ModuleList) and len(m) >= 1]


def _linear_children(expert: nn.Module) -> dict[str, nn.Module]:
    """The children of an expert with a 2-D ``weight`` (its projections)."""
    return {
        name: child
        for name, child in expert.named_children()
        if isinstance(getattr(child, "weight", None), Tensor) and _weight(child).dim() == 2
    }


def _weight(module: nn.Module) -> Tensor:
    weight: Tensor = getattr(module, "weight")  # noqa: B009 - a module's attribute, typed
    return weight


def _linear(module: nn.Module, x: Tensor) -> Tensor:
    """``F.linear`` of ``x`` with the module's weight (and bias), in float64."""
    bias = getattr(module, "bias", None)
    return F.linear(x.double(), _weight(module).detach().double(), None if bias is None else bias.detach().double())


def _expert_form(expert: nn.Module, flat: Tensor) -> Optional[tuple[str, str, str, str]]:
    """``(gate, up, down, act)``: the expert's children under which it computes ``down(act(gate(x)) * up(x))`` on
    the flattened MLP input ``flat`` (each projection's own output ``F.linear`` of its input, checked too);
    ``None`` where no single assignment does (the gate told from the up projection)."""
    linears = _linear_children(expert)
    d = flat.shape[-1]
    reading = [n for n, m in linears.items() if _weight(m).shape[-1] == d]
    downs = [n for n, m in linears.items() if _weight(m).shape[0] == d and _weight(m).shape[-1] != d]
    acts = [n for n, m in expert.named_children() if n not in linears and not list(m.parameters())]
    if len(reading) != 2 or len(downs) != 1 or not acts or len(linears) != 3:
        return None
    down = linears[downs[0]]
    with torch.no_grad():
        observed = expert(flat)
        if not isinstance(observed, Tensor) or observed.shape != flat.shape:
            return None
        outputs = {n: linears[n](flat) for n in reading}
        if not all(_close(outputs[n], _linear(linears[n], flat)) for n in reading):
            return None
        found = []
        for (gate, up), act in itertools.product(itertools.permutations(reading), acts):
            h = expert.get_submodule(act)(outputs[gate]).double() * outputs[up].double()
            if h.shape[-1] != _weight(down).shape[-1] or not _close(down(h.to(flat.dtype)), _linear(down, h)):
                continue
            if _close(_linear(down, h), observed.double()) or _close_in_half(_linear(down, h), observed):
                found.append((gate, up, downs[0], act))
    return found[0] if len(found) == 1 else None


def _describe_list(model: nn.Module, moe: nn.Module, mlp: str, x: Tensor, y: Tensor) -> MoELayout:
    """The :class:`MoELayout` of a MoE whose experts are a ``ModuleList`` of gated MLPs (``ExpertModules``) and
    whose router, a linear module, returns its logits alone (the MoE module routes them and calls each expert on the
    rows of the tokens routed to it): every claim checked on the probe's MLP input; ``_Refused`` with why not."""
    lists = _expert_lists(moe)
    if len(lists) != 1:
        raise _Refused("no single ModuleList of experts in the MoE module")
    path = lists[0]
    experts = cast(nn.ModuleList, moe.get_submodule(path))
    n = len(experts)
    out, calls = _run_alone(moe, x)
    if not _close(first_output(out), y):
        raise _Refused("the MoE module run alone on its probe input does not give its output")
    flat = x.reshape(-1, x.shape[-1])
    forms = {_expert_form(expert, flat) for expert in experts}
    if len(forms) != 1 or None in forms:
        raise _Refused("the experts in a ModuleList are not each down(act(gate(x)) * up(x)) of the same modules")
    form = next(iter(forms))
    assert form is not None
    gate, up, down, act = form
    outside = {k: v for k, v in calls.items() if not (k == path or k.startswith(f"{path}."))}
    router_path, router, r_out, logits = _router(moe, outside, flat, n, at=0)
    if not isinstance(r_out, Tensor):
        raise _Refused("the router of experts in a ModuleList does not return its logits alone")
    rows: dict[int, Tensor] = {}
    for e in range(n):
        call = calls.get(f"{path}.{e}")
        if call is None:
            continue
        args, kwargs, _ = call
        if kwargs or len(args) != 1 or not isinstance(args[0], Tensor) or args[0].shape[-1] != flat.shape[-1]:
            raise _Refused("an expert in the ModuleList is not called with rows of the MLP input alone")
        rows[e] = args[0].reshape(-1, flat.shape[-1])
    total = sum(r.shape[0] for r in rows.values())
    tokens = flat.shape[0]
    if total == 0 or total % tokens:
        raise _Refused("the experts in the ModuleList are not called on top-k rows of the tokens")
    k = total // tokens
    with torch.no_grad():
        computed = {e: _list_expert(experts[e], (gate, up, down, act), flat) for e in range(n)}
    excluded = tuple(name for name in calls if name == path or name.startswith(f"{path}.")) + (router_path,)
    routing, shared, gate_path = None, None, None
    for candidate in _routings(n, k, model.config, router):
        bias = getattr(router, candidate.selection_bias) if candidate.selection_bias else None
        _, w, idx = route(candidate, logits, bias)
        if not _same_rows(rows, idx, flat, n):
            continue
        routed = _list_output(computed, idx, w).reshape(y.shape)
        try:  # the MoE module's output: the routed sum, or it plus one shared expert's output (gated or not)
            shared = _shared(calls, excluded, flat, routed, y)
        except _Refused:
            found_gated = _gated_shared(calls, excluded, flat, routed, y)
            if found_gated is None:
                continue
            shared, gate_path = found_gated
        routing = candidate
        break
    if routing is None:
        raise _Refused(
            "no softmax or sigmoid top-k routing of the router's logits sends each expert in the ModuleList its rows "
            "and gives the MoE module's output as their weighted sum"
        )
    prefix = f"{mlp}."
    return MoELayout(
        router=prefix + router_path,
        routing=routing,
        experts=ExpertModules(prefix + path, gate=gate, up=up, down=down, act=act),
        router_output="logits",
        shared=prefix + shared if shared is not None else None,
        shared_gate=prefix + gate_path if gate_path is not None else None,
    )


def _gated_shared(
    calls: dict[str, tuple[tuple, dict, Any]], excluded: tuple[str, ...], flat: Tensor, routed: Tensor, y: Tensor
) -> Optional[tuple[str, str]]:
    """``(shared, gate)``: the one pair of other children of the MoE module, each reading the MLP input (flattened or
    not), ``gate`` of one output per token, such that the MoE module's output ``y`` is the routed sum ``routed`` plus
    ``sigmoid(gate(x)) * shared(x)`` (``MoELayout.shared_gate``); ``None`` where no single pair gives it."""
    readers = {}
    for name, (s_args, s_kwargs, s_out) in calls.items():
        read = first_input(s_args, s_kwargs)
        if "." in name or name in excluded or not isinstance(s_out, Tensor) or not isinstance(read, Tensor):
            continue
        if read.numel() == flat.numel() and _close(read.reshape(flat.shape), flat):
            readers[name] = s_out
    found = []
    for gate, g_out in readers.items():
        if g_out.numel() != flat.shape[0] or g_out.shape[-1] != 1:  # one output per token
            continue
        for shared, s_out in readers.items():
            if shared == gate or s_out.numel() != y.numel():
                continue
            gated = torch.sigmoid(g_out.double()).reshape(-1, 1) * s_out.double().reshape(-1, y.shape[-1])
            if _close(routed.double() + gated.reshape(y.shape), y):
                found.append((shared, gate))
    return found[0] if len(found) == 1 else None


def _list_expert(expert: nn.Module, form: tuple[str, str, str, str], flat: Tensor) -> Tensor:
    """``down(act(gate(x)) * up(x))`` of every row of ``flat`` written out from the expert's weights, in float64."""
    gate, up, down, act = (expert.get_submodule(name) for name in form)
    h = act(_linear(gate, flat).to(flat.dtype)).double() * _linear(up, flat)
    return _linear(down, h)


def _same_rows(rows: dict[int, Tensor], index: Tensor, flat: Tensor, n: int) -> bool:
    """Whether each expert was called with the rows of the tokens ``index`` sends it (slot, then token), an expert
    sent none not called (or called with none)."""
    for e in range(n):
        _, token = torch.where(index.T == e)  # slot, then token
        given = rows.get(e)
        if given is None:
            if token.numel():
                return False
        elif given.shape[0] != token.numel() or not torch.equal(given, flat[token]):
            return False
    return True


def _list_output(computed: dict[int, Tensor], index: Tensor, weights: Tensor) -> Tensor:
    """The weighted sum of the chosen experts' outputs (``computed``: each expert on every token), in float64."""
    out = torch.zeros_like(computed[0])
    for slot in range(index.shape[-1]):
        chosen = torch.stack([computed[int(e)][t] for t, e in enumerate(index[:, slot].tolist())])
        out += weights[:, slot, None].double() * chosen
    return out


def describe_other_mlp(
    model: nn.Module, layer: nn.Module, i: int, mlp: str, rec: Recording, normed_after: bool
) -> Optional[Any]:
    """The description of an MLP the dense description refused: a mixture of experts as a ``MoELayout``, or opaque
    with why; any other MLP is not described (``None``, and the layer with it). ``normed_after``: the block
    normalizes the MLP's output (the core's MoE points need a block that adds it to the residual as it is)."""
    if not is_mixture(layer.get_submodule(mlp)):
        return None
    if normed_after:
        return OpaqueMLP(
            "the MLP is a mixture of experts in a block that normalizes its output, where MoE points are not served"
        )
    try:
        return describe_moe(model, layer, i, mlp, rec)
    except _Refused as why:
        return OpaqueMLP(f"the MLP is a mixture of experts whose router and experts are not described: {why}")
    except Exception as exc:  # anything unexpected: the MoE is not described
        return OpaqueMLP(f"the MLP is a mixture of experts; describing it raised {type(exc).__name__}: {exc}")


def undescribed_mlps(layers: list[Any]) -> dict[str, list[int]]:
    """Why the described ``layers`` whose MLP is an ``OpaqueMLP`` have no ``mlp.*`` point, and which they are."""
    by_reason: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        if layer is not None and isinstance(layer.mlp, OpaqueMLP):
            by_reason.setdefault(layer.mlp.why, []).append(i)
    return by_reason
