"""The verification's side of each point: plain PyTorch hooks at a point's reference (:class:`.references.Reference`)
that read its value and make an edit by hand, and the forward passes that run them (:func:`_run_references`, several
edits in the rows of one batch). Nothing here touches a served point: :mod:`.verify` compares the two sides."""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import torch
from torch import nn

from lensadapters.adapters.generic.call_hooks import _once, _per_head
from lensadapters.adapters.generic.eager_reference import (
    _attention,
    _in_row,
    _plan,
    _verify_key,
)
from lensadapters.adapters.generic.own_attention import operand_reference, softmax_reference
from lensadapters.adapters.generic.references import Reference, Unchecked
from lensadapters.hooks.sites.base import Handles, first_input, first_output, replace_first_input, replace_first_output

Tensor = torch.Tensor


def _norm_output(spec: Any, x: Tensor, scale: Tensor) -> Tensor:
    """The norm's output from its input and a scale, with the module's own weight (and bias)."""
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True) if spec.kind == "LN" else xf
    y = centred / scale.float()
    if spec.weight is not None:
        y = y * (spec.weight.detach().float() + spec.weight_offset)
    if spec.kind == "LN" and spec.bias is not None:
        y = y + spec.bias.detach().float()
    return y.to(x.dtype)


def _scale_of(spec: Any, x: Tensor) -> Tensor:
    xf = x.float()
    if spec.kind == "LN":
        return torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + spec.eps)
    return torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + spec.eps)


def _logits(model: nn.Module, ids: Tensor) -> Tensor:
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, return_dict=True)
    logits = getattr(out, "logits", None)
    return (logits if isinstance(logits, Tensor) else first_output(out.to_tuple())).detach().clone()


def _head_input_hooks(ref: Reference, edit: Any, seen: list[Tensor], row: Optional[int]) -> "Handles":
    """TransformerLens' per-head inputs (``hook_attn_in``, ``hook_q_input``...): copies of the pre-norm residual, one
    per head; head ``h``'s (edited) copy goes through the norm (times the constant the block multiplies its output
    by, ``spec``'s optional third element) and the projections, of which head ``h`` is kept."""
    norm, modules = ref.spec[:2]
    c = ref.spec[2] if len(ref.spec) > 2 else 1.0
    heads = ref.layer
    pre_norm: list[Tensor] = []
    handles: list[Any] = []

    def around(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        x, y = pre_norm[0] if pre_norm else first_input(args, kwargs), first_output(output)
        if not seen:
            seen.append(x.unsqueeze(-2).expand(*x.shape[:-1], heads, x.shape[-1]).clone())
        if edit is None:
            return None
        edited = x.unsqueeze(-2) + edit(None).to(x.dtype)
        read = norm(edited) if norm is not None else edited
        out = module(read * c if c != 1.0 else read)  # [b, p, h, h_out * d]
        out = out.unflatten(-1, (heads, out.shape[-1] // heads)).diagonal(dim1=-3, dim2=-2).movedim(-1, -2)
        return replace_first_output(output, _in_row(row, out.flatten(-2).to(y.dtype), y))

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not pre_norm:
            pre_norm.append(first_input(args, kwargs).detach().clone())

    if norm is not None:
        handles.append(norm.register_forward_pre_hook(before, with_kwargs=True))
    handles += [_once(m, around) for m in modules]
    return Handles(handles)


def _plain_hook(
    ref: Reference, edit: Optional[Callable[..., Tensor]], seen: list[Tensor], row: Optional[int] = None
) -> Any:
    """A plain PyTorch hook at the reference: records the tensor and (``edit``) replaces it (in batch row ``row``
    only, where an edit recomputes the tensor)."""
    assert ref.module is not None
    if ref.kind == "result":
        heads = ref.layer

        def result(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            x, y = first_input(args, kwargs), first_output(output)
            seen.append(_per_head(module, x.unflatten(-1, (heads, x.shape[-1] // heads)), heads))
            change = edit(None) if edit is not None else None
            return replace_first_output(output, y + change.sum(-2).to(y.dtype)) if change is not None else None

        return _once(ref.module, result)
    if ref.kind == "head_input":
        return _head_input_hooks(ref, edit, seen, row)
    if ref.kind == "hooks":  # plain hooks of its own on several modules (``ref.spec``: ``.modules``, ``.install``)
        return Handles(ref.spec.install(edit, seen))
    if ref.kind == "softmax":  # attention in the model's own code: its softmax's input or output
        return softmax_reference(ref.module, ref.part, ref.spec, edit, seen)
    if ref.kind == "operand":  # attention in the model's own code: the queries or keys its sdpa call gets
        return operand_reference(ref.module, ref.part, edit, seen)
    if ref.kind == "arg":  # the positional argument ``ref.spec`` of the module's call
        index = ref.spec

        def pre_arg(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            value = args[index]
            seen.append(value.detach().clone())
            return ((*args[:index], edit(value), *args[index + 1 :]), kwargs) if edit is not None else None

        return ref.module.register_forward_pre_hook(pre_arg, with_kwargs=True)
    if ref.kind == "router_input":  # the router's product F.linear(x, W, b), moved by moving x

        def pre_router(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            x, weight = first_input(args, kwargs), cast(Tensor, module.weight)
            logits = torch.nn.functional.linear(x, weight, getattr(module, "bias", None))
            seen.append(logits.detach().clone())
            if edit is None:
                return None
            delta = edit(torch.zeros_like(logits)).double()
            shift = delta @ torch.linalg.pinv(weight.detach().double()).T
            return replace_first_input(args, kwargs, x + shift.to(x.dtype))

        return ref.module.register_forward_pre_hook(pre_router, with_kwargs=True)
    if ref.kind == "scores":  # a router returning (scores, logits): the scores at the top-k (``spec``) of the logits

        def post_scores(module: nn.Module, args: tuple, output: Any) -> Any:
            scores, logits = output[0], output[1]
            index = torch.topk(logits, ref.spec, dim=-1).indices
            weights = scores.gather(-1, index)
            seen.append(weights.detach().clone())
            if edit is None:
                return None
            return (scores.scatter(-1, index, edit(weights)), *output[1:])

        return ref.module.register_forward_hook(post_scores)
    if ref.kind == "grouped_weights":  # a router returning its routing grouped by expert: its rows' weights

        def post_grouped(module: nn.Module, args: tuple, output: Any) -> Any:
            order, row_weights = output[0], output[2]
            weights = torch.empty_like(row_weights).scatter_(0, order, row_weights).reshape(-1, ref.spec)
            seen.append(weights.detach().clone())
            if edit is None:
                return None
            return (*output[:2], edit(weights).flatten()[order], *output[3:])

        return ref.module.register_forward_hook(post_grouped)
    if ref.kind == "in":
        calls = [0]  # with an int ``spec``: only that call of the module (one module called on queries and keys)

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            calls[0] += 1
            if isinstance(ref.spec, int) and calls[0] - 1 != ref.spec:
                return None
            x = first_input(args, kwargs)
            seen.append(x.detach().clone())
            return replace_first_input(args, kwargs, edit(x)) if edit is not None else None

        return ref.module.register_forward_pre_hook(pre, with_kwargs=True)

    ran = [ref.after is None]  # with ``ref.after``: whether that module ran since the reference's last call

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not ran[0]:
            return None
        ran[0] = ref.after is None
        y = first_output(output)
        seen.append(y.detach().clone())
        if ref.kind == "scale":
            seen.append(first_input(args, kwargs).detach().clone())
        return (
            replace_first_output(
                output, _in_row(row, edit(y, first_input(args, kwargs)), y) if ref.kind == "scale" else edit(y)
            )
            if edit is not None
            else None
        )

    if ref.after is not None:

        def after(module: nn.Module, args: tuple, output: Any) -> None:
            ran[0] = True

        return Handles(
            [ref.module.register_forward_hook(post, with_kwargs=True), ref.after.register_forward_hook(after)]
        )
    return ref.module.register_forward_hook(post, with_kwargs=True)


def _run_reference(
    model: nn.Module, ids: Tensor, ref: Reference, owner: dict[int, int], delta: Optional[Tensor]
) -> tuple[Tensor, Tensor]:
    """``(reference value viewed as the point, logits)`` with ``delta`` (in the point's shape) added there."""
    (value,), logits = _run_references(model, ids, owner, [(ref, delta, None)])
    return value, logits


def _edit_at(ref: Reference, delta: Tensor) -> Callable[..., Tensor]:
    """The plain-PyTorch edit that adds ``delta`` (in the point's shape) at ``ref``."""
    if ref.kind == "scale":
        spec, view = ref.spec, ref.view
        return lambda y, x: _norm_output(spec, x, _scale_of(spec, x) + view(delta))
    if ref.kind in ("result", "head_input"):
        return lambda t: delta
    unview = ref.unview
    return lambda t: t + unview(delta, t).to(t.dtype)


def _run_references(
    model: nn.Module,
    ids: Tensor,
    owner: dict[int, int],
    edits: list[tuple[Reference, Optional[Tensor], Optional[int]]],
) -> tuple[list[Tensor], Tensor]:
    """One forward pass with each ``(reference, delta, row)`` of ``edits`` hooked by plain PyTorch: each
    reference's value before its edit (viewed as its point) and the logits. ``row``: the batch row the edit is in
    (``delta`` is zero in the others, and a recomputed tensor is kept there only); ``None``: every row. No two
    references may share a module or an attention layer (:func:`_footprint`)."""
    seens: list[list[Tensor]] = [[] for _ in edits]
    handles: list[Any] = []
    layers = {}
    for (ref, delta, row), seen in zip(edits, seens):
        if ref.kind == "attn":
            layers[ref.layer] = {"part": ref.part, "delta": delta, "seen": seen, "row": row, "unview": ref.unview}
            if ref.spec is not None:  # plain hooks recording what the view needs (the latent keys' rotary angles)
                handles.append(Handles(ref.spec.install(None, [])))
            continue
        handles.append(_plain_hook(ref, _edit_at(ref, delta) if delta is not None else None, seen, row))
        if ref.also is not None and delta is not None:
            added = delta
            handles.append(_plain_hook(ref.also, lambda t, d=added: t + d.to(t.dtype), [], row))
    try:
        if layers:
            _plan.current = {"owner": owner, "layers": layers}
            with _attention(model, _verify_key()):
                logits = _logits(model, ids)
        else:
            logits = _logits(model, ids)
    finally:
        _plan.current = None
        for h in handles:
            h.remove()
    values = []
    for (ref, _, _), seen in zip(edits, seens):
        if not seen:
            if ref.kind == "attn":
                raise Unchecked("the model's attention function was not called for this layer")
            raise RuntimeError("the reference did not fire")
        if ref.kind == "scale":  # the module's output and its input
            values.append(torch.stack([seen[0], seen[1]]))
        elif ref.kind == "attn":
            values.append(ref.view(seen[0]))
        elif ref.kind in ("result", "head_input"):
            values.append(seen[0])
        elif ref.flat:
            values.append(seen[0].reshape(*ids.shape[:2], -1))
        else:
            values.append(ref.view(seen[0]))
    return values, logits
