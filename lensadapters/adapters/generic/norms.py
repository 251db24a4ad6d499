"""How a norm module normalizes, as a probe pass shows it: LayerNorm or RMSNorm of its input with its own weight
(and bias), offset ``0`` or ``1`` (a weight of ``1 + weight``), ``eps`` read from the module (or, where it keeps
none, measured on it: :mod:`.eps`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.eps import measured_eps
from lensadapters.hooks.specs import NormSpec

Tensor = torch.Tensor


@dataclass(frozen=True)
class NormBehaviour:
    """How the final norm normalizes, as the probe saw it (``offset``: the norm's weight is ``offset + weight``)."""

    kind: str
    eps: Optional[float]
    offset: float = 0.0

    def spec(self, module: nn.Module) -> Optional[NormSpec]:
        if self.eps is None:
            return None
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        weight = weight if isinstance(weight, Tensor) else None
        bias = bias if isinstance(bias, Tensor) else None
        return NormSpec(
            self.kind,  # type: ignore[arg-type]
            self.eps,
            weight,
            bias if self.kind == "LN" else None,
            self.offset,
        )


def _eps(module: nn.Module) -> Optional[float]:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _matches(expected: Tensor, actual: Tensor, rounding: Optional[torch.dtype] = None) -> bool:
    """Whether ``expected`` is ``actual`` up to the rounding of ``rounding`` (default: ``actual``'s dtype; the
    module's output dtype where ``actual`` was widened from it)."""
    tol = 1e-4 if (rounding or actual.dtype) in (torch.float32, torch.float64) else 2e-2
    err = (expected.float() - actual.float()).norm()
    return bool(err <= tol * actual.float().norm() + 1e-12)


def _row_multiple(x: Tensor, y: Tensor, rounding: torch.dtype) -> bool:
    """Whether each row of ``y`` is a positive multiple of the row of ``x`` (a norm's output, whatever its eps), up
    to the rounding of ``rounding`` (the dtype the module's output had)."""
    factor = (x * y).sum(-1, keepdim=True) / (x * x).sum(-1, keepdim=True).clamp_min(1e-30)
    return bool((factor > 0).all()) and _matches(x * factor, y, rounding)


def norm_behaviour(module: nn.Module, x: Tensor, y: Tensor) -> Optional[NormBehaviour]:
    """LayerNorm or RMSNorm of ``x`` with ``module``'s own weight (and bias), if that is what ``y`` is."""
    if x.shape != y.shape:
        return None
    eps = _eps(module)
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    w = weight.detach().float() if isinstance(weight, Tensor) and weight.shape == x.shape[-1:] else None
    b = bias.detach().float() if isinstance(bias, Tensor) and bias.shape == x.shape[-1:] else None
    if weight is not None and w is None:
        return None
    xf = x.float()
    var, mean = torch.var_mean(xf, -1, correction=0, keepdim=True)

    def layer_norm(eps: float, offset: float = 0.0) -> bool:
        ln = (xf - mean) / torch.sqrt(var + eps)
        ln = ln * scale(offset) if w is not None else ln
        return _matches(ln + b if b is not None else ln, y)

    def rms_norm(offset: float) -> Callable[[float], bool]:
        return lambda eps: _matches(xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale(offset), y)

    def scale(offset: float) -> Any:
        return w + offset if w is not None else 1.0

    if eps is None and _row_multiple(xf - mean, (y.float() - (b if b is not None else 0.0)) / scale(0.0), y.dtype):
        found = measured_eps(module, x, w, b, layer_norm)  # measured on the module (None: no scale is served)
        if found is not None:
            return NormBehaviour("LN", found)
    for offset in (0.0, 1.0) if w is not None else (0.0,):  # a LayerNorm's weight may be 1 + weight (Nemotron's)
        if layer_norm(eps if eps is not None else 1e-5, offset):
            return NormBehaviour("LN", eps, offset)
    for offset in (0.0, 1.0) if w is not None else (0.0,):
        if eps is None:  # RMSNorm's scale needs eps exactly: measured on the module
            found = None
            if _row_multiple(xf, y.float() / scale(offset), y.dtype):
                found = measured_eps(module, x, scale(offset) if w is not None else None, None, rms_norm(offset))
            if found is not None:
                return NormBehaviour("RMS", found, offset)
        elif rms_norm(offset)(eps):
            return NormBehaviour("RMS", eps, offset)
    return None
