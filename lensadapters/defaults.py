"""The core's default adapter-hook implementations (``trylast``: any plugin overrides them)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .errors import WeightUnavailableError
from .hookspecs import hookimpl
from .specs import Architecture, LinearWeight, NormSpec


def _plain_float(t: Optional[torch.Tensor]) -> bool:
    """A floating-point ``torch.Tensor`` or ``nn.Parameter`` itself, not a subclass (a quantized tensor subclass,
    torchao style, may even report a float dtype while its storage holds codes)."""
    return t is None or (type(t) in (torch.Tensor, nn.Parameter) and t.is_floating_point())


def _describe(t: torch.Tensor) -> str:
    return f"{type(t).__module__}.{type(t).__qualname__} of dtype {t.dtype}"


@hookimpl(trylast=True)
def lensadapters_linear_weight(module: nn.Module) -> Optional[LinearWeight]:
    """A plain ``nn.Linear`` with a floating-point weight; anything else stored in an ``nn.Linear`` is refused."""
    if type(module) is not nn.Linear:
        return None
    weight, bias = module.weight, module.bias
    for what, t in (("weight", weight), ("bias", bias)):
        if not _plain_float(t):
            raise WeightUnavailableError(
                f"lensadapters cannot read the weight of this torch.nn.Linear: its {what} is a "
                f"{_describe(t)}, not a floating-point torch.Tensor/nn.Parameter (a quantized or packed format), and "
                f"no installed plugin dequantizes it. Its values are not the matrix, so none is returned. Install "
                f"the lensadapters plugin for that format or implement `lensadapters_linear_weight` for it.")
    return LinearWeight(weight.T, bias)


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

    hooks = hooked.plugin_hooks

    def scores(module: nn.Module, query: Any, key: Any, scaling: Optional[float], implementation: str) -> Any:
        return hooks.lensadapters_attn_scores(arch=arch, module=module, query=query, key=key, scaling=scaling,
                                              implementation=implementation)

    def original(module: nn.Module, implementation: str) -> Any:
        return hooks.lensadapters_attn_original(arch=arch, module=module, implementation=implementation)

    return InterfacePatternBackend(hooked.hf_model.config, hooked.attention_modules, scores, original)
