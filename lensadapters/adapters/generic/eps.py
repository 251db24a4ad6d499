"""The ``eps`` of a norm module that does not keep it as an attribute (a non-parametric LayerNorm calling
``F.layer_norm(x, shape, None, None, eps=1e-5)``), measured on the module itself.

On an input of ``±a`` (mean ``0``, mean square ``a²``) both LayerNorm and RMSNorm give ``w · a / sqrt(a² + eps)``
(plus the bias), so ``eps = a² (1 / r² - 1)`` where ``r`` is the output over the weight, sign removed. ``a²`` is
moved towards the estimate until the two terms are of one size (the estimate is then as exact as the dtype allows);
the estimate is taken to the nearest round number (two significant digits), and that value
is kept only when the module's outputs on two designed inputs and on the probe's input are the norm's with it.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

Tensor = torch.Tensor


def _round_candidates(estimate: float) -> list[float]:
    """Numbers of two significant digits around ``estimate``, nearest first."""
    exponent = math.floor(math.log10(estimate))
    round_numbers = {float(f"{m * 10.0**e:.3g}") for e in (exponent - 1, exponent, exponent + 1) for m in range(1, 100)}
    return sorted(round_numbers, key=lambda c: abs(math.log(c / estimate)))


def measured_eps(
    module: nn.Module,
    like: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    matches: Callable[[float], bool],
) -> Optional[float]:
    """The ``eps`` with which ``matches(eps)`` (the norm's formula reproduces the probe's output) and the module's
    output on ``±a`` inputs (the dtype and device of ``like``) is ``weight · a / sqrt(a² + eps) + bias`` (``weight``
    with its offset); ``None`` where no such number is found."""
    d = like.shape[-1]
    signs = torch.ones(d, dtype=torch.float64, device=like.device)
    signs[1::2] = -1.0
    tolerance = 1e-3 if like.dtype in (torch.float32, torch.float64) else 2e-2

    def ratio(a: float) -> Optional[float]:
        """``a / sqrt(a² + eps)``: the module's output on ``±a`` (over the weight, without the bias), sign removed."""
        x = (signs * a).to(like.dtype).reshape(1, 1, d)
        try:
            with torch.no_grad():
                y = module.forward(x)
        except Exception:  # not a module that takes one hidden-state tensor
            return None
        y = y[0] if isinstance(y, tuple) else y
        if not isinstance(y, Tensor) or y.shape != x.shape:
            return None
        y = y.double().reshape(d)
        if bias is not None:
            y = y - bias.detach().double().to(y.device)
        if weight is not None:
            w = weight.detach().double().to(y.device)
            if bool((w == 0).any()):
                return None
            y = y / w
        r = float((y * signs).mean())
        if not 0 < r <= 1 or float((y * signs - r).abs().max()) > tolerance * r:  # one value, as a norm gives
            return None
        return r

    a2 = 1e-6
    for _ in range(4):
        r = ratio(math.sqrt(a2))
        if r is None:
            return None
        estimate = a2 * (1 / (r * r) - 1)
        if estimate <= 0:
            a2 /= 1e4
            continue
        if 0.1 <= estimate / a2 <= 10:
            break
        a2 = estimate
    else:
        return None
    for candidate in _round_candidates(estimate)[:4]:
        if abs(math.log(candidate / estimate)) > 0.05:
            break
        fits = True
        for size in (a2, 4 * a2):  # the designed input the estimate came from, and one of another size
            expected, got = math.sqrt(size / (size + candidate)), ratio(math.sqrt(size))
            fits = fits and got is not None and abs(got - expected) <= tolerance * expected
        if fits and matches(candidate):
            return candidate
    return None
