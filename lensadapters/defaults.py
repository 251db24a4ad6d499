"""The core's default adapter-hook implementations (``trylast``: any plugin overrides them)."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from .hookspecs import hookimpl
from .specs import Architecture, LinearWeight, NormSpec


@hookimpl(trylast=True)
def lensadapters_linear_weight(module: nn.Module) -> Optional[LinearWeight]:
    if type(module) is nn.Linear:
        return LinearWeight(module.weight.T, module.bias)
    return None


@hookimpl(trylast=True)
def lensadapters_norm_scale(arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
    if isinstance(module, nn.LayerNorm):
        return NormSpec("LN", module.eps, module.weight, module.bias)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if eps is not None and "rms" in type(module).__name__.lower():
        return NormSpec("RMS", float(eps), weight)
    return None


@hookimpl(trylast=True)
def lensadapters_attn_pattern(arch: Architecture, hooked: Any) -> Any:
    from .attention import InterfacePatternBackend

    hooks = hooked._hooks

    def scores(module: nn.Module, query: Any, key: Any, scaling: Optional[float], implementation: str) -> Any:
        return hooks.lensadapters_attn_scores(arch=arch, module=module, query=query, key=key, scaling=scaling,
                                              implementation=implementation)

    return InterfacePatternBackend(hooked.hf_model.config, hooked.attention_modules, scores)
