"""A norm the attention module applies to its queries or keys *after* rotary (Llama 4's parameter-free L2 norm,
one module called on the rotated queries and then on the rotated keys), for the automatic description.

``hook_q``/``hook_k`` stay the projections' outputs; ``hook_rot_q``/``hook_rot_k`` are the rotated values, which are
the norm's input (its first or second call in a forward of the layer): the core serves them at the projection as for
any rotary model (an edit is rotated back into the projection's output, which the model rotates again and
normalizes), so an edit reaches the attention function through the norm as the model computes it. The norm has no
points of its own (TransformerLens names none after rotary).

The claim is checked on the probe: the module, called on the rotated projection (per head, ``[b, p, h, d]``, or
after the attention module's transpose), gives the tensor the attention function got; its first recorded call read
one of the two (the other is its next call). The verification then reads and edits ``hook_rot_q``/``hook_rot_k``
against a plain hook on that call's input (:mod:`.references`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.probe import Recording, _close
from lensadapters.hooks.sites.qkv import heads_view

Tensor = torch.Tensor


@dataclass(frozen=True)
class RotatedNorm:
    """The norm after rotary of a layer's queries or keys: its path relative to the layer, how it sees its input
    (``"bphd"`` or ``"bhpd"``, as :class:`~lensadapters.hooks.specs.ProjectionNorm`), and which of its calls in a
    forward of the layer reads them (``0`` or ``1``: one module shared by queries and keys)."""

    module: str
    layout: str
    call: int


#: a described model's norms after rotary: layer -> ``{"q": RotatedNorm, "k": RotatedNorm}`` (the plugin records
#: them when it identifies a model; the references of ``hook_rot_q``/``hook_rot_k`` read them)
ROTATED_NORMS: "weakref.WeakKeyDictionary[nn.Module, dict[int, dict[str, RotatedNorm]]]" = weakref.WeakKeyDictionary()


def _but(shape: torch.Size, axis: int) -> tuple[int, ...]:
    """``shape`` without its heads' axis (queries and keys may differ in heads only)."""
    return tuple(shape[:axis]) + tuple(shape[axis + 1 :])


def norm_after_rotary(
    layer: nn.Module, rec: Recording, i: int, attn: str
) -> Callable[[Tensor, Tensor], Optional[RotatedNorm]]:
    """``(rotated, want) -> RotatedNorm or None``: the module inside the attention module ``attn`` (no matrix
    parameter: not a projection) whose output for ``rotated`` (``[b, p, h, d]``) is ``want`` (the same layout): one
    that the probe saw read exactly ``rotated`` (its first call), else one whose first call read other values of the
    same layout (its second call: one module for queries and keys; the verification checks which it reads)."""
    prefix = attn + "."
    candidates = [
        (path, x)
        for (j, path), (x, y) in rec.inner.items()
        if j == i
        and path.startswith(prefix)
        and x is not None
        and y is not None
        and x.shape == y.shape
        and x.dim() == 4
        and not any(p.dim() >= 2 for p in layer.get_submodule(path).parameters())
    ]

    def find(rotated: Tensor, want: Tensor) -> Optional[RotatedNorm]:
        later: Optional[RotatedNorm] = None  # a module whose first call read other values: its next call
        for path, first in candidates:
            for layout, head_axis in (("bphd", 2), ("bhpd", 1)):
                to_heads, from_heads = heads_view(layout, rotated.shape[-2])
                seen = from_heads(rotated)
                if _but(first.shape, head_axis) != _but(seen.shape, head_axis):
                    continue  # not the layout in which the module read its first call's values
                try:
                    with torch.no_grad():
                        out = layer.get_submodule(path)(seen)
                except Exception:  # noqa: BLE001 - a module that cannot take it is not this norm
                    continue
                if not (isinstance(out, Tensor) and out.shape == seen.shape and _close(to_heads(out), want)):
                    continue
                if _close(first, seen):  # the probe saw this module read exactly these values
                    return RotatedNorm(path, layout, 0)
                later = later or RotatedNorm(path, layout, 1)
        return later

    return find
