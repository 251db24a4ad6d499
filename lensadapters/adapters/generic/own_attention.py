"""Attention computed in the model's own code: what the probe sees of it, and the plain-PyTorch reference of its
scores and pattern for the verification.

A layer that does not call transformers' attention interface may still compute softmax attention itself. While the
probe runs, a :class:`torch.overrides.TorchFunctionMode` records, per decoder layer and with the innermost module of
the layer running it, every softmax, ``F.scaled_dot_product_attention`` and matrix product (``matmul``, ``@``,
``bmm``, ``baddbmm``). A layer gets an *own-code attention call* (the same record as an attention-interface call: the
module, queries, keys, values, weights and output per head) where:

* exactly one softmax (over the last dimension, of a ``[b, heads, q, k]`` or ``[b * heads, q, k]`` tensor) or one
  ``scaled_dot_product_attention`` call ran in the layer, inside one of its modules (the call's module);
* for a softmax: a product after it in that module reads the softmax's output (cast or passed through dropout, equal
  values) times the values (``pattern @ v``: its output is ``z``), and the last product before it whose output has
  the scores' size is ``q @ kᵀ`` (its operands are the queries and the keys the scores are computed from; queries the
  model multiplied by a constant first are taken over it, :func:`unscaled_query`).

From there the automatic description (:mod:`.describe`) proceeds as for an interface call: the output projection
must read ``z`` with heads merged (so ``pattern @ v`` is ``hook_z`` on the probe), and the projections must give the
queries, keys and values. The scores and pattern are then served by the capture of the core
(:mod:`lensadapters.hooks.softmax_capture`) and verified against :func:`softmax_reference`, a separate plain mode
that reads and edits the same softmax by hand.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lensadapters.hooks.softmax_capture import SDPA, SOFTMAX_FUNCTIONS

Tensor = torch.Tensor

MATMULS = frozenset(
    {torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm, torch.baddbmm, Tensor.baddbmm}
)

#: model -> {layer: heads} of the layers whose attention the generic adapter serves through the softmax capture
OWN_CODE: "weakref.WeakKeyDictionary[nn.Module, dict[int, int]]" = weakref.WeakKeyDictionary()


@dataclass
class _Op:
    kind: str  # "softmax", "sdpa" or "matmul"
    child: Optional[str]  # the innermost module of the layer running it (its path in the layer)
    operands: tuple[Tensor, ...]
    output: Tensor


def _copy(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, Tensor) else t


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.where: list[tuple[int, Optional[str]]] = []
        self.ops: dict[int, list[_Op]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.where and isinstance(out, Tensor):
            try:
                self._record(func, args, kwargs, out)
            except Exception:  # what cannot be recorded is not served; the probe itself goes on
                self.ops.setdefault(self.where[-1][0], []).append(_Op("softmax", None, (), out))
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Tensor) -> None:
        layer, child = self.where[-1]
        if func in SOFTMAX_FUNCTIONS:
            x = args[0] if args else kwargs.get("input")
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(x, Tensor) and dim in (-1, x.dim() - 1):
                self.ops.setdefault(layer, []).append(_Op("softmax", child, (_copy(x),), _copy(out)))
            else:  # a softmax over another dimension: counted, never served
                self.ops.setdefault(layer, []).append(_Op("softmax", child, (), _copy(out)))
        elif func is SDPA:
            qkv = tuple(
                _copy(args[j] if j < len(args) else kwargs.get(n)) for j, n in enumerate(("query", "key", "value"))
            )
            self.ops.setdefault(layer, []).append(_Op("sdpa", child, qkv, _copy(out)))
        elif func in MATMULS:
            named: tuple[str, ...] = (
                ("input", "batch1", "batch2") if func in (torch.baddbmm, Tensor.baddbmm) else ("input", "other")
            )
            given = [args[j] if j < len(args) else kwargs.get(n, kwargs.get("mat2")) for j, n in enumerate(named)]
            operands = given[-2:]
            if all(isinstance(t, Tensor) for t in operands):
                self.ops.setdefault(layer, []).append(_Op("matmul", child, tuple(map(_copy, operands)), _copy(out)))


@contextlib.contextmanager
def recording(layers: list[nn.Module]):
    """Record the attention operations of each layer (and which of its modules ran them) while the block runs;
    yields the recorder, whose ``ops`` :func:`own_calls` reads."""
    recorder = _Recorder()
    handles: list[Any] = []

    def enter(where: tuple[int, Optional[str]]) -> Callable[..., None]:
        return lambda module, args: recorder.where.append(where)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if recorder.where:
            recorder.where.pop()

    try:
        for i, layer in enumerate(layers):
            for name, module in layer.named_modules():
                if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                    continue
                handles.append(module.register_forward_pre_hook(enter((i, name or None))))
                handles.append(module.register_forward_hook(leave, always_call=True))
        with recorder:
            yield recorder
    finally:
        for handle in handles:
            handle.remove()


def _four(t: Tensor, batch: int) -> Tensor:
    """``[b, h, n, d]`` from ``[b, h, n, d]`` or ``[b * h, n, d]``."""
    return t if t.dim() == 4 else t.reshape(batch, -1, *t.shape[-2:])


def _same_values(a: Tensor, b: Tensor) -> bool:
    if a.numel() != b.numel():
        return False
    return bool(torch.allclose(a.reshape(b.shape).float(), b.float(), atol=1e-5, rtol=1e-4))


def own_call(layer: nn.Module, i: int, ops: list[_Op], batch: int) -> tuple[Optional[dict[str, Any]], str]:
    """``(parts of the call, "")`` for layer ``i`` (see the module docstring), or ``(None, why not)``."""
    attention = [op for op in ops if op.kind in ("softmax", "sdpa")]
    if len(attention) != 1:
        return None, (
            "the layers compute no softmax in the model's own code"
            if not attention
            else "the layers compute more than one softmax per call"
        )
    op = attention[0]
    if op.child is None:
        return None, "the layers compute their softmax outside any child module"
    mine = [o for o in ops if o.child is not None and (o.child + ".").startswith(op.child + ".")]
    at = next(j for j, o in enumerate(mine) if o is op)
    if op.kind == "sdpa":
        q, k, v = op.operands
        if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)):
            return None, "scaled_dot_product_attention is called with tensors that are not [b, heads, p, d]"
        z, weights = op.output, None
    else:
        if not op.operands:
            return None, "the layers' softmax does not run over the keys (the last dimension)"
        pattern = op.output
        if pattern.dim() not in (3, 4):
            return None, f"the layers' softmax has shape {tuple(pattern.shape)}, not [b, heads, q, k]"
        weights = _four(pattern, batch)
        after = [o for o in mine[at + 1 :] if o.kind == "matmul" and _same_values(o.operands[0], pattern)]
        before = [o for o in mine[:at] if o.kind == "matmul" and o.output.numel() == pattern.numel()]
        if not after or not before:
            return None, "no matrix product reads the softmax's output times the values, or gives the scores"
        q, k, v = before[-1].operands[0], before[-1].operands[1].transpose(-1, -2), after[0].operands[1]
        z = after[0].output
    q, k, v, z = (_four(t, batch) for t in (q, k, v, z))
    heads = q.shape[1]
    if (
        z.shape[1] != heads
        or k.shape[-2] != v.shape[-2]
        or (weights is not None and (weights.shape[1] != heads or weights.shape[-1] != k.shape[-2]))
    ):
        return None, "the queries, keys, values and softmax of the layers' attention do not fit one another"
    return {
        "module": layer.get_submodule(op.child),
        "heads": heads,
        "kv_heads": k.shape[1],
        "d_head": q.shape[-1],
        "output": z.transpose(1, 2).contiguous(),  # [b, p, heads, d], as the attention interface returns it
        "query": q,
        "key": k,
        "value": v,
        "weights": weights,
    }, ""


# --- the reference of the verification -------------------------------------------------------------------------


class _PlainSoftmax(TorchFunctionMode):
    """Reads (and edits with ``edit``) the first softmax of one call: its input (``part`` ``scores``) or its output
    (``weights``), viewed ``[b, heads, q, k]``."""

    def __init__(self, part: str, heads: int, edit: Optional[Callable[[Tensor], Tensor]], seen: list[Tensor]) -> None:
        super().__init__()
        self.part, self.heads, self.edit, self.seen = part, heads, edit, seen
        self.done = False

    def _view(self, t: Tensor) -> Tensor:
        return t if t.dim() == 4 else t.unflatten(0, (-1, self.heads))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func not in SOFTMAX_FUNCTIONS or self.done:
            return func(*args, **kwargs)
        self.done = True
        x = args[0] if args else kwargs["input"]
        if self.part == "scores":
            self.seen.append(self._view(x).detach().clone())
            if self.edit is not None:
                x = self.edit(self._view(x)).reshape(x.shape)
                args, kwargs = ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "input": x})
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.seen.append(self._view(out).detach().clone())
        return self.edit(self._view(out)).reshape(out.shape) if self.edit is not None else out


def softmax_reference(
    module: nn.Module, part: str, heads: int, edit: Optional[Callable[[Tensor], Tensor]], seen: list[Tensor]
) -> Any:
    """Plain hooks on ``module`` that read (into ``seen``) and edit the scores or weights of its first softmax in
    each call; the handle removes them."""
    modes: list[_PlainSoftmax] = []

    def push(module: nn.Module, args: tuple) -> None:
        mode = _PlainSoftmax(part, heads, edit, seen)
        modes.append(mode)
        mode.__enter__()

    def pop(module: nn.Module, args: tuple, output: Any) -> None:
        if modes:
            modes.pop().__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(push), module.register_forward_hook(pop, always_call=True)]

    class _Remove:
        def remove(self) -> None:
            for handle in handles:
                handle.remove()

    return _Remove()


def unscaled_query(query: Tensor, outputs: list[Tensor]) -> Tensor:
    """``query`` ``[b, heads, p, d]`` over the constant the model multiplied it by before the product with the keys
    (BART's ``q_proj(x) * scaling``): where exactly one of ``outputs`` (the layer's linear modules' outputs, heads
    merged) is ``query / c`` for a constant ``c != 1``, that output per head; else ``query`` as it is. The constant is
    part of the scores, which the softmax capture reads whole; ``hook_q`` is the projection's output."""
    want = query.transpose(1, 2).flatten(-2)
    found = []
    for y in outputs:
        if y.shape != want.shape:
            continue
        usable = y.abs() > 1e-6
        if not bool(usable.any()):
            continue
        c = float((want[usable].double() / y[usable].double()).median())
        if (
            c != 0.0
            and abs(c - 1.0) > 1e-6
            and bool(torch.allclose(y.double() * c, want.double(), atol=1e-5, rtol=1e-4))
        ):
            found.append(y)
    if len(found) != 1:
        return query
    return found[0].unflatten(-1, (query.shape[1], -1)).transpose(1, 2)
