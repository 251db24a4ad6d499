"""How a norm module normalizes, as a probe pass shows it: LayerNorm or RMSNorm of its input with its own weight
(and bias), offset ``0`` or ``1``, ``eps`` read from the module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lensadapters.hooks.specs import NormSpec

Tensor = torch.Tensor


@dataclass(frozen=True)
class NormBehaviour:
    """How the final norm normalizes, as the probe saw it (``offset``: RMSNorm's weight is ``offset + weight``)."""

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


def _matches(expected: Tensor, actual: Tensor) -> bool:
    tol = 1e-4 if actual.dtype in (torch.float32, torch.float64) else 2e-2
    err = (expected.float() - actual.float()).norm()
    return bool(err <= tol * actual.float().norm() + 1e-12)


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
    ln = (xf - mean) / torch.sqrt(var + (eps if eps is not None else 1e-5))
    ln = ln * w if w is not None else ln
    if _matches(ln + b if b is not None else ln, y):
        return NormBehaviour("LN", eps)
    if eps is None:  # RMSNorm's hook_normalized is computed from the scale: eps must be known exactly
        return None
    rms = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    for offset in (0.0, 1.0):
        if _matches(rms * (w + offset) if w is not None else rms, y) and (w is not None or offset == 0.0):
            return NormBehaviour("RMS", eps, offset)
    return None
