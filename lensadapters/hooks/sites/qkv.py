"""Queries, keys and values: separate or fused projections, rotary embeddings and their inversion.

Rotary points (``hook_rot_q``/``hook_rot_k``) are served by the projection's site: the projected value is
rotated with the ``(cos, sin)`` of this forward pass (recorded by ``RotaryCaptureSite``, or per layer by
``AttentionRotarySite``), shown to the hooks, and an edit is rotated back (``RotarySpec.invert``) and added to
the projection output as a difference, so the attention module, which rotates the projection output itself,
sees the edited rotated value and the KV cache stores it. When a norm sits between projection and rotary
(``q_norm``/``k_norm``), ``NormedRotarySite`` does the same on the norm's output.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks.hook_point import HookPoint, is_recomputing
from lensadapters.hooks.sites.base import (
    ForwardState,
    Site,
    first_output,
    merge_heads,
    reads_output,
    replace_first_output,
    split_heads,
)
from lensadapters.hooks.specs import FusedQKV, ProjectionNorm, RotarySpec

Tensor = torch.Tensor


def rotary_angles(value: Any) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of what a rotary module returns: the pair itself, or a complex tensor of rotations
    ``e^{i theta}`` (DeepSeek-V2's ``freqs_cis``, ``[b, p, r/2]``), as its real and imaginary parts."""
    if isinstance(value, Tensor) and value.is_complex():
        return value.real, value.imag
    return value[0], value[1]


class RotaryCaptureSite(Site):
    """Records the ``(cos, sin)`` of this forward pass.

    By default they are the output of the model's rotary module; with ``from_inputs`` (see
    ``ModelLayout.rotary_from_inputs``) they are computed from the module's inputs in a pre-hook.
    """

    def __init__(
        self,
        module: nn.Module,
        points: Sequence[HookPoint],
        state: ForwardState,
        from_inputs: Optional[Callable[[nn.Module, tuple, dict], tuple[Tensor, Tensor]]] = None,
    ) -> None:
        self.module, self.state, self.from_inputs = module, state, from_inputs
        self.points = tuple(points)

    def install(self) -> list[RemovableHandle]:
        if self.from_inputs is not None:
            return [self.module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)]
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.state.rotary = rotary_angles(output)

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cos, sin = self.from_inputs(module, args, kwargs)
        self.state.rotary = (cos, sin)


class RecomputedRotarySite(Site):
    """Gives ``hook_rot_q/k`` of a layer recomputed by gradient checkpointing the (cos, sin) of its forward.

    The rotary module runs once per forward, outside the checkpointed layers, so during the backward
    pass's recomputation the forward state holds no (cos, sin). A pre-hook on the layer's attention
    module finds them again: among the attention's own inputs (the model passes the very tensors its
    rotary module returned, held weakly here: the pair, or the complex table whose parts they are), or
    computed from those inputs when the plugin's ``ModelLayout.rotary_from_inputs`` reads them from a
    module of the same class. Otherwise the rotary point raises its usual error.
    """

    def __init__(
        self,
        attention: nn.Module,
        points: Sequence[HookPoint],
        state: ForwardState,
        rotary_module: nn.Module,
        from_inputs: Optional[Callable[..., tuple[Tensor, Tensor]]],
    ) -> None:
        self.attention, self.state, self.rotary_module, self.from_inputs = attention, state, rotary_module, from_inputs
        self.points = tuple(points)
        self._seen: dict[int, tuple["weakref.ref[Tensor]", "weakref.ref[Tensor]"]] = {}
        self._saved: list[Any] = []

    def install(self) -> list[Any]:
        self._seen.clear()
        return [
            self.attention.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.attention.register_forward_hook(self._post, always_call=True),
        ]

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not is_recomputing():
            if self.state.rotary is not None:
                cos, sin = self.state.rotary
                self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
                self._seen[id(cos)] = (weakref.ref(cos), weakref.ref(sin))
                table = cos._base
                if table is not None and table.is_complex() and sin._base is table:  # a complex table's parts
                    self._seen[id(table)] = (weakref.ref(table), weakref.ref(table))
            return
        self._saved.append(self.state.rotary)
        self.state.rotary = self._find(module, args, kwargs)

    def _find(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[Tensor, Tensor]]:
        if self.from_inputs is not None and type(module) is type(self.rotary_module):
            return self.from_inputs(module, args, kwargs)
        for value in (*args, *kwargs.values()):
            for t in value if isinstance(value, (tuple, list)) else (value,):
                refs = self._seen.get(id(t)) if isinstance(t, Tensor) else None
                sin = refs[1]() if refs is not None and refs[0]() is t else None
                if sin is not None:  # a complex table is held as (table, table): its parts are the angles
                    return rotary_angles(sin) if sin.is_complex() else (t, sin)
        return None

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._saved and is_recomputing():
            self.state.rotary = self._saved.pop()


class AttentionRotarySite(Site):
    """Records a layer's ``(cos, sin)`` from its attention module's keyword argument ``key`` (a pre-hook).

    For models whose layers use different rotary sources (``ModelLayout.rotary_input``): the value is taken
    right before the layer's projections run, and again when gradient checkpointing recomputes the layer.
    """

    def __init__(self, attention: nn.Module, key: str, points: Sequence[HookPoint], state: ForwardState) -> None:
        self.attention, self.key, self.state = attention, key, state
        self.points = tuple(points)

    def install(self) -> list[RemovableHandle]:
        return [self.attention.register_forward_pre_hook(self._pre, with_kwargs=True)]

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        value = kwargs.get(self.key)
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise RuntimeError(
                f"{type(module).__name__} was called without its rotary (cos, sin) as the keyword argument "
                f"{self.key!r} (ModelLayout.rotary_input); hook_rot_q/hook_rot_k cannot be computed"
            )
        self.state.rotary = (value[0], value[1])


def heads_view(layout: str, heads: int) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """``(to_heads, from_heads)``: a projection norm's tensor (``ProjectionNorm.layout``) as ``[b, p, h, d]``."""
    if layout == "bpf":
        return (lambda t: t.unflatten(-1, (heads, -1))), (lambda t: t.flatten(-2))
    if layout == "bhpd":
        return (lambda t: t.transpose(1, 2)), (lambda t: t.transpose(1, 2))
    if layout == "bphd":
        return (lambda t: t), (lambda t: t)
    raise ValueError(f"unknown ProjectionNorm layout {layout!r} (bphd, bhpd, bpf)")


def _rotate(
    point_value: Tensor, rot_point: Optional[HookPoint], rotary: Optional[RotarySpec], state: ForwardState
) -> tuple[Tensor, bool]:
    """Run ``hook_rot_*`` on the rotated value; turn an edit back into a pre-rotary value."""
    if rot_point is None or rotary is None or not rot_point.active:
        return point_value, False
    if state.rotary is None:
        raise RuntimeError(f"{rot_point.name}: the model's rotary module did not run before attention")
    cos, sin = state.rotary
    rotated = rotary.apply(point_value, cos, sin)
    edited, changed = rot_point.apply(rotated, protect=True)
    if not changed:
        return point_value, False
    # the rotation is linear: only the edit's difference is rotated back, so entries the hook left as they were
    # keep the projection's exact numbers (an identity edit is bitwise) instead of a rotate/unrotate round trip
    delta = rotary.invert(edited - rotated, cos, sin)
    return point_value + delta.to(point_value.dtype), True


class ProjectionSite(Site):
    """One of separate q/k/v projections: ``hook_q`` (and ``hook_rot_q``) on its output."""

    def __init__(
        self,
        module: nn.Module,
        point: HookPoint,
        heads: int,
        state: ForwardState,
        rot_point: Optional[HookPoint] = None,
        rotary: Optional[RotarySpec] = None,
        scale: float = 1.0,
    ) -> None:
        self.module, self.point, self.heads = module, point, heads
        self.rot_point, self.rotary, self.state = rot_point, rotary, state
        self.scale = scale  # the attention module's constant on the output (SeparateQKV.k_scale): in the value shown
        self.points = (point,) + ((rot_point,) if rot_point is not None else ())

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        raw = split_heads(first_output(output), self.heads)
        shown = raw if self.scale == 1.0 else raw * self.scale  # as the attention module computes it
        value, changed = self.point.apply(shown)
        value, rot_changed = _rotate(value, self.rot_point, self.rotary, self.state)
        if not (changed or rot_changed):
            return None
        if self.scale != 1.0:  # the edit's difference, divided by the constant the model multiplies it by again
            value = raw + ((value - shown) / self.scale).to(raw.dtype)
        return replace_first_output(output, merge_heads(value))


class NormedRotarySite(Site):
    """``hook_rot_q``/``hook_rot_k`` on the output of a norm between the projection and rotary (``q_norm``).

    The norm's output, seen as ``[b, p, h, d]``, is rotated for the hooks; an edit is rotated back and added to
    the norm's output, which the attention module then rotates itself (the KV cache stores the edited key).
    It reads the norm's output (``reads_output``): the norm's own ``NormSite`` completes it first, so it rotates the
    norm's edited output.
    """

    def __init__(
        self,
        module: nn.Module,
        norm: ProjectionNorm,
        heads: int,
        rot_point: HookPoint,
        rotary: RotarySpec,
        state: ForwardState,
    ) -> None:
        self.module, self.rot_point, self.rotary, self.state = module, rot_point, rotary, state
        self.to_heads, self.from_heads = heads_view(norm.layout, heads)
        self.points = (rot_point,)

    def install(self) -> list[RemovableHandle]:
        return [reads_output(self.module, self._hook)]  # after the norm's own NormSite completes the output

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value, changed = _rotate(self.to_heads(first_output(output)), self.rot_point, self.rotary, self.state)
        if not changed:
            return None
        return replace_first_output(output, self.from_heads(value))


class FusedQKVSite(Site):
    """``hook_q/k/v`` (and rotary points) split from one fused projection, re-fused after edits."""

    def __init__(
        self,
        module: nn.Module,
        layout: FusedQKV,
        q: HookPoint,
        k: HookPoint,
        v: HookPoint,
        state: ForwardState,
        rot_q: Optional[HookPoint] = None,
        rot_k: Optional[HookPoint] = None,
    ) -> None:
        self.module, self.layout, self.state = module, layout, state
        self.q, self.k, self.v, self.rot_q, self.rot_k = q, k, v, rot_q, rot_k
        self.points = tuple(p for p in (q, k, v, rot_q, rot_k) if p is not None)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        q, k, v = self.layout.split(first_output(output))
        q, cq = self.q.apply(q)
        k, ck = self.k.apply(k)
        v, cv = self.v.apply(v)
        q, crq = _rotate(q, self.rot_q, self.layout.rotary, self.state)
        k, crk = _rotate(k, self.rot_k, self.layout.rotary, self.state)
        if not (cq or ck or cv or crq or crk):
            return None
        return replace_first_output(output, self.layout.merge(q, k, v))
