"""Layers of the mixer form (:mod:`.mixer`) with three branch children: two token mixers run in parallel before the
MLP, or one token mixer and an MLP of two modules whose outputs the layer adds; and layers of two branch children (a
token mixer, then the MLP) that the layer adds multiplied by constants of its config. Nothing here names an
architecture; every rule is read from the probe forward pass (:mod:`.probe`).

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
  that the layer adds together): ``hook_attn_out`` is the first child's output, ``hook_mlp_out`` the sum of the two
  MLP modules' outputs as the layer adds it (no module's output is the MLP's contribution: :class:`.mixer_sites.SumSite`
  computes it); ``hook_resid_mid`` and ``ln2`` as in :mod:`.mixer`.
* **Branches scaled by constants** (a branch multiplier: Falcon-H1's ``attention_out_multiplier`` and
  ``ssm_out_multiplier``, Granite's ``residual_multiplier``, which a layer of two branches applies to both): the sums
  above (for two branches ``mid = x + a * c0``, ``out = mid + b * c1``), each output (or the MLP modules' sum)
  multiplied by a number of the model's config first, as ``output * c`` with that Python float, *exactly* (bit for
  bit) the norm's input and the layer's output. Then each branch point is what the layer adds to the residual stream,
  the scaled output (TransformerLens' semantics: ``hook_resid_mid = hook_resid_pre + hook_attn_out +
  hook_mixer_out``), read where the layer adds it and edited there (:class:`.mixer_sites.SumSite`: the norm reads
  the middle recomputed from the edited contributions, the layer returns it plus the MLP's contribution), so an edit
  is exactly what the model computes with the edited contribution, never divided back by the constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Iterator, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.probe import Recording

Tensor = torch.Tensor


@dataclass(frozen=True)
class Split:
    """A layer's branch children before its middle and after it (paths relative to the layer, run order; one or two
    before, one or two after), and how the layer adds their outputs: ``mid = x + (b0 * c0 + b1 * c1)`` (one before:
    ``x + b0 * c0``) (``sequential``: ``x + b0 * c0 + b1 * c1``),
    ``out = mid + (a0 [+ a1]) * after_scale`` (a scale of 1.0: the output as it is, not multiplied)."""

    before: tuple[str, ...]
    after: tuple[str, ...]
    scaled: bool = False  # the layer scales the branches before its middle: only the part after it is served
    before_scales: tuple[float, ...] = ()
    after_scale: float = 1.0
    sequential: bool = False
    after_grouped: bool = True  # out = mid + (a0 + a1) * c, else (unscaled) mid + a0 + a1 in run order

    @property
    def plain(self) -> bool:
        """Every output added as it is (no constant found, or every one 1.0)."""
        return not self.scaled and all(c == 1.0 for c in self.before_scales) and self.after_scale == 1.0

    @property
    def summed(self) -> bool:
        """Whether the branch points are contributions the layer's own sums compute (:class:`.mixer_sites.SumSite`):
        an output scaled by a constant, or an MLP of two modules added as one sum."""
        return not self.scaled and self.after_grouped and (not self.plain or len(self.after) > 1)


def scale(t: Tensor, c: float) -> Tensor:
    """``t * c`` as the model computes it with the Python float ``c`` (``t`` itself for 1.0)."""
    return t if c == 1.0 else t * c


def middle(x: Tensor, contributions: list[Tensor], split_: Split) -> Tensor:
    """``x`` plus the (scaled) outputs before the middle, added as the layer adds them."""
    if len(contributions) == 1:
        return x + contributions[0]
    a, b = contributions
    return x + a + b if split_.sequential else x + (a + b)


def after_contribution(outputs: list[Tensor], split_: Split) -> Tensor:
    """What the layer adds to its middle after it: the MLP modules' outputs summed, times ``after_scale``."""
    total = outputs[0] if len(outputs) == 1 else outputs[0] + outputs[1]
    return scale(total, split_.after_scale)


def _constants(config: object) -> list[float]:
    """The candidates for a branch multiplier: 1.0 and every other finite non-zero number of the config, those of its
    short lists too (nothing is looked up by name)."""
    values: dict = getattr(config, "to_dict", lambda: {})()
    flat = [x for v in values.values() for x in (v if isinstance(v, (list, tuple)) and len(v) <= 8 else [v])]
    found = [  # a short list's numbers too (a list of multipliers, one per part)
        float(v)
        for v in flat
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0 and abs(float(v)) < float("inf")
    ]
    return list(dict.fromkeys([1.0] + found))


def _sums(x: Tensor, parts: list[Tensor]) -> list[Tensor]:
    """``x`` plus ``parts`` in each order a layer adds them: ``x + (a + b)``, ``x + (b + a)``, ``(x + a) + b``..."""
    if len(parts) == 1:
        return [x + parts[0]]
    a, b = parts
    return [x + (a + b), x + (b + a), x + a + b, x + b + a]


def _exact(candidates: list[Tensor], y: Tensor) -> bool:
    return any(c.shape == y.shape and torch.equal(c, y) for c in candidates)


def _equal(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _near(estimate: float, constants: list[float], dtype: torch.dtype) -> list[float]:
    """The constants near an estimated multiplier: within 0.1%, or 8 roundings of ``dtype`` (bfloat16: 6%); the exact
    check decides among them."""
    tolerance = max(1e-3, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-3
    return [c for c in constants if abs(c - estimate) <= tolerance * max(abs(estimate), 1e-6)]


def _by_distance(estimate: float, constants: list[float], dtype: torch.dtype) -> list[float]:
    """Every constant, the near ones (:func:`_near`) first, then the rest by their distance from the estimate: where
    one multiplier is estimated, from a difference of two values much larger than the branch (a small MLP output
    added to a bfloat16 residual), rounding can move the estimate further than :func:`_near` allows; trying them all
    costs one exact check each."""
    near = _near(estimate, constants, dtype)
    return near + sorted((c for c in constants if c not in near), key=lambda c: abs(c - estimate))


def _estimates(target: Tensor, parts: list[Tensor]) -> Optional[list[float]]:
    """The least-squares multipliers ``c`` of ``target ~ sum(c_j * parts_j)`` (in float64), ``None`` where the parts
    do not determine them."""
    a = torch.stack([p.double().flatten() for p in parts], dim=1)
    if a.shape[0] < len(parts) or not bool(torch.isfinite(a).all()):
        return None
    solution = torch.linalg.lstsq(a, target.double().flatten().unsqueeze(1)).solution
    return [float(v) for v in solution.flatten()]


def _scaled_middles(
    x: Tensor, before: list[Tensor], reads: list[Tensor], constants: list[float]
) -> Iterator[tuple[Tensor, tuple[float, ...], bool, tuple[int, ...]]]:
    """Each middle ``x + sum(o_j * c_j)`` of the outputs ``before`` times constants near their least-squares
    multipliers, added in one of the orders a layer adds them, that is exactly what a norm child reads: ``(middle,
    constants in the order added, sequential, order)``."""
    orders = ((False, (0, 1)), (True, (0, 1)), (True, (1, 0))) if len(before) == 2 else ((False, (0,)),)
    for read in (r for r in reads if r.shape == x.shape):
        estimates = _estimates(read.double() - x.double(), before)
        if estimates is None:
            continue
        pick = _near if len(estimates) > 1 else _by_distance  # (two constants: near ones only, each pair a check)
        for scales in product(*[pick(e, constants, x.dtype) for e in estimates]):
            contributions = [scale(o, c) for o, c in zip(before, scales)]
            for sequential, order in orders:
                mid = middle(x, [contributions[j] for j in order], Split((), (), sequential=sequential))
                if _equal(read, mid):
                    yield mid, tuple(scales[j] for j in order), sequential, order


def _scaled_split(
    names: list[str], x: Tensor, y: Tensor, outputs: list[Tensor], reads: list[Tensor], constants: list[float]
) -> Optional[Split]:
    """The :class:`Split` whose outputs the layer adds multiplied by constants of its config (the module docstring),
    ``None`` where none is exact. Only constants close to the least-squares multipliers are tried."""
    for k in (2, 1) if len(outputs) == 3 else (1,):
        after = outputs[k:]
        total = after[0] if len(after) == 1 else after[0] + after[1]
        for mid, scales, sequential, order in _scaled_middles(x, outputs[:k], reads, constants):
            ratio = _estimates(y.double() - mid.double(), [total])
            for c in _by_distance(ratio[0], constants, x.dtype) if ratio is not None else []:
                before = tuple(names[j] for j in order)
                found = Split(before, tuple(names[k:]), before_scales=scales, after_scale=c, sequential=sequential)
                if _equal(mid + after_contribution(after, found), y):
                    return found
    return None


def split(i: int, layer: nn.Module, rec: Recording, names: list[str], config: object = None) -> Optional[Split]:
    """The :class:`Split` of layer ``i``'s branch children ``names`` (in run order: three, or two the layer adds
    scaled) by the module docstring's rule, ``None`` where there is none. ``config``: the model's, whose numbers are
    the candidate multipliers."""
    x, y = rec.layer_in.get(i), rec.layer_out.get(i)
    records = [rec.children.get((i, n)) for n in names]
    if len(names) not in (2, 3) or x is None or y is None or any(r is None or r.calls != 1 for r in records):
        return None
    outputs = [r.value for r in records if r is not None]
    if any(o.shape != x.value.shape or not bool(o.abs().sum() > 0) for o in outputs):
        return None
    reads = [
        a
        for name, child in layer.named_children()
        if name not in names and (a := rec.inner.get((i, name), (None, None))[0]) is not None
    ]
    if len(names) == 2:
        return _two_scaled(names, x.value, y.value, outputs, reads, config)
    for k in (2, 1):
        mids = _sums(x.value, outputs[:k])
        mid = next((m for m in mids if any(r.shape == m.shape and torch.equal(r, m) for r in reads)), None)
        if mid is not None and _exact(_sums(mid, outputs[k:]), y.value):
            grouped = k == 2 or _equal(mid + (outputs[1] + outputs[2]), y.value)
            before = tuple(names[:k])
            sequential = k == 2 and not _equal(mid, x.value + (outputs[0] + outputs[1]))
            if sequential and not _equal(mid, x.value + outputs[0] + outputs[1]):
                before = (names[1], names[0])  # added in the other order
            return Split(
                before, tuple(names[k:]), before_scales=(1.0,) * k, sequential=sequential, after_grouped=grouped
            )
    found = _scaled_split(names, x.value, y.value, outputs, reads, _constants(config))
    if found is not None:
        return found
    # the two mixers' outputs scaled (a branch multiplier): the middle is what a norm child reads, if the layer's
    # output is exactly that plus the MLP's output
    mid = next((r for r in reads if r.shape == y.value.shape and _exact(_sums(r, outputs[2:]), y.value)), None)
    if mid is not None and not torch.equal(mid, x.value):
        return Split(tuple(names[:2]), tuple(names[2:]), scaled=True)
    return None


def _two_scaled(
    names: list[str], x: Tensor, y: Tensor, outputs: list[Tensor], reads: list[Tensor], config: object
) -> Optional[Split]:
    """The :class:`Split` of a layer of two branches (a token mixer, then the MLP) that it adds multiplied by
    constants of its config (``mid = x + a * c0``, what a norm child reads, ``out = mid + b * c1``: Granite's
    ``residual_multiplier``), ``None`` where the layer adds them as they are (the plain form needs no split) or by
    no constant found."""
    if _exact(_sums(x, outputs), y):
        return None
    found = _scaled_split(names, x, y, outputs, reads, _constants(config))
    return found if found is not None and not found.plain else None


def layer_split(i: int, layer: nn.Module, rec: Recording) -> Optional[Split]:
    """The :class:`Split` of layer ``i`` where it has three branch children (direct children with matrix
    parameters), or two it adds scaled by constants; ``None`` for any other layer."""
    names = [n for n, c in layer.named_children() if any(p.dim() >= 2 for p in c.parameters())]
    if len(names) not in (2, 3):
        return None
    if i not in rec.splits:
        first = {n: k for k, e in enumerate(rec.events) for n in names if e[:3] == ("child", i, n)}
        rec.splits[i] = split(i, layer, rec, sorted(names, key=lambda n: first.get(n, -1)), rec.config)
    return rec.splits[i]


def branches(split_: Split, attention: Optional[str]) -> Optional[tuple[Optional[str], Optional[str]]]:
    """``(mixer, mlp)`` of a three-branch layer (the module docstring): ``mixer`` the child whose output (scaled where
    the split is :attr:`~Split.summed`) is ``hook_attn_out``, ``mlp`` the one whose output is ``hook_mlp_out``
    (``None`` where two modules make the MLP)."""
    if split_.scaled:
        return None, split_.after[0]
    if len(split_.before) == 2:
        return (attention, split_.after[0]) if attention in split_.before else None
    return split_.before[0], split_.after[0] if len(split_.after) == 1 else None


def beside(split_: Split, attention: Optional[str]) -> Optional[str]:
    """The token mixer a three-branch layer runs beside its attention module before its middle, whose output (scaled
    where the split is :attr:`~Split.summed`) the layer adds (``hook_mixer_out``: its contribution to
    ``hook_resid_mid``); ``None`` where there is none."""
    if split_.scaled or len(split_.before) != 2 or attention not in split_.before:
        return None
    return next(n for n in split_.before if n != attention)


def mid_value(x: Tensor, i: int, rec: Recording, split_: Split) -> Tensor:
    """``hook_resid_mid``'s value in the probe: the layer's input ``x`` plus the (scaled) outputs before the middle,
    added in the order that gives the layer's output exactly (:func:`split` found one: in bfloat16 another order
    differs by more than the dtype's rounding of one sum); where they are scaled by no constant found, the layer's
    output less the MLP's output."""
    if split_.scaled:
        return rec.layer_out[i].value - rec.children[(i, split_.after[0])].value
    parts = [scale(rec.children[(i, n)].value, c) for n, c in zip(split_.before, split_.before_scales)]
    return middle(x, parts, split_)
