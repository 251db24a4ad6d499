"""Attention scores and patterns of layers that compute attention in the model's own code (no attention interface).

While one of such a layer's ``hook_attn_scores``/``hook_pattern`` has a hook that runs in the forward executing now,
a :class:`torch.overrides.TorchFunctionMode` is pushed for the duration of that layer's attention module call only
(a forward pre-hook pushes it, a forward hook registered with ``always_call`` pops it, also when the forward raises;
the mode belongs to the calling thread). The mode sees the module's one softmax call (``torch.softmax``,
``F.softmax``, ``Tensor.softmax``, ``torch.special.softmax``; any ``dtype`` it asks for): its input, viewed as
``[b, heads, q, k]`` (a ``[b * heads, q, k]`` input is viewed so), goes to ``hook_attn_scores`` and the input is
replaced with the hook's result, its output to ``hook_pattern`` and the output is replaced likewise, so an edit
reaches everything the model computes from it. A module that calls ``F.scaled_dot_product_attention`` instead is
computed explicitly (``q·kᵀ·scale`` with its mask, softmax, ``·v``) with the two points in between. Every other
function runs as it is. Nothing is pushed while no such point is hooked: the model's own forward, bit for bit.

Which layers compute attention this way, and that the softmax seen is the attention's (one per call, its output
times the values being what the output projection reads), is the adapter's to establish and verify before it
serves the points (the generic adapter's probe does).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lensadapters.errors import UnsupportedModelError
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites.base import Handles

Tensor = torch.Tensor

#: the softmax functions the mode serves (``F.softmax`` dispatches to none of the others while the mode handles it)
SOFTMAX_FUNCTIONS = frozenset({torch.softmax, F.softmax, Tensor.softmax, torch.special.softmax})
SDPA = F.scaled_dot_product_attention


def as_heads(t: Tensor, heads: int) -> Tensor:
    """``t`` ``[b, heads, q, k]`` as it is, ``[b * heads, q, k]`` viewed as ``[b, heads, q, k]``."""
    if t.dim() == 4:
        return t
    if t.dim() == 3 and t.shape[0] % heads == 0:
        return t.unflatten(0, (-1, heads))
    raise UnsupportedModelError(
        f"the attention softmax got a tensor of shape {tuple(t.shape)}, not [b, {heads}, q, k] or [b * {heads}, q, k]"
    )


def _softmax_parts(func: Any, args: tuple, kwargs: dict) -> tuple[Tensor, int]:
    x = args[0] if args else kwargs["input"]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or dim not in (-1, x.dim() - 1):
        raise UnsupportedModelError(f"the attention softmax runs over dimension {dim}, not over the keys (the last)")
    return x, dim


def _with_input(args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "input": x}


def sdpa_explicitly(
    args: tuple, kwargs: dict, on_scores: Callable[[Tensor], Tensor], on_pattern: Callable[[Tensor], Tensor]
) -> Tensor:
    """``F.scaled_dot_product_attention(*args, **kwargs)`` computed explicitly, with ``on_scores`` applied to the
    masked scores ``[b, heads, q, k]`` and ``on_pattern`` to the softmax (as PyTorch documents it)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    given = {**dict(zip(names, args)), **kwargs}
    q, k, v = given["query"], given["key"], given["value"]
    if given.get("dropout_p", 0.0):
        raise UnsupportedModelError("the attention runs with dropout (training mode): its pattern is not one tensor")
    if q.dim() != 4:
        raise UnsupportedModelError(f"scaled_dot_product_attention got queries of shape {tuple(q.shape)}, not 4-D")
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key head serves a group of query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scale = given.get("scale")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    mask = given.get("attn_mask")
    if given.get("is_causal"):
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    scores = on_scores(scores)
    # as PyTorch's own computation: a query that may see no key (a padding row) attends to nothing (zeros, no nan)
    dead = torch.isneginf(scores).all(-1, keepdim=True)
    pattern = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return on_pattern(pattern).to(v.dtype) @ v


class SoftmaxCaptureMode(TorchFunctionMode):
    """Serves one attention module call's softmax (see the module docstring); ``calls`` counts the softmaxes seen."""

    def __init__(self, scores: Optional[HookPoint], pattern: Optional[HookPoint], heads: int, owner: str) -> None:
        super().__init__()
        self.scores, self.pattern, self.heads, self.owner = scores, pattern, heads, owner
        self.calls = 0

    def _point(self, point: Optional[HookPoint], value: Tensor) -> Tensor:
        if point is None:
            return value
        viewed = as_heads(value, self.heads)
        edited, changed = point.apply(viewed)
        return edited.reshape(value.shape) if changed else value

    def _once(self) -> None:
        self.calls += 1
        if self.calls > 1:
            raise UnsupportedModelError(
                f"{self.owner} computed more than one softmax in one call, which the probe did not see: "
                f"hook_attn_scores and hook_pattern cannot say which is the attention's"
            )

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in SOFTMAX_FUNCTIONS:
            self._once()
            x, _ = _softmax_parts(func, args, kwargs)
            edited = self._point(self.scores, x)
            if edited is not x:
                args, kwargs = _with_input(args, kwargs, edited)
            return self._point(self.pattern, func(*args, **kwargs))
        if func is SDPA:
            self._once()
            return sdpa_explicitly(
                args, kwargs, lambda t: self._point(self.scores, t), lambda t: self._point(self.pattern, t)
            )
        return func(*args, **kwargs)


class SoftmaxCaptureBackend:
    """A pattern backend (``lensadapters_attn_pattern``) for the layers in ``heads`` (layer -> its number of heads),
    whose attention modules compute attention in the model's own code; every other layer goes to ``fallback`` (the
    attention-interface backend)."""

    def __init__(self, attention_modules: list[Optional[nn.Module]], heads: dict[int, int], fallback: Any) -> None:
        self.modules, self.heads, self.fallback = attention_modules, heads, fallback
        self._local = threading.local()

    def _stack(self) -> list[Optional[SoftmaxCaptureMode]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def activate(self, layer: int, site: Any) -> Any:
        if layer not in self.heads:
            return self.fallback.activate(layer, site)
        module = self.modules[layer]
        assert module is not None
        name = f"layer {layer}'s {type(module).__name__}"

        def push(module: nn.Module, args: tuple, kwargs: dict) -> None:
            stack = self._stack()
            stack.append(None)  # popped by the forward hook, which runs also when this raises
            if not any(p is not None and p.has_live_hooks() for p in (site.scores, site.pattern)):
                return
            if module.training:
                raise UnsupportedModelError(
                    f"{name}: hook_attn_scores and hook_pattern of attention computed in the model's own code are "
                    f"served in eval mode only (its dropout after the softmax would make the pattern a random "
                    f"tensor): call model.eval(), or remove these hooks while training"
                )
            mode = SoftmaxCaptureMode(site.scores, site.pattern, self.heads[layer], name)
            mode.__enter__()
            stack[-1] = mode

        def pop(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            stack = self._stack()
            mode = stack.pop() if stack else None
            if mode is None:
                return
            mode.__exit__(None, None, None)
            if mode.calls == 0:
                raise UnsupportedModelError(
                    f"{name} computed no softmax in this call (the probe saw one): its attention implementation "
                    f"changed since the model was wrapped; wrap it again"
                )

        return Handles(
            [
                module.register_forward_pre_hook(push, with_kwargs=True),
                module.register_forward_hook(pop, with_kwargs=True, always_call=True),
            ]
        )
