"""The hook points of a mixture-of-experts MLP and the site that serves them.

Routing points (per MoE block; ``b`` batch, ``p`` position, ``E`` experts, ``k`` top-k):

* ``mlp.hook_router_logits`` ``[b, p, E]``: the router's logits.
* ``mlp.hook_expert_weights`` ``[b, p, E]``: the probability of every expert (TransformerLens' name and value: the
  softmax over all experts, before top-k; TransformerLens shows it flattened as ``[b*p, E]``).
* ``mlp.hook_expert_indices`` ``[b, p, k]`` (int64): the selected experts, in top-k order.
* ``mlp.hook_routing_weights`` ``[b, p, k]``: the weights the experts' outputs are multiplied by (the selected
  probabilities after the family's own renormalization), slot by slot with the indices.

An edit of any of them is routed exactly as the router's own values would be: edited logits give new
probabilities, edited probabilities a new top-k selection and renormalization, edited indices send the tokens to
other experts (each slot keeps its weight), edited weights scale the experts' outputs.

Per-expert points ``mlp.experts.{e}.hook_gate`` / ``hook_pre`` (the *up* projection, TransformerLens' naming) /
``hook_post`` (``act(gate) * up``) ``[n_e, d_mlp]`` and ``hook_result`` ``[n_e, d_model]`` (the expert's weighted
output: what it adds to ``hook_mlp_out``; for experts whose input the routing weight scales,
``FusedExperts.scaled_input``, those of the weighted input) cover the ``n_e`` rows expert ``e`` computes, ordered
by top-k slot then token (:func:`lensadapters.moe.expert_rows`); they fire for every expert, with no rows when no
token chose it.
They exist only while hooked: the layer's experts are then also computed expert by expert here, and the model's
own (fused) result is replaced only when a hook changed something.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.adapters.moe import routing as _routing
from lensadapters.adapters.moe.experts import bind, module_attribute
from lensadapters.adapters.moe.specs import FusedExperts, MoELayout
from lensadapters.errors import HookReturnError
from lensadapters.hooks.copying import detachable
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites.base import (
    Handle,
    Site,
    completes_output,
    first_input,
    first_output,
    replace_first_output,
)

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.adapters.protocol import Hooked

Tensor = torch.Tensor

ROUTING_POINTS = (
    "mlp.hook_router_logits",
    "mlp.hook_expert_weights",
    "mlp.hook_expert_indices",
    "mlp.hook_routing_weights",
)
EXPERT_POINTS = ("hook_gate", "hook_pre", "hook_post", "hook_result")


def moe_point_names(layout: MoELayout) -> list[str]:
    """The MLP points of a MoE block (relative to ``blocks.{i}.``), in the order they fire."""
    names = list(ROUTING_POINTS)
    steps = [p for p in EXPERT_POINTS if p != "hook_gate" or getattr(layout.experts, "gated", True)]
    for e in range(layout.routing.n_experts):
        names += [f"mlp.experts.{e}.{p}" for p in steps]
    return names


def is_expert_point(name: str) -> bool:
    """Whether a hook name is a per-expert point (computed only while hooked, not cached by default)."""
    return ".mlp.experts." in name or name.startswith("mlp.experts.")


class MoESite(Site):
    """Every MoE point of one block (see the module docstring).

    PyTorch hooks, each only while needed: the block's pre-hook records ``(b, p)``; the router's forward hook runs
    the routing points (and hands edited routing on, when the router returns the routing); the experts are computed
    here — at the fused experts module's output, or at the MoE module's output when the MoE module routes itself —
    while a per-expert point is hooked or an edit of the routing cannot travel through the router's output.
    """

    def __init__(
        self,
        hooked: "Hooked",
        layer: int,
        layout: MoELayout,
        points: dict[str, HookPoint],
        mlp_path: Optional[str] = None,
    ) -> None:
        """``mlp_path``: the MoE module (relative to the block) where the block has no ``BlockLayout`` naming it (a
        block whose only branch is the MoE module, described by the generic adapter's mixer form)."""
        self.hooked, self.layer, self.layout = hooked, layer, layout
        block = hooked.block_modules[layer]
        self.block = block
        mlp_path = mlp_path or hooked.block_layouts[layer].mlp
        if mlp_path is None:  # pragma: no cover - checked when the wiring is built
            raise ValueError("a MoE block needs BlockLayout.mlp")
        self.moe = block.get_submodule(mlp_path)
        self.router = block.get_submodule(layout.router)
        self.experts = block.get_submodule(layout.experts.module)
        self.shared = block.get_submodule(layout.shared) if layout.shared else None
        self.shared_gate = block.get_submodule(layout.shared_gate) if layout.shared_gate else None
        self._late: list[RemovableHandle] = []  # this forward's recording hooks of the shared expert (and gate)
        self.logits_module = block.get_submodule(layout.router_logits) if layout.router_logits else None
        self.state = hooked.forward_state
        self.logits, self.probs, self.indices, self.weights = (points[n] for n in ROUTING_POINTS)
        #: experts that are not gated (``FusedExperts.gated``) have no ``hook_gate`` point: ``None`` in its place
        self.expert_points = [
            tuple(points.get(f"mlp.experts.{e}.{p}") for p in EXPERT_POINTS) for e in range(layout.routing.n_experts)
        ]
        self.points = (
            self.logits,
            self.probs,
            self.indices,
            self.weights,
            *(p for group in self.expert_points for p in group if p is not None),
        )
        self.fused_call = isinstance(layout.experts, FusedExperts)

    def keep(self, failed: "dict[str, str] | set[str]") -> bool:
        """Serve only the points not in ``failed`` (full names; a wrap-time verification's refusals): each failed
        point is replaced by a stand-in never hooked, so the others are served as before. Whether any is left."""

        def kept(p: HookPoint) -> HookPoint:
            return p if p.name not in failed else HookPoint(p.name, lambda point: None)

        self.logits, self.probs, self.indices, self.weights = (
            kept(p) for p in (self.logits, self.probs, self.indices, self.weights)
        )
        self.expert_points = [tuple(p if p is None else kept(p) for p in group) for group in self.expert_points]
        self.points = tuple(
            p
            for p in (
                self.logits,
                self.probs,
                self.indices,
                self.weights,
                *(p for group in self.expert_points for p in group if p is not None),
            )
            if p is not None and p.name not in failed
        )
        return bool(self.points)

    # --- when to install what -------------------------------------------------------------------

    def _experts_hooked(self) -> bool:
        return any(p is not None and p.active for group in self.expert_points for p in group)

    def _routing_edited_downstream(self) -> bool:
        """Whether an edit of the routing may need the experts recomputed here: when the router returns logits, an
        edit after them (the MoE module routes the logits itself, out of reach); when it returns scores, any edit
        (the experts read the scores, which cannot carry every routing, e.g. one expert in two slots)."""
        if self.layout.router_output == "scores":
            return any(p.may_edit for p in (self.logits, self.probs, self.indices, self.weights))
        if self.layout.router_output == "scores_logits":  # scores carry any routing but one expert in two slots
            return self.indices.may_edit
        return self.layout.router_output == "logits" and any(
            p.may_edit for p in (self.probs, self.indices, self.weights)
        )

    def signature(self) -> tuple[bool, ...]:
        routing = any(p.active for p in (self.logits, self.probs, self.indices, self.weights))
        recompute = self._experts_hooked() or self._routing_edited_downstream()
        return (routing or recompute, recompute)

    def wanted(self) -> bool:
        return any(self.signature())

    def install(self) -> list[Handle]:
        active, recompute = self.signature()
        handles: list[Handle] = [
            self.block.register_forward_pre_hook(self._record_shape, with_kwargs=True),
            self.router.register_forward_hook(self._route),
        ]
        if self.logits_module is not None:  # inside the router: runs before the router's own hook
            handles.append(self.logits_module.register_forward_hook(self._logits_out))
        if recompute:
            if self.fused_call:
                handles.append(self.experts.register_forward_hook(self._experts_out, with_kwargs=True))
            else:  # completes the MoE's output: hook_mlp_out's own hook on the same module reads it after
                if self.shared is not None:  # the recording hooks are registered per forward (_record_shape)
                    handles.append(_LateHandles(self._late))
                handles.append(completes_output(self.moe, self._moe_out, with_kwargs=True))
        return handles

    # --- per forward ----------------------------------------------------------------------------

    def _values(self) -> dict[str, Any]:
        return self.state.site_values(self)

    def _record_shape(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        values = self._values()
        values.clear()
        hidden = args[0] if args else kwargs.get("hidden_states")
        values["lead"] = tuple(hidden.shape[:-1]) if isinstance(hidden, Tensor) else None
        if self.shared is not None and self.signature()[1] and not self.fused_call:
            self._hook_shared()

    def _hook_shared(self) -> None:
        """Register, for this forward, the hooks recording the shared expert's output and its gate's logit. They
        are registered here, at the block's start, so that they run after every other forward hook of those modules
        (the points served there, whose edits are what the MoE module adds), whenever those were installed."""
        self._late_done()
        self._late[:] = [detachable(self.shared.register_forward_hook(self._recorder("shared")))]
        if self.shared_gate is not None:
            self._late.append(detachable(self.shared_gate.register_forward_hook(self._recorder("shared_gate"))))

    def _late_done(self) -> None:
        for handle in self._late:
            handle.remove()
        self._late.clear()

    def _recorder(self, key: str) -> Any:
        def record(module: nn.Module, args: tuple, output: Any) -> None:
            self._values()[key] = first_output(output)

        return record

    def _selection_bias(self) -> Optional[Tensor]:
        name = self.layout.routing.selection_bias
        return None if name is None else module_attribute(self.hooked, self.router, name)

    def _expert_scale(self) -> Optional[Tensor]:
        name = self.layout.routing.expert_scale
        return None if name is None else module_attribute(self.hooked, self.router, name)

    def _apply(self, point: HookPoint, flat: Tensor) -> tuple[Tensor, bool]:
        """Run ``point``'s hooks on a ``[tokens, ...]`` value shown as ``[b, p, ...]``.

        Editing hooks get a copy: the site must know whether anything changed (an in-place edit under
        ``inference_mode`` leaves no version trace), since the model has already used, or never uses, this tensor.
        """
        lead = self._values().get("lead")
        if lead and math.prod(lead) == flat.shape[0]:
            shown, changed = point.apply(flat.reshape(*lead, flat.shape[-1]), protect=True)
            return (shown.reshape(flat.shape) if changed else flat), changed
        return point.apply(flat, protect=True)

    def _router_logits(self, module: nn.Module, args: tuple, output: Any) -> Tensor:
        """The router's logits: its first output, or (a router returning scores) its own product recomputed."""
        if self.layout.router_output == "scores_logits":
            return output[1]
        if self.layout.router_output not in ("scores", "index_weights"):
            return first_output(output)
        x = args[0]
        weight = module_attribute(self.hooked, module, "weight")
        bias = getattr(module, "bias", None)
        return F.linear(x.reshape(-1, x.shape[-1]), weight, bias)

    def _logits_out(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """The router's logits module ran (``MoELayout.router_logits``): ``hook_router_logits``, whose edit the
        router computes its probabilities and routing from."""
        logits, changed = self._apply(self.logits, output)
        self._values()["logits"] = logits
        return logits if changed else None

    def _route_probabilities(self, output: Any) -> Any:
        """A router returning ``(probabilities, top_k_weights, top_k_index)`` (edited logits are in them already):
        the probability, index and weight points; an edited routing is handed on through the router's output."""
        probs, probs_changed = self._apply(self.probs, output[0])
        weights, index = output[1], output[2]
        if probs_changed:
            logits = self._values().get("logits", output[0])
            weights, index = _routing.select(
                self.layout.routing, probs, logits, self._selection_bias(), self._expert_scale()
            )
        index, index_changed = self._apply(self.indices, index)
        if index_changed:
            self._check_indices(index)
        weights, weights_changed = self._apply(self.weights, weights)
        changed = probs_changed or index_changed or weights_changed
        self._values()["routing"] = (weights, index, changed)
        return (probs, weights, index, *output[3:]) if changed else None

    def _route_grouped(self, output: Any) -> Any:
        """A router returning its routing grouped by expert (``router_output="grouped"``; edited logits are in it
        already): the probability, index and weight points; an edited routing is handed on as the router's output
        for it, grouped by the same operations."""
        order, row_weights, rows_per_expert, logits = output[0], output[2], output[3], output[4]
        spec = self.layout.routing
        weights, index = _routing.ungrouped(order, row_weights, rows_per_expert, spec.top_k)
        probs_changed = False
        if self.probs.active:
            probs, probs_changed = self._apply(self.probs, _routing.probabilities(spec, logits))
            if probs_changed:
                weights, index = _routing.select(spec, probs, logits, self._selection_bias(), self._expert_scale())
        index, index_changed = self._apply(self.indices, index)
        if index_changed:
            self._check_indices(index)
        weights, weights_changed = self._apply(self.weights, weights)
        # the MoE module computes its experts from the router's output, edits included: nothing to recompute
        self._values()["routing"] = (weights, index, False)
        if not (probs_changed or index_changed or weights_changed):
            return None
        regrouped = _routing.grouped(weights.to(row_weights.dtype), index, spec.n_experts)
        return (*regrouped, logits, *output[5:])

    def _route(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.layout.router_output == "probabilities":
            return self._route_probabilities(output)
        if self.layout.router_output == "grouped":
            return self._route_grouped(output)
        spec = self.layout.routing
        returns_routing = self.layout.router_output == "routing"
        returns_scores = self.layout.router_output == "scores"
        returns_index = self.layout.router_output == "index_weights"
        returns_scores_logits = self.layout.router_output == "scores_logits"
        if returns_scores_logits:  # the unscaled experts' input, for experts computed here
            self._values()["router_in"] = first_input(args, {})
        need_logits = self.logits.active or self.probs.active or self.indices.active or self.weights.active
        if (returns_scores or returns_index or returns_scores_logits) and not (need_logits or self.signature()[1]):
            return None
        raw = self._router_logits(module, args, output)
        logits, changed = self._apply(self.logits, raw)
        model_routing = None
        if returns_routing and not changed:
            model_routing = (output[1], output[2])
        elif returns_scores and not changed:
            model_routing = (output[0].gather(-1, output[1]), output[1])
        elif returns_index and not changed:
            model_routing = (output[1], output[0])
        elif returns_scores_logits and not changed:  # the router's own selection: the top-k of its logits
            index = torch.topk(output[1], spec.top_k, dim=-1).indices
            model_routing = (output[0].gather(-1, index), index)
        need = changed or self.probs.active or self.indices.active or self.weights.active or self.signature()[1]
        if not need:
            return None
        probs_changed = False
        if changed or self.probs.active or model_routing is None:
            probs, probs_changed = self._apply(self.probs, _routing.probabilities(spec, logits))
            if probs_changed or model_routing is None:
                model_routing = _routing.select(spec, probs, logits, self._selection_bias(), self._expert_scale())
        weights, index = model_routing
        index, index_changed = self._apply(self.indices, index)
        if index_changed:
            self._check_indices(index)
        weights, weights_changed = self._apply(self.weights, weights)
        after_logits = probs_changed or index_changed or weights_changed
        self._values()["routing"] = (weights, index, after_logits or (changed and returns_scores))
        if returns_routing:
            if changed or after_logits:
                return (logits, weights, index, *output[3:])
            return None
        if returns_index:
            return (index, weights, *output[2:]) if changed or after_logits else None
        if returns_scores_logits:  # the scores of this routing (an expert in two slots: computed at the experts)
            if changed or after_logits:
                scores = torch.zeros_like(output[0]).scatter_(-1, index, weights.to(output[0].dtype))
                return (scores, logits, *output[2:])
            return None
        if returns_scores:  # the scores the router would return for this routing (the experts are recomputed)
            if changed or after_logits:
                scores = torch.zeros_like(output[0]).scatter_(-1, index, weights.to(output[0].dtype))
                return (scores, index, *output[2:])
            return None
        return replace_first_output(output, logits) if changed else None

    def _check_indices(self, index: Tensor) -> None:
        n = self.layout.routing.n_experts
        if index.dtype not in (torch.int64, torch.int32) or (index.numel() and (index.min() < 0 or index.max() >= n)):
            raise HookReturnError(
                f"hook on {self.indices.name!r} returned expert indices outside 0..{n - 1} (the layer has {n} "
                f"experts); return integer indices of existing experts"
            )

    def _experts_out(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """The fused experts module ran: compute its experts here with the routing the router hook handed on
        (edits included; what the module received, unless it reads scores that cannot carry an edited routing)."""
        stash = self._values().get("routing")
        if stash is None:  # pragma: no cover - the router runs before the experts
            return None
        weights, index, routing_changed = stash
        scaled = getattr(self.layout.experts, "scaled_input", False)
        hidden = self._values()["router_in"] if scaled else first_input(args, kwargs)
        out, changed = self._run(hidden.reshape(-1, hidden.shape[-1]), index, weights)
        if not (changed or (routing_changed and self.layout.router_output in ("scores", "scores_logits"))):
            return None
        value = first_output(output)
        return out.reshape(value.shape).to(value.dtype)

    def _moe_out(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """The MoE module routed and ran its experts itself: recompute them when the routing or an expert changed."""
        stash = self._values().get("routing")
        if stash is None:  # pragma: no cover - the router runs inside the MoE module
            return None
        weights, index, routing_changed = stash
        hidden = first_input(args, kwargs)
        flat = hidden.reshape(-1, hidden.shape[-1])
        out, changed = self._run(flat, index, weights)
        if not (changed or routing_changed):
            return None
        value = first_output(output)
        out = out.to(value.dtype)
        if self.shared is not None:  # the MoE module adds its shared experts' output to the routed experts' sum
            values = self._values()
            shared = values["shared"]
            self._late_done()
            if self.shared_gate is not None:  # times the sigmoid of its gate's logit, as the MoE module computes it
                shared = F.sigmoid(values["shared_gate"]) * shared
            out = out.reshape(shared.shape) + shared  # the model's own shape of the sum ([b * p, d] or [b, p, d])
        return replace_first_output(output, out.reshape(value.shape))

    def _run(self, hidden: Tensor, index: Tensor, weights: Tensor) -> tuple[Tensor, bool]:
        """Every expert on its rows, with the per-expert points; as transformers' eager loop computes it."""
        compute = bind(self.hooked, self.block, self.layout)
        scaled = getattr(self.layout.experts, "scaled_input", False)
        n_tokens = hidden.shape[0]
        # scaled input: every expert's block of rows, [n_experts * tokens, d], as the experts module returns them
        out = hidden.new_zeros((len(self.expert_points) * n_tokens, hidden.shape[-1])) if scaled else None
        # otherwise summed in the dtype of an expert's output times its weight, as transformers' eager loop sums
        # them (float32 weights of a bfloat16 model: a float32 sum, cast to the model's dtype by the caller)
        total = torch.promote_types(hidden.dtype, weights.dtype)
        out = torch.zeros_like(hidden, dtype=total) if out is None else out
        changed = False
        for e, group in enumerate(self.expert_points):
            gate_pt, pre_pt, post_pt, result_pt = group
            assert pre_pt is not None and post_pt is not None and result_pt is not None
            slot, token = _routing.expert_rows(index, e)
            rows = hidden[token]
            if scaled:  # the routing weight multiplies the expert's input
                rows = rows * weights[token, slot, None].to(rows.dtype)
            gate, up = compute.gate_up(e, rows)
            c_gate = False
            if gate_pt is not None and gate is not None:
                gate, c_gate = gate_pt.apply(gate, protect=True)
            up, c_up = pre_pt.apply(up, protect=True)
            post, c_post = post_pt.apply(compute.glu(gate, up), protect=True)
            result = compute.down(e, post)
            if not scaled:
                result = result * weights[token, slot, None]
            result, c_result = result_pt.apply(result.to(out.dtype), protect=True)
            out.index_add_(0, token + e * n_tokens if scaled else token, result.to(out.dtype))
            changed = changed or c_gate or c_up or c_post or c_result
        return out, changed


class _LateHandles:
    """Removes the recording hooks a site registers per forward (``MoESite._hook_shared``) with the site's hooks."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def build_moe_site(hooked: "Hooked", layer: int, layout: MoELayout, point: "Optional[Any]" = None) -> MoESite:
    """The site of block ``layer``'s MoE points (``point(name)`` gives the point of a name relative to the block)."""
    names = moe_point_names(layout)
    get = point or (lambda n: hooked.point(f"blocks.{layer}.{n}"))
    return MoESite(hooked, layer, layout, {n: get(n) for n in names})
