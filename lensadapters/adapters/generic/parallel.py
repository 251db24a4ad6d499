"""Layers of the mixer form (:mod:`.mixer`) with three branch children: two token mixers run in parallel before the
MLP, or one token mixer and an MLP of two modules whose outputs the layer adds. Nothing here names an architecture;
every rule is read from the probe forward pass (:mod:`.probe`).

The three branch children (direct children with matrix parameters, each run exactly once), in the order they ran,
split into the ones before the layer's middle and the ones after it: ``mid = resid_pre + (sum of the outputs before
it)`` must be *exactly* (bit for bit, in one of the orders a model adds them) what a norm child of the layer reads,
and the layer's output exactly ``mid + (sum of the outputs after it)``, as the layer computes them. Exactness is what
tells a branch the layer adds as it is from one it scales by a constant (a multiplier of the config, even a 1.0001):
a layer that scales a branch has no such split, and its branch points are not served (but see the scaled case).

* **Two before, one after** (attention and a second token mixer in parallel, both reading the pre-norm's output, then
  the MLP): ``hook_attn_out`` is the output of the one of the two that calls transformers' attention interface, the
  attention branch's contribution to the residual stream (``hook_resid_mid = hook_resid_pre + hook_attn_out +`` the
  parallel mixer's output; an edit of ``hook_attn_out`` reaches ``hook_resid_mid`` as if the attention had computed
  it, the parallel mixer's contribution unchanged), ``hook_mixer_out`` the other one's output (:func:`beside`: the
  parallel mixer's contribution, listed where it runs), ``hook_mlp_out`` the third child's output. Where neither of the
  two calls the attention interface, the layer is not served here (which one is ``hook_attn_out`` is unknown).
* **No exact sum before the middle** (``scaled``): the layer's output is exactly what a norm child reads (not the
  layer's input) plus the last child's output, but no sum of the first two children's outputs is what that norm
  reads: the layer scales them (Falcon-H1's ``attention_out_multiplier`` and ``ssm_out_multiplier`` other than 1,
  or its attention's input), or one of them is no branch (a gated norm with matrix parameters, AXK2's). Only the
  part after the middle is served: ``hook_resid_mid`` (what that norm reads), ``ln2``, ``hook_mlp_out`` and the
  MLP's points; no ``hook_attn_out`` (no module's output is known to be what the layer adds) and no ``ln1``.
* **One before, two after** (a token mixer, then an MLP of two modules, as a shared expert beside routed experts,
  that the layer adds together): ``hook_attn_out`` is the first child's output; no ``hook_mlp_out`` (no module's
  output is the MLP's contribution); ``hook_resid_mid`` and ``ln2`` as in :mod:`.mixer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lensadapters.adapters.generic.probe import Recording

Tensor = torch.Tensor


@dataclass(frozen=True)
class Split:
    """A three-branch layer's children before its middle and after it (paths relative to the layer, run order)."""

    before: tuple[str, ...]
    after: tuple[str, ...]
    scaled: bool = False  # the layer scales the branches before its middle: only the part after it is served


def _sums(x: Tensor, parts: list[Tensor]) -> list[Tensor]:
    """``x`` plus ``parts`` in each order a layer adds them: ``x + (a + b)``, ``x + (b + a)``, ``(x + a) + b``..."""
    if len(parts) == 1:
        return [x + parts[0]]
    a, b = parts
    return [x + (a + b), x + (b + a), x + a + b, x + b + a]


def _exact(candidates: list[Tensor], y: Tensor) -> bool:
    return any(c.shape == y.shape and torch.equal(c, y) for c in candidates)


def split(i: int, layer: nn.Module, rec: Recording, names: list[str]) -> Optional[Split]:
    """The :class:`Split` of layer ``i``'s three branch children ``names`` (in run order) by the module docstring's
    rule, ``None`` where there is none."""
    x, y = rec.layer_in.get(i), rec.layer_out.get(i)
    records = [rec.children.get((i, n)) for n in names]
    if len(names) != 3 or x is None or y is None or any(r is None or r.calls != 1 for r in records):
        return None
    outputs = [r.value for r in records if r is not None]
    if any(o.shape != x.value.shape or not bool(o.abs().sum() > 0) for o in outputs):
        return None
    reads = [
        a
        for name, child in layer.named_children()
        if name not in names and (a := rec.inner.get((i, name), (None, None))[0]) is not None
    ]
    for k in (2, 1):
        mids = _sums(x.value, outputs[:k])
        mid = next((m for m in mids if any(r.shape == m.shape and torch.equal(r, m) for r in reads)), None)
        if mid is not None and _exact(_sums(mid, outputs[k:]), y.value):
            return Split(tuple(names[:k]), tuple(names[k:]))
    # the two mixers' outputs scaled (a branch multiplier): the middle is what a norm child reads, if the layer's
    # output is exactly that plus the MLP's output
    mid = next((r for r in reads if r.shape == y.value.shape and _exact(_sums(r, outputs[2:]), y.value)), None)
    if mid is not None and not torch.equal(mid, x.value):
        return Split(tuple(names[:2]), tuple(names[2:]), scaled=True)
    return None


def layer_split(i: int, layer: nn.Module, rec: Recording) -> Optional[Split]:
    """The :class:`Split` of layer ``i`` where it has three branch children (direct children with matrix
    parameters), ``None`` for any other layer."""
    names = [n for n, c in layer.named_children() if any(p.dim() >= 2 for p in c.parameters())]
    if len(names) != 3:
        return None
    first = {n: k for k, e in enumerate(rec.events) for n in names if e[:3] == ("child", i, n)}
    return split(i, layer, rec, sorted(names, key=lambda n: first.get(n, -1)))


def branches(split_: Split, attention: Optional[str]) -> Optional[tuple[Optional[str], Optional[str]]]:
    """``(mixer, mlp)`` of a three-branch layer (the module docstring): ``mixer`` the child whose output is
    ``hook_attn_out``, ``mlp`` the one whose output is ``hook_mlp_out`` (``None`` where two modules make the MLP)."""
    if split_.scaled:
        return None, split_.after[0]
    if len(split_.before) == 2:
        return (attention, split_.after[0]) if attention in split_.before else None
    return split_.before[0], None


def beside(split_: Split, attention: Optional[str]) -> Optional[str]:
    """The token mixer a three-branch layer runs beside its attention module before its middle, whose output the layer
    adds as it is (``hook_mixer_out``: its contribution to ``hook_resid_mid``); ``None`` where there is none."""
    if split_.scaled or len(split_.before) != 2 or attention not in split_.before:
        return None
    return next(n for n in split_.before if n != attention)


def mid_value(x: Tensor, i: int, rec: Recording, split_: Split) -> Tensor:
    """``hook_resid_mid``'s value in the probe: the layer's input ``x`` plus the outputs before the middle, added in
    the order that gives the layer's output exactly (:func:`split` found one: in bfloat16 another order differs by
    more than the dtype's rounding of one sum); where they are scaled, the layer's output less the MLP's output."""
    if split_.scaled:
        return rec.layer_out[i].value - rec.children[(i, split_.after[0])].value
    y = rec.layer_out[i].value
    after = [rec.children[(i, n)].value for n in split_.after]
    mids = _sums(x, [rec.children[(i, n)].value for n in split_.before])
    return next((m for m in mids if _exact(_sums(m, after), y)), mids[0])
