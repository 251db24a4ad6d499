"""What the automatic description produces (:class:`Description`, one :class:`LayerDescription` per layer) and how
it says a claim failed (:class:`NotDescribed`); shared by the describers (:mod:`.describe`, :mod:`.describe_mlp`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lensadapters.adapters.generic.norms import NormBehaviour
from lensadapters.adapters.generic.rotated_norm import RotatedNorm
from lensadapters.hooks.specs import (
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    MLPLayout,
    SeparateQKV,
)

Tensor = torch.Tensor


QKV = Union[SeparateQKV, FusedQKV]

MLP = Union[MLPLayout, FusedGateUp]


class NotDescribed(Exception):
    """A layer (or the model) cannot be described: the message says which claim failed."""


@dataclass
class LayerDescription:
    block: BlockLayout
    qkv: QKV
    mlp: Any  # MLP, a MoELayout (:mod:`.moe`), or OpaqueMLP (its inside not described: why)
    norms: dict[str, NormBehaviour]  # path relative to the layer -> how it normalizes
    gated: bool
    act_fn: Optional[str]
    attn_out: Optional[str] = None  # the module whose output is hook_attn_out, where it is not ``block.attn``'s
    #: norms the attention module applies to the rotated queries/keys ("q"/"k"), :mod:`.rotated_norm`
    rotated_norms: dict[str, RotatedNorm] = field(default_factory=dict)
    #: the attention module changes the attention function's output before ``block.o_proj`` (an output gate, a
    #: norm): ``attn.hook_z`` is the function's output, ``attn.hook_result`` and ``W_O`` are refused (:mod:`.gated_z`)
    z_changed: bool = False
    #: a mixture of experts' shared expert described as a gated MLP (:mod:`.shared_expert`), with points of its own
    shared_expert: Optional[Any] = None


@dataclass
class Description:
    """The automatic description of a model (``layers[i]`` ``None``: layer ``i`` stays opaque, ``why[i]`` says why)."""

    layers: list[Optional[LayerDescription]]
    rotary: Optional[str] = None  # path of the rotary module outside the layers
    rotary_input: Optional[str] = None  # or the attention modules' argument carrying each layer's (cos, sin)
    #: or, with ``rotary`` the first layer's attention module, its rotary module called on its inputs
    rotary_from_inputs: Optional[Callable[..., tuple[Tensor, Tensor]]] = None
    rotary_dim: Optional[int] = None
    why: dict[int, str] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return any(layer is not None for layer in self.layers)


def _is_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) or (
        isinstance(weight, Tensor) and weight.dim() == 2 and "Linear" in type(module).__name__
    )
