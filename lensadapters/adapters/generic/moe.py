"""The MLPs the dense description (:func:`.describe._describe_mlp`) does not cover, mixtures of experts above all.

A layer whose MLP is a mixture of experts (a ``ModuleList`` of expert MLPs, or 3-D expert parameters) keeps the rest
of its description (attention, norms, the residual points) where its router and experts are not described: its MLP
is an :class:`~lensadapters.hooks.specs.OpaqueMLP`, whose module's output is ``hook_mlp_out`` and which has no
``mlp.*`` point, with the reason kept for the warning.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lensadapters.adapters.generic.probe import Recording
from lensadapters.hooks.specs import OpaqueMLP


def is_mixture(module: nn.Module) -> bool:
    """Whether ``module`` holds experts: a ``ModuleList`` of MLPs, or 3-D expert parameters (transformers 5)."""
    return any(isinstance(m, nn.ModuleList) and len(m) > 1 for m in module.modules()) or any(
        p.dim() == 3 for p in module.parameters()
    )


def describe_other_mlp(model: nn.Module, layer: nn.Module, i: int, mlp: str, rec: Recording) -> Optional[Any]:
    """The description of an MLP the dense description refused: a mixture of experts, opaque; any other MLP is not
    described (``None``, and the layer with it)."""
    if not is_mixture(layer.get_submodule(mlp)):
        return None
    return OpaqueMLP("the MLP is a mixture of experts whose router and experts are not described")


def undescribed_mlps(layers: list[Any]) -> dict[str, list[int]]:
    """Why the described ``layers`` whose MLP is an ``OpaqueMLP`` have no ``mlp.*`` point, and which they are."""
    by_reason: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        if layer is not None and isinstance(layer.mlp, OpaqueMLP):
            by_reason.setdefault(layer.mlp.why, []).append(i)
    return by_reason
