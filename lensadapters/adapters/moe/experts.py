"""One layer's experts, computed expert by expert from the live storage the description names.

The computation mirrors transformers' own eager expert loop (same operations in the same order), so an expert
computed here has the model's numbers; only the PyTorch ops are reused, never a stale copy of a weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lensadapters.adapters.moe.specs import ExpertModules, FusedExperts, GroupedExperts, MoELayout
from lensadapters.errors import WeightUnavailableError
from lensadapters.hooks.specs import LinearWeight

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.adapters.protocol import Hooked

Tensor = torch.Tensor


def module_attribute(hooked: "Hooked", module: nn.Module, name: str) -> Any:
    """The attribute ``name`` of ``module`` as its forward computes with it: a plugin that wraps the module (PEFT's
    LoRA on a parameter) answers for it, deltas included; otherwise the module's own attribute."""
    value = hooked.plugin_hooks.lensadapters_module_attribute(module=module, name=name)
    if value is not None:
        return value
    try:
        return getattr(module, name)
    except AttributeError:
        raise WeightUnavailableError(
            f"{hooked.module_name(module)} ({type(module).__module__}.{type(module).__qualname__}) has no attribute "
            f"{name!r}: it wraps the experts module and no installed plugin opens that wrapper (a PEFT adapter on the "
            f"expert parameters needs `pip install lensadapters[peft]`)"
        ) from None


def fused_parameter(hooked: "Hooked", module: nn.Module, name: str) -> Tensor:
    """A fused experts parameter (``[n_experts, out, in]``), refused when it is not a floating-point matrix."""
    value = module_attribute(hooked, module, name)
    if not (type(value) in (torch.Tensor, nn.Parameter) and value.is_floating_point()):
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        dtype = f" of dtype {value.dtype}" if isinstance(value, torch.Tensor) else ""
        raise WeightUnavailableError(
            f"{hooked.module_name(module)}.{name} is a {kind}{dtype}, not a floating-point tensor (a quantized or "
            f"packed expert format): lensadapters computes per-expert hook points and expert weights only from "
            f"floating-point expert parameters. Routing hook points work on this model."
        )
    return value


def unwrapped(hooked: "Hooked", module: nn.Module) -> nn.Module:
    """``module`` under the wrappers plugins put around it (a PEFT adapter on the expert parameters), as the
    plugins peel them: the module whose own attributes (a GLU's constants) the forward reads."""
    peel = hooked.plugin_hooks.lensadapters_wrapped_layer
    seen = {id(module)}
    while (inner := peel(module=module)) is not None and id(inner) not in seen:
        module = inner
        seen.add(id(module))
    return module


class ExpertsCompute:
    """Expert ``e``'s gate and up projections, what its GLU makes of them, and its down projection, for one forward.

    Built inside the hook that runs the experts (``bind``), so parameters are read as the forward sees them.
    """

    def __init__(
        self,
        gate_up: Callable[[int, Tensor], tuple[Optional[Tensor], Tensor]],
        glu: Callable[[Optional[Tensor], Tensor], Tensor],
        down: Callable[[int, Tensor], Tensor],
    ) -> None:
        self.gate_up, self.glu, self.down = gate_up, glu, down


def split_gate_up(experts: FusedExperts, t: Tensor) -> tuple[Optional[Tensor], Tensor]:
    """``(gate, up)`` of fused gate/up features (the last dimension): interleaved or gate half then up half; ``(None,
    t)`` for experts that are not gated (``FusedExperts.gated``)."""
    if not experts.gated:
        return None, t
    if experts.interleaved:
        return t[..., ::2], t[..., 1::2]
    gate, up = t.chunk(2, dim=-1)
    return gate, up


def _fused_product(x: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool) -> Tensor:
    """One expert's product as transformers' eager experts compute it: ``x @ W (+ b)`` for transposed storage,
    ``F.linear`` otherwise."""
    if transposed:
        out = x @ weight
        return out + bias if bias is not None else out
    return F.linear(x, weight, bias)


def bind(hooked: "Hooked", block: nn.Module, layout: MoELayout) -> ExpertsCompute:
    experts = layout.experts
    module = block.get_submodule(experts.module)
    if isinstance(experts, FusedExperts):
        spec = experts
        gate_up = fused_parameter(hooked, module, spec.gate_up)
        down = fused_parameter(hooked, module, spec.down)
        gate_up_b = fused_parameter(hooked, module, spec.gate_up_bias) if spec.gate_up_bias else None
        down_b = fused_parameter(hooked, module, spec.down_bias) if spec.down_bias else None
        if spec.glu is not None:
            custom = spec.glu
            own = unwrapped(hooked, module)

            def glu(gate: Optional[Tensor], up: Tensor) -> Tensor:
                return custom(own, gate, up)  # type: ignore[arg-type]

        elif not spec.gated:  # an activation of the up projection alone
            act = module_attribute(hooked, module, spec.act)

            def glu(gate: Optional[Tensor], up: Tensor) -> Tensor:
                return act(up)

        else:
            act = module_attribute(hooked, module, spec.act)

            def glu(gate: Optional[Tensor], up: Tensor) -> Tensor:
                return act(gate) * up

        def fused_gate_up(e: int, x: Tensor) -> tuple[Optional[Tensor], Tensor]:
            b = gate_up_b[e] if gate_up_b is not None else None
            return split_gate_up(spec, _fused_product(x, gate_up[e], b, spec.transposed))

        def fused_down(e: int, h: Tensor) -> Tensor:
            return _fused_product(h, down[e], down_b[e] if down_b is not None else None, spec.transposed)

        return ExpertsCompute(fused_gate_up, glu, fused_down)
    if isinstance(experts, GroupedExperts):
        return _bind_grouped(hooked, module, experts)
    assert isinstance(experts, ExpertModules)

    def expert(e: int) -> nn.Module:
        return module[e]

    def modules_gate_up(e: int, x: Tensor) -> tuple[Tensor, Tensor]:
        mod = expert(e)
        return mod.get_submodule(experts.gate)(x), mod.get_submodule(experts.up)(x)

    act = getattr(expert(0), experts.act)
    return ExpertsCompute(
        modules_gate_up, lambda gate, up: act(gate) * up, lambda e, h: expert(e).get_submodule(experts.down)(h)
    )


def _grouped_weights(hooked: "Hooked", module: nn.Module, spec: GroupedExperts) -> tuple[Tensor, Tensor]:
    """The ``[n_experts, out, in]`` weights of grouped experts' two projections (``gate_up``, ``down``)."""
    return tuple(  # type: ignore[return-value]
        fused_parameter(hooked, module.get_submodule(path), spec.weight) for path in (spec.gate_up, spec.down)
    )


def _bind_grouped(hooked: "Hooked", module: nn.Module, spec: GroupedExperts) -> ExpertsCompute:
    """Grouped experts (:class:`GroupedExperts`) expert by expert: ``F.linear`` of each projection's weight of the
    expert, the gate half then the up half of the first, as the MoE module computes its groups of rows."""
    gate_up, down = _grouped_weights(hooked, module, spec)
    act = module_attribute(hooked, unwrapped(hooked, module), spec.act)

    def grouped_gate_up(e: int, x: Tensor) -> tuple[Optional[Tensor], Tensor]:
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        return gate, up

    return ExpertsCompute(grouped_gate_up, lambda gate, up: act(gate) * up, lambda e, h: F.linear(h, down[e]))


# --- weights in TransformerLens shapes -------------------------------------------------------------------------


def moe_layout(hooked: "Hooked", layer: int) -> Optional[MoELayout]:
    """Layer ``layer``'s :class:`MoELayout`: its MLP description, or the one a plugin serving the block itself
    recorded (``hooked.own_mlp_layouts``); ``None`` for a layer that is no described mixture of experts."""
    layout = hooked.mlp_layouts[layer]
    if layout is None:
        layout = getattr(hooked, "own_mlp_layouts", {}).get(layer)
    return layout if isinstance(layout, MoELayout) else None


def _moe_layout(hooked: "Hooked", layer: int) -> MoELayout:
    layout = moe_layout(hooked, layer)
    if layout is None:
        raise WeightUnavailableError(f"layer {layer} has no described mixture of experts: no expert weights")
    return layout


def expert_weights(hooked: "Hooked", layer: int, role: str) -> Tensor:
    """``role`` ``in`` (the up projection), ``gate`` or ``out`` of every expert of one layer, from the live
    parameters: ``[n_experts, d_model, d_mlp]`` (``out``: ``[n_experts, d_mlp, d_model]``)."""
    return expert_weights_and_biases(hooked, layer, role)[0]


def expert_weights_and_biases(hooked: "Hooked", layer: int, role: str) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`expert_weights` and the matching biases ``[n_experts, d_out]`` (``None`` for experts without)."""
    layout = _moe_layout(hooked, layer)
    experts = layout.experts
    module = hooked.block_modules[layer].get_submodule(experts.module)
    if isinstance(experts, FusedExperts):
        bias_name = experts.down_bias if role == "out" else experts.gate_up_bias
        bias = fused_parameter(hooked, module, bias_name) if bias_name else None
        W = fused_parameter(hooked, module, experts.down if role == "out" else experts.gate_up)
        W = W if experts.transposed else W.transpose(-2, -1)  # [E, in, out]
        if role == "out":
            return W, bias
        if role == "gate" and not experts.gated:
            raise WeightUnavailableError(
                f"blocks.{layer}: the experts are not gated MLPs (each computes down(act(up x))): they have no gate "
                f"weight; W_in is their up projection"
            )
        gate, up = split_gate_up(experts, W)
        b_gate, b_up = split_gate_up(experts, bias) if bias is not None else (None, None)
        return (gate, b_gate) if role == "gate" else (up, b_up)  # type: ignore[return-value]
    if isinstance(experts, GroupedExperts):  # no biases; [E, out, in] as F.linear applies them
        gate_up_w, down_w = _grouped_weights(hooked, module, experts)
        if role == "out":
            return down_w.transpose(-2, -1), None
        gate, up = gate_up_w.transpose(-2, -1).chunk(2, dim=-1)
        return (gate if role == "gate" else up), None
    path = {"in": experts.up, "gate": experts.gate, "out": experts.down}[role]
    linears = [hooked.read_linear(module[e].get_submodule(path)) for e in range(layout.routing.n_experts)]
    biases = [lw.b for lw in linears]
    given = [b for b in biases if b is not None]
    stacked = torch.stack(given) if len(given) == len(biases) else None
    return torch.stack([lw.W for lw in linears]), stacked


def _router(hooked: "Hooked", layer: int) -> tuple[nn.Module, Optional[LinearWeight]]:
    """One layer's router and its weight read as a linear layer's (``None``: a module holding router parameters)."""
    layout = _moe_layout(hooked, layer)
    router = hooked.block_modules[layer].get_submodule(layout.router_logits or layout.router)
    try:
        return router, hooked.read_linear(router)
    except WeightUnavailableError:
        if isinstance(router, nn.Linear):
            raise
    return router, None


def router_bias(hooked: "Hooked", layer: int) -> Optional[Tensor]:
    """The router's bias of one layer, ``[n_experts]`` (logits = x @ W + b), from the live parameters; ``None`` for
    a router without one."""
    router, read = _router(hooked, layer)
    if read is not None:
        return read.b
    try:
        bias = module_attribute(hooked, router, "bias")
    except WeightUnavailableError:
        return None
    return None if bias is None else fused_parameter(hooked, router, "bias")


def router_weight(hooked: "Hooked", layer: int) -> Tensor:
    """The router matrix of one layer, ``[d_model, n_experts]`` (logits = x @ W), from the live parameters."""
    router, read = _router(hooked, layer)
    return read.W if read is not None else fused_parameter(hooked, router, "weight").T
