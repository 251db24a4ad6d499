"""One layer's experts, computed expert by expert from the live storage the description names.

The computation mirrors transformers' own eager expert loop (same operations in the same order), so an expert
computed here has the model's numbers; only the PyTorch ops are reused, never a stale copy of a weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from lensadapters.adapters.moe.specs import ExpertModules, FusedExperts, MoELayout
from lensadapters.errors import WeightUnavailableError

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


class ExpertsCompute:
    """Expert ``e``'s gate and up projections, activation and down projection, for one forward.

    Built inside the hook that runs the experts (``bind``), so parameters are read as the forward sees them.
    """

    def __init__(
        self,
        gate_up: Callable[[int, Tensor], tuple[Tensor, Tensor]],
        act: Callable[[Tensor], Tensor],
        down: Callable[[int, Tensor], Tensor],
    ) -> None:
        self.gate_up, self.act, self.down = gate_up, act, down


def bind(hooked: "Hooked", block: nn.Module, layout: MoELayout) -> ExpertsCompute:
    experts = layout.experts
    module = block.get_submodule(experts.module)
    if isinstance(experts, FusedExperts):
        gate_up = fused_parameter(hooked, module, experts.gate_up)
        down = fused_parameter(hooked, module, experts.down)
        act = module_attribute(hooked, module, experts.act)

        def fused_gate_up(e: int, x: Tensor) -> tuple[Tensor, Tensor]:
            gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
            return gate, up

        return ExpertsCompute(fused_gate_up, act, lambda e, h: F.linear(h, down[e]))
    assert isinstance(experts, ExpertModules)

    def expert(e: int) -> nn.Module:
        return module[e]

    def modules_gate_up(e: int, x: Tensor) -> tuple[Tensor, Tensor]:
        mod = expert(e)
        return mod.get_submodule(experts.gate)(x), mod.get_submodule(experts.up)(x)

    return ExpertsCompute(
        modules_gate_up, getattr(expert(0), experts.act), lambda e, h: expert(e).get_submodule(experts.down)(h)
    )


# --- weights in TransformerLens shapes -------------------------------------------------------------------------


def expert_weights(hooked: "Hooked", layer: int, role: str) -> Tensor:
    """``role`` ``in`` (the up projection), ``gate`` or ``out`` of every expert of one layer, from the live
    parameters: ``[n_experts, d_model, d_mlp]`` (``out``: ``[n_experts, d_mlp, d_model]``)."""
    layout = hooked.mlp_layouts[layer]
    assert isinstance(layout, MoELayout)
    experts = layout.experts
    module = hooked.block_modules[layer].get_submodule(experts.module)
    if isinstance(experts, FusedExperts):
        if role == "out":
            return fused_parameter(hooked, module, experts.down).transpose(-2, -1)
        gate, up = fused_parameter(hooked, module, experts.gate_up).chunk(2, dim=-2)
        return (gate if role == "gate" else up).transpose(-2, -1)
    path = {"in": experts.up, "gate": experts.gate, "out": experts.down}[role]
    return torch.stack([hooked.read_linear(module[e].get_submodule(path)).W for e in range(layout.routing.n_experts)])


def router_weight(hooked: "Hooked", layer: int) -> Tensor:
    """The router matrix of one layer, ``[d_model, n_experts]`` (logits = x @ W), from the live parameters."""
    layout = hooked.mlp_layouts[layer]
    assert isinstance(layout, MoELayout)
    router = hooked.block_modules[layer].get_submodule(layout.router)
    try:
        return hooked.read_linear(router).W
    except WeightUnavailableError:
        if isinstance(router, nn.Linear):
            raise
    return fused_parameter(hooked, router, "weight").T
