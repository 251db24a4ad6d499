"""A described mixture of experts' shared expert (``MoELayout.shared``) as a gated MLP of its own, with the points
the core's MoE plugins serve for one (Qwen 3.5's): ``mlp.shared_expert.hook_gate`` (its gate projection's output),
``hook_pre`` (the up projection's, TransformerLens' name for an expert's), ``hook_post`` (the down projection's input)
``[b, p, d_shared]`` and ``hook_result`` ``[b, p, d_model]`` (its output, what the MoE module adds to the routed
experts' sum).

The shared expert is described as a dense MLP is (:func:`.describe_mlp._describe_mlp`, on the probe's records of its
projections): a gate and an up projection of its input whose ``act(gate) * up`` is its down projection's input, and
the down projection's output its own. Where it is not such an MLP it has no point. The points are served on those
modules' inputs and outputs (the MoE module may see its tokens flattened, ``[b * p, d]``: they are shown as
``[b, p, d]``), and verified like every other described point against plain hooks on the same modules
(:mod:`.verify`). The MoE module may add the routed experts' sum into the shared expert's output in place (Llama 4's):
``hook_result`` then continues with a copy, so that what hooks saw stays what the shared expert returned.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from lensadapters.adapters.generic.describe_mlp import _activation, _describe_mlp
from lensadapters.adapters.generic.description_types import NotDescribed
from lensadapters.adapters.generic.probe import Recording, _close
from lensadapters.adapters.generic.sites import ModuleIOSite
from lensadapters.adapters.moe import MoELayout
from lensadapters.adapters.vlm import text_config
from lensadapters.hooks.sites import BlockShapeSite, FusedGateUpSite, Site
from lensadapters.hooks.specs import FusedGateUp, MLPLayout

#: the points of a shared expert, relative to ``blocks.{i}.mlp.``, in the order they fire
SHARED_EXPERT_POINTS = (
    "shared_expert.hook_gate",
    "shared_expert.hook_pre",
    "shared_expert.hook_post",
    "shared_expert.hook_result",
)


@dataclass(frozen=True)
class SharedExpert:
    """A shared expert's modules (paths relative to the block): ``module`` itself, its ``gate``, ``up`` and ``down``
    projections; ``before_router``: it runs before the router (its points are listed before the routing points);
    ``fused``: its gate and up projections are one module (``gate == up``), split by this layout."""

    module: str
    gate: Optional[str]  # None: an MLP that is not gated, down(act(up(x))), with no hook_gate
    up: str
    down: str
    before_router: bool
    fused: Optional[FusedGateUp] = None


#: the described shared experts, by model and layer (recorded when the generic adapter identifies a model)
SHARED_EXPERTS: "weakref.WeakKeyDictionary[nn.Module, dict[int, SharedExpert]]" = weakref.WeakKeyDictionary()


def describe_shared_expert(
    model: nn.Module, layer: nn.Module, i: int, layout: Any, rec: Recording
) -> Optional[SharedExpert]:
    """Layer ``i``'s shared expert as a gated MLP (see the module docstring), ``None`` where its MLP is not a MoE with
    a shared expert or the shared expert is not a gated MLP of separate gate and up projections."""
    if not isinstance(layout, MoELayout) or layout.shared is None:
        return None
    try:
        mlp, gated, _ = _describe_mlp(model, layer, i, layout.shared, rec)
    except NotDescribed:
        return None
    if not isinstance(mlp, MLPLayout) or mlp.pre_scale != 1.0:
        return None
    if gated and (mlp.pre_linear is None or not _gate_told_from_up(model, layer, i, layout.shared, mlp, rec)):
        return None
    order = [path for (j, path) in rec.inner if j == i]
    if layout.shared not in order or layout.router not in order:
        return None
    before = order.index(layout.shared) < order.index(layout.router)
    if not gated:  # its one projection before the activation: hook_pre, as a dense MLP's that is not gated
        return SharedExpert(layout.shared, None, mlp.pre, mlp.out, before)
    assert mlp.pre_linear is not None
    return SharedExpert(layout.shared, mlp.pre, mlp.pre_linear, mlp.out, before)


def describe_sibling_expert(
    model: nn.Module, layer: nn.Module, i: int, path: str, routed: str, rec: Recording
) -> Optional[SharedExpert]:
    """The shared MLP a layer runs beside its routed experts as its own child (``path``; ``routed``: the experts'
    module), whose output the layer adds to theirs (:mod:`.parallel`'s split of one branch before the middle and two
    after it), as a gated MLP of separate or fused gate and up projections; ``None`` where it is not one."""
    try:
        mlp, gated, _ = _describe_mlp(model, layer, i, path, rec)
    except NotDescribed:
        return None
    order = [p for (j, p) in rec.inner if j == i]
    if not gated or path not in order or routed not in order:
        return None
    before = order.index(path) < order.index(routed)
    if isinstance(mlp, FusedGateUp):
        return SharedExpert(path, mlp.module, mlp.module, mlp.out, before, fused=mlp)
    if mlp.pre_linear is None or mlp.pre_scale != 1.0 or not _gate_told_from_up(model, layer, i, path, mlp, rec):
        return None
    return SharedExpert(path, mlp.pre, mlp.pre_linear, mlp.out, before)


def shared_point_names(shared: SharedExpert) -> list[str]:
    """The shared expert's points (relative to ``blocks.{i}.``), in the order they fire: no ``hook_gate`` for one
    that is not gated."""
    return [f"mlp.{n}" for n in SHARED_EXPERT_POINTS if shared.gate is not None or n != "shared_expert.hook_gate"]


def _gate_told_from_up(model: nn.Module, layer: nn.Module, i: int, path: str, mlp: MLPLayout, rec: Recording) -> bool:
    """Whether the probe tells the gate from the up projection: with the first activation the dense description
    tries that fits, ``act(gate) * up`` misses the down projection's input by less than ``act(up) * gate`` does (in
    bfloat16, values below the rounding's absolute tolerance pass the dense description's claim either way)."""
    gate, up, post = rec.inner[(i, mlp.pre)][1], rec.inner[(i, mlp.pre_linear or "")][1], rec.inner[(i, mlp.out)][0]
    if gate is None or up is None or post is None:
        return False
    for _, act in _activation(layer.get_submodule(path), text_config(model)):
        if _close(act(gate) * up, post):
            right = (act(gate).double() * up.double() - post.double()).abs().max()
            swapped = (act(up).double() * gate.double() - post.double()).abs().max()
            return bool(right < swapped)
    return False


def shared_expert_sites(hooked: Any, i: int, block: nn.Module, shared: SharedExpert) -> list[Site]:
    """The shared expert's points of block ``i`` and their sites (the block's ``(b, p)`` recorded for them)."""
    pre = f"blocks.{i}.mlp."
    anchor = f"{pre}hook_router_logits" if shared.before_router else f"blocks.{i}.hook_mlp_out"
    if anchor not in hooked.hook_dict:  # no routing points (experts not described): before the MLP's output
        anchor = f"blocks.{i}.hook_mlp_out"
    names = [n[len("mlp.") :] for n in shared_point_names(shared)]
    points = {name: hooked.new_point(pre + name, before=anchor) for name in names}
    return shared_sites(hooked, i, block, shared, points)


def shared_sites(hooked: Any, i: int, block: nn.Module, shared: SharedExpert, points: dict[str, Any]) -> list[Site]:
    """The sites of the shared expert's ``points`` (by name relative to ``blocks.{i}.mlp.``; those absent, not
    served), the block's ``(b, p)`` recorded for them."""
    state = hooked.forward_state
    for point in points.values():
        point.token_shape = _block_shape(state, i)
    return [BlockShapeSite(i, block, list(points.values()), state), *sibling_sites(block, shared, points)]


def sibling_sites(block: nn.Module, shared: SharedExpert, points: dict[str, Any]) -> list[Site]:
    """The sites of a shared MLP's points (``points``: by name relative to ``blocks.{i}.mlp.``, created already; those
    absent, not served) on its own modules (:func:`shared_sites` adds the block's ``(b, p)`` for flattened tokens)."""
    get = block.get_submodule
    gate, up = points.get("shared_expert.hook_gate"), points.get("shared_expert.hook_pre")
    sites: list[Site] = []
    if shared.fused is not None:
        sites.append(FusedGateUpSite(get(shared.fused.module), shared.fused, gate, up))
    else:
        pairs = ((shared.gate, gate), (shared.up, up))
        sites += [ModuleIOSite(get(path), p) for path, p in pairs if p is not None and path is not None]
    post, result = points.get("shared_expert.hook_post"), points.get("shared_expert.hook_result")
    if post is not None:
        sites.append(ModuleIOSite(get(shared.down), post, output=False))
    if result is not None:
        sites.append(ModuleIOSite(get(shared.module), result, copy=True))
    return sites


def _block_shape(state: Any, i: int) -> Callable[[], Optional[tuple[int, ...]]]:
    return lambda: state.block_shape.get(i)


def shared_expert_reference(
    model: nn.Module, i: int, rest: str
) -> Optional[tuple[str, str, Optional[FusedGateUp], int]]:
    """``(kind, path, fused, part)`` of the plain reference of ``blocks.{i}.{rest}``, a shared expert's point
    (``"out"`` or ``"in"`` of the module at ``path``, relative to the block; where ``fused`` is given, part ``part``
    of its split output); ``None`` for any other point."""
    shared = SHARED_EXPERTS.get(model, {}).get(i)
    return shared_reference(shared, rest) if shared is not None else None


def shared_reference(shared: SharedExpert, rest: str) -> Optional[tuple[str, str, Optional[FusedGateUp], int]]:
    """:func:`shared_expert_reference` of the shared expert ``shared``."""
    if not rest.startswith("mlp.shared_expert."):
        return None
    if rest == "mlp.shared_expert.hook_gate" and shared.gate is None:  # an MLP that is not gated: no hook_gate
        return None
    found = {
        "mlp.shared_expert.hook_gate": ("out", shared.gate, 0),
        "mlp.shared_expert.hook_pre": ("out", shared.up, 1),
        "mlp.shared_expert.hook_post": ("in", shared.down, -1),
        "mlp.shared_expert.hook_result": ("out", shared.module, -1),
    }.get(rest)
    if found is None:
        return None
    kind, path, part = found
    if path is None:
        return None
    return kind, path, shared.fused if part >= 0 else None, part
