"""LayerNorm and RMSNorm written out, so that the scale can be read and replaced.

Computation happens in float32 (as Hugging Face's norms do) and is cast back to the input dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from lensadapters.hooks.specs import NormSpec

Tensor = torch.Tensor


def scale(x: Tensor, spec: NormSpec) -> Tensor:
    """``sqrt(var + eps)`` (LayerNorm) or ``sqrt(mean(x^2) + eps)`` (RMSNorm), shape ``[..., 1]``."""
    xf = x.float()
    if spec.kind == "LN":
        var = torch.var_mean(xf, -1, correction=0, keepdim=True)[0]  # one fused pass, no centered copy
    else:
        var = xf.pow(2).mean(-1, keepdim=True)  # as Hugging Face's RMSNorms compute it
    return (var + spec.eps).sqrt().to(x.dtype)


def _weight(spec: NormSpec) -> Optional[Tensor]:
    if spec.weight is None:
        return None
    return spec.weight.float() + spec.weight_offset if spec.weight_offset else spec.weight.float()


def layer_norm(x: Tensor, spec: NormSpec, scale_: Tensor) -> Tensor:
    """``(x - mean) / scale * weight + bias`` with a given (possibly edited) scale."""
    xf = x.float()
    out = (xf - xf.mean(-1, keepdim=True)) / scale_.float()
    w = _weight(spec)
    if w is not None:
        out = out * w
    if spec.bias is not None:
        out = out + spec.bias.float()
    return out.to(x.dtype)


def rms_normalized(x: Tensor, scale_: Tensor) -> Tensor:
    """RMSNorm's ``x / scale`` (TransformerLens' ``hook_normalized``: before the weight)."""
    return (x.float() / scale_.float()).to(x.dtype)


def rms_weighted_delta(delta: Tensor, spec: NormSpec) -> Tensor:
    """How a change of RMSNorm's normalized value changes its output: ``weight * delta`` (float32)."""
    w = _weight(spec)
    return delta.float() if w is None else delta.float() * w


def apply_norm(x: Tensor, spec: NormSpec, bias: bool = True) -> Tensor:
    """The norm's whole output in float32, computed from ``x`` (``bias=False``: without the bias, the part that
    is linear in each component of a sum, as TransformerLens applies a folded norm to a residual stack)."""
    s = scale(x, spec).float()
    xf = x.float()
    out = (xf - xf.mean(-1, keepdim=True)) / s if spec.kind == "LN" else xf / s
    w = _weight(spec)
    if w is not None:
        out = out * w
    if bias and spec.bias is not None:
        out = out + spec.bias.float()
    return out
