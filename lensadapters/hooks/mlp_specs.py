"""The MLP's description, one of the block's pieces plugins return (:mod:`lensadapters.hooks.specs` re-exports
it): :class:`MLPLayout` (its projections), :class:`FusedGateUp` (gate and up projections in one module),
:class:`OpaqueMLP` (an MLP whose inside is not described), and the chunked gate/up split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

Tensor = torch.Tensor

__all__ = ["FusedGateUp", "MLPLayout", "MLPLayouts", "OpaqueMLP", "cat_gate_up", "chunk_gate_up"]


@dataclass(frozen=True)
class MLPLayout:
    """The MLP's projections (paths relative to the block).

    ``pre`` produces ``mlp.hook_pre`` (the gate for gated MLPs), ``pre_linear`` the "up" projection of
    a gated MLP, ``out`` is the down projection whose input is ``mlp.hook_post``.

    ``pre_scale`` and ``out_scale`` are constants the MLP multiplies ``pre``'s output by before the activation and
    ``out``'s output by to give its own output (MLP multipliers: ``down(up(x) * act(gate(x) * c0)) * c1``):
    ``mlp.hook_pre`` is then the activation's input, ``gate(x) * c0`` (an edit reaches ``pre``'s output as its
    difference divided by ``c0``, which the model multiplies back), ``W_gate``/``b_gate`` include ``c0`` and
    ``W_out``/``b_out`` include ``c1`` (``hook_post @ W_out + b_out`` is the MLP's output).
    """

    pre: str
    out: str
    pre_linear: Optional[str] = None
    pre_scale: float = 1.0
    out_scale: float = 1.0

    def projection(self, role: str) -> str:
        """The path of the projection of ``role``: ``"in"`` (``W_in``: the up projection of a gated MLP, the input
        projection otherwise), ``"gate"`` (``W_gate``, gated MLPs only) or ``"out"``."""
        if role == "in":
            return self.pre_linear or self.pre
        if role == "gate":
            if self.pre_linear is None:
                raise AttributeError("W_gate exists only for gated MLPs (cfg.gated_mlp)")
            return self.pre
        return self.out


@dataclass(frozen=True)
class OpaqueMLP:
    """An MLP whose inside is not described (the block's ``BlockLayout.mlp`` is the module): the block has
    ``hook_mlp_in``/``hook_mlp_out`` and the residual points, but no ``mlp.*`` point and no MLP weight; ``why``
    says why (the error a weight accessor raises)."""

    why: str


@dataclass(frozen=True)
class FusedGateUp:
    """A gated MLP whose gate and up projections are one module (Phi-3's ``gate_up_proj``).

    ``split(t)`` takes a tensor whose last dimension is the fused output features and returns ``(gate, up)``
    (``mlp.hook_pre``, ``mlp.hook_pre_linear``); ``merge(gate, up)`` is its inverse. The same functions split
    weight columns, biases and LoRA factors, so ``W_gate``/``W_in`` and the LoRA-delta points follow the
    activations. ``out`` is the down projection whose input is ``mlp.hook_post``.
    """

    module: str
    out: str
    split: Callable[[Tensor], tuple[Tensor, Tensor]]
    merge: Callable[[Tensor, Tensor], Tensor]

    def projection(self, role: str) -> str:
        """The path of the projection of ``role``: the fused module for ``"in"`` and ``"gate"``, ``out`` for
        ``"out"``."""
        return self.out if role == "out" else self.module


MLPLayouts = MLPLayout | FusedGateUp


def chunk_gate_up(t: Tensor) -> tuple[Tensor, Tensor]:
    """``(gate, up)`` of ``[..., 2 * d_mlp]`` as ``chunk(2, dim=-1)`` splits it (gate first)."""
    gate, up = t.chunk(2, dim=-1)
    return gate, up


def cat_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """The inverse of :func:`chunk_gate_up`."""
    return torch.cat([gate, up], dim=-1)
