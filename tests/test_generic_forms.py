"""Description forms of the automatic description checked on small hand-built modules: a norm whose ``eps`` is not
an attribute (measured on the module, :mod:`lensadapters.adapters.generic.eps`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lensadapters.adapters.generic.norms import norm_behaviour


class _HardcodedLayerNorm(nn.Module):
    """OLMo's non-parametric LayerNorm: ``eps`` is a literal of its forward, not an attribute."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self._literal = (eps,)  # a tuple: nothing norm_behaviour reads as an eps attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], None, None, eps=self._literal[0])


class _HardcodedRMSNorm(nn.Module):
    """RMSNorm with a ``(1 + weight)`` scale and a literal ``eps``."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d) * 0.1)
        self._literal = (eps,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._literal[0]) * (1 + self.weight)


@pytest.mark.parametrize(
    "module, kind, eps, offset",
    [
        (_HardcodedLayerNorm(1e-5), "LN", 1e-5, 0.0),
        (_HardcodedLayerNorm(1e-12), "LN", 1e-12, 0.0),
        (_HardcodedRMSNorm(16, 1e-6), "RMS", 1e-6, 1.0),
        (_HardcodedRMSNorm(16, 3e-2), "RMS", 3e-2, 1.0),
    ],
)
def test_an_eps_the_module_does_not_keep_is_measured_on_it(module: nn.Module, kind: str, eps: float, offset: float):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    behaviour = norm_behaviour(module, x, module(x))
    assert behaviour is not None and (behaviour.kind, behaviour.eps, behaviour.offset) == (kind, eps, offset)
    spec = behaviour.spec(module)
    assert spec is not None and spec.eps == eps and spec.weight_offset == offset


@pytest.mark.parametrize(
    "eps, why",
    [(1.2345e-5, "not a round number: no exact value to serve"), (0.0, "no eps at all: nothing to measure")],
)
def test_an_eps_that_cannot_be_pinned_down_serves_no_scale(eps: float, why: str) -> None:
    """A LayerNorm is still recognised (its output is served), but no eps is claimed: the scale is not served."""
    module = _HardcodedLayerNorm(eps)
    x = torch.randn(2, 5, 16)
    behaviour = norm_behaviour(module, x, module(x))
    assert behaviour is not None and behaviour.kind == "LN" and behaviour.eps is None, why


def test_a_module_whose_eps_is_no_constant_gets_none() -> None:
    """A deliberately wrong claim caught: a LayerNorm whose "eps" grows with its input's mean square matches a
    LayerNorm with eps 1e-5 on the probe's input, but no constant eps gives its outputs on small inputs, so none is
    claimed (and its scale is not served)."""

    class Relative(_HardcodedLayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(x, x.shape[-1:], None, None, eps=1e-5 * float(x.pow(2).mean()))

    module = Relative(1e-5)
    x = torch.randn(2, 5, 16)
    behaviour = norm_behaviour(module, x, module(x))
    assert behaviour is not None and behaviour.kind == "LN" and behaviour.eps is None
