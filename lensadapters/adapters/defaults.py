"""The core's default adapter-hook implementations (``trylast``: any plugin overrides them)."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from lensadapters.adapters.hookspecs import hookimpl
from lensadapters.adapters.vlm import text_config
from lensadapters.errors import UnsupportedModelError, WeightUnavailableError
from lensadapters.hooks import norms
from lensadapters.hooks.specs import Architecture, LinearWeight, NormSpec


def _plain_float(t: Optional[torch.Tensor]) -> bool:
    """A floating-point ``torch.Tensor`` or ``nn.Parameter`` itself, not a subclass (a quantized tensor subclass,
    torchao style, may even report a float dtype while its storage holds codes)."""
    return t is None or (type(t) in (torch.Tensor, nn.Parameter) and t.is_floating_point())


def _describe(t: torch.Tensor) -> str:
    return f"{type(t).__module__}.{type(t).__qualname__} of dtype {t.dtype}"


@hookimpl(trylast=True)
def lensadapters_linear_weight(module: nn.Module) -> Optional[LinearWeight]:
    """A plain ``nn.Linear`` with a floating-point weight; anything else stored in an ``nn.Linear`` is refused. A
    subclass of ``nn.Linear`` with plain floating-point parameters (Falcon's ``FalconLinear``) is read where its own
    forward computes ``x @ weight.T + bias`` on a probe input (checked once per module); otherwise not at all."""
    if type(module) is not nn.Linear:
        return _checked_subclass(module) if isinstance(module, nn.Linear) else None
    weight, bias = module.weight, module.bias
    for what, t in (("weight", weight), ("bias", bias)):
        if not _plain_float(t):
            raise WeightUnavailableError(
                f"lensadapters cannot read the weight of this torch.nn.Linear: its {what} is a "
                f"{_describe(t)}, not a floating-point torch.Tensor/nn.Parameter (a quantized or packed format), and "
                f"no installed plugin dequantizes it. Its values are not the matrix, so none is returned. Install "
                f"the lensadapters plugin for that format or implement `lensadapters_linear_weight` for it."
            )
    return LinearWeight(weight.T, bias)


_LINEAR_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _checked_subclass(module: nn.Linear) -> Optional[LinearWeight]:
    """A subclass of ``nn.Linear`` whose forward is the linear map of its own weight and bias (see the caller)."""
    weight, bias = module.weight, module.bias
    if not (_plain_float(weight) and _plain_float(bias)) or weight.device.type == "meta":
        return None
    verdict = _LINEAR_CHECKED.get(module)
    if verdict is None:
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
        with torch.no_grad():
            try:
                got = module.forward(x)  # the module's own computation, without the hooks on it
            except Exception:  # noqa: BLE001 - a forward that fails on a probe input is not read
                got = None
            expected = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        tol = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 2e-2
        verdict = _LINEAR_CHECKED[module] = (
            isinstance(got, torch.Tensor)
            and got.shape == expected.shape
            and bool(torch.allclose(got.float(), expected, rtol=tol, atol=tol))
        )
    return LinearWeight(weight.T, bias) if verdict else None


# norm modules whose guessed NormSpec was checked against the module (the formula is the class's, not the weights')
_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _check_guess(module: nn.Module, spec: NormSpec) -> None:
    """Run the module on a probe input and refuse the guessed spec when the module computes something else."""
    if _CHECKED.get(module):
        return
    weight = spec.weight
    width = weight.shape[-1] if weight is not None and weight.dim() else 16
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
    device = weight.device if weight is not None else torch.device("cpu")
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype) * 2
    with torch.no_grad():
        try:
            got = module.forward(x)  # the module's own computation, without the hooks on it
        except Exception as exc:  # noqa: BLE001 - any failure means the guess cannot be checked
            got = exc
        expected = norms.rms_normalized(x, norms.scale(x, spec)).float()
        if weight is not None:
            expected = norms.rms_weighted_delta(expected, spec)
    got = got[0] if isinstance(got, (tuple, list)) else got
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
    if not (
        isinstance(got, torch.Tensor)
        and got.shape == x.shape
        and torch.allclose(got.float(), expected, rtol=tol, atol=tol)
    ):
        raise UnsupportedModelError(
            f"{type(module).__name__} looks like an RMSNorm, but it does not compute x / sqrt(mean(x^2) + eps) * "
            f"weight on a probe input (a Gemma-style (1 + weight) norm, or another formula): lensadapters does not "
            f"guess how a norm normalizes. The architecture plugin must declare it: implement "
            f"lensadapters_norm_scale and return its NormSpec (weight_offset=1.0 for (1 + weight) norms)"
        )
    _CHECKED[module] = True


@hookimpl(trylast=True)
def lensadapters_norm_scale(arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
    """``nn.LayerNorm``; any other ``*RMSNorm`` is a guess that is checked on a probe input (``_check_guess``)."""
    if isinstance(module, nn.LayerNorm):
        return NormSpec("LN", module.eps, module.weight, module.bias)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if eps is not None and "rms" in type(module).__name__.lower():
        spec = NormSpec("RMS", float(eps), weight)
        _check_guess(module, spec)
        return spec
    return None


@hookimpl(trylast=True)
def lensadapters_attn_pattern(arch: Architecture, hooked: Any) -> Any:
    from lensadapters.hooks.attention import InterfacePatternBackend

    hooks = hooked.plugin_hooks

    def scores(module: nn.Module, query: Any, key: Any, scaling: Optional[float], implementation: str) -> Any:
        return hooks.lensadapters_attn_scores(
            arch=arch, module=module, query=query, key=key, scaling=scaling, implementation=implementation
        )

    def original(module: nn.Module, implementation: str) -> Any:
        return hooks.lensadapters_attn_original(arch=arch, module=module, implementation=implementation)

    # the language model's config: a vision-language model's own config would pass the routing on to its vision tower
    config = text_config(hooked.hf_model)
    return InterfacePatternBackend(config, hooked.attention_modules, scores, original)
