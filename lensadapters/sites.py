"""Sites: the PyTorch hooks that realize hook points on an unmodified model.

A site watches one place of the model (a module's input or output) and serves one or more hook
points there. It is installed only while one of its points has a user function (or another site
needs it), so a model with no hooks runs exactly Hugging Face's forward. Every site follows one
rule: if no hook changed anything, the model's own tensor is passed on untouched.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import norms
from .hook_point import HookPoint, is_recomputing
from .specs import FusedQKV, NormSpec, RotarySpec

Tensor = torch.Tensor
_INPUT_KEYS = ("hidden_states", "input", "x", "inputs_embeds")


# --- helpers on module inputs and outputs -----------------------------------------------------------


def first_input(args: tuple, kwargs: dict) -> Tensor:
    if args:
        return args[0]
    for key in _INPUT_KEYS:
        if key in kwargs:
            return kwargs[key]
    raise RuntimeError("lensadapters could not find the hidden states among the module's inputs")


def replace_first_input(args: tuple, kwargs: dict, value: Tensor) -> tuple[tuple, dict]:
    if args:
        return (value, *args[1:]), kwargs
    for key in _INPUT_KEYS:
        if key in kwargs:
            return args, {**kwargs, key: value}
    raise RuntimeError("lensadapters could not find the hidden states among the module's inputs")


def first_output(output: Any) -> Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def replace_first_output(output: Any, value: Tensor) -> Any:
    if isinstance(output, tuple):
        return (value, *output[1:])
    if isinstance(output, list):
        return [value, *output[1:]]
    return value


def split_heads(t: Tensor, n_heads: int) -> Tensor:
    """``[..., n_heads * d_head]`` → ``[..., n_heads, d_head]`` (a view)."""
    return t.unflatten(-1, (n_heads, -1))


def merge_heads(t: Tensor) -> Tensor:
    return t.flatten(-2)


# --- the site protocol -------------------------------------------------------------------------------


class Site:
    """A group of hook points realized by PyTorch hooks at one place of the model."""

    points: tuple[HookPoint, ...] = ()

    def wanted(self) -> bool:
        return any(p.active for p in self.points)

    def signature(self) -> tuple[bool, ...]:
        """What decides the PyTorch hooks this site installs; the site is re-installed when it changes."""
        return (self.wanted(),)

    def install(self) -> list[RemovableHandle]:  # pragma: no cover - abstract
        raise NotImplementedError


class ForwardState:
    """Values that sites share within one forward pass (rotary cos/sin, residual bookkeeping)."""

    def __init__(self) -> None:
        self.rotary: Optional[tuple[Tensor, Tensor]] = None
        self.batch: Optional[int] = None
        self.resid_mid: dict[int, Tensor] = {}
        self.mlp_out: dict[int, Tensor] = {}
        self.block_shape: dict[int, tuple[int, ...]] = {}

    def clear(self) -> None:
        self.rotary = None
        self.batch = None
        self.resid_mid.clear()
        self.mlp_out.clear()
        self.block_shape.clear()


# --- generic sites -------------------------------------------------------------------------------------


class OutputSite(Site):
    """A module's output (first element of a tuple), optionally viewed as heads."""

    def __init__(self, module: nn.Module, point: HookPoint, heads: Optional[int] = None, protect: bool = False) -> None:
        self.module, self.point, self.heads, self.protect = module, point, heads, protect
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        shaped = split_heads(value, self.heads) if self.heads else value
        shaped, changed = self.point.apply(shaped, self.protect)
        if not changed:
            return None
        return replace_first_output(output, merge_heads(shaped) if self.heads else shaped)


class PositionEmbedSite(Site):
    """``hook_pos_embed`` as ``[batch, pos, d_model]``, even when the model broadcasts one row of positions.

    The token-embedding module's output tells the batch size; an edit may differ per batch element.
    """

    def __init__(self, module: nn.Module, embed_module: nn.Module, point: HookPoint, state: "ForwardState") -> None:
        self.module, self.embed_module, self.point, self.state = module, embed_module, point, state
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.embed_module.register_forward_hook(self._record_batch), self.module.register_forward_hook(self._hook)]

    def _record_batch(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.state.batch = first_output(output).shape[0]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        batch, self.state.batch = self.state.batch, None
        shaped = value.expand(batch, *value.shape[1:]) if batch and value.shape[0] == 1 else value
        shaped, changed = self.point.apply(shaped, protect=shaped is not value)  # an expanded view: edit a copy
        return replace_first_output(output, shaped) if changed else None


class InputSite(Site):
    """A module's first input, optionally viewed as heads.

    ``protect``: the model uses the same tensor elsewhere (a post-LN block's MLP input is also its
    residual), so an in-place edit is made on a copy and reaches this module only.
    """

    def __init__(self, module: nn.Module, point: HookPoint, heads: Optional[int] = None, protect: bool = False) -> None:
        self.module, self.point, self.heads, self.protect = module, point, heads, protect
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_pre_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        value = first_input(args, kwargs)
        shaped = split_heads(value, self.heads) if self.heads else value
        shaped, changed = self.point.apply(shaped, self.protect)
        if not changed:
            return None
        return replace_first_input(args, kwargs, merge_heads(shaped) if self.heads else shaped)


class NormSite(Site):
    """``hook_scale`` and ``hook_normalized`` of a LayerNorm/RMSNorm; an edited scale is used by the norm."""

    def __init__(self, module: nn.Module, spec: Callable[[], NormSpec], scale: HookPoint,
                 normalized: HookPoint) -> None:
        self.module, self.spec = module, spec
        self.scale, self.normalized = scale, normalized
        self.points = (scale, normalized)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        # Edits enter as the difference they make to the norm's own output, so that whatever a hook left as it
        # was keeps the model's exact numbers (an identity edit is bitwise; the written-out norm is not).
        x = first_input(args, kwargs)
        out = first_output(output)
        spec = self.spec()
        scale = edited_scale = None
        scale_changed = False
        if self.scale.active or spec.kind == "RMS" and self.normalized.active:
            scale = edited_scale = norms.scale(x, spec)
            if self.scale.active:
                edited_scale, scale_changed = self.scale.apply(scale, protect=True)
        if not (self.normalized.active or scale_changed):
            return None
        if spec.kind == "LN":  # hook_normalized is the norm's output itself
            normalized = out
            if scale_changed:
                delta = norms.layer_norm(x, spec, edited_scale).float() - norms.layer_norm(x, spec, scale).float()
                normalized = (out.float() + delta).to(out.dtype)
            normalized, norm_changed = self.normalized.apply(normalized)
            if not (scale_changed or norm_changed):
                return None
            return replace_first_output(output, normalized.to(out.dtype))
        base = norms.rms_normalized(x, scale)  # RMSNorm: hook_normalized is before the weight
        normalized = norms.rms_normalized(x, edited_scale) if scale_changed else base
        normalized, norm_changed = self.normalized.apply(normalized, protect=True)
        if not (scale_changed or norm_changed):
            return None
        delta = norms.rms_weighted_delta(normalized.float() - base.float(), spec)
        return replace_first_output(output, (out.float() + delta).to(out.dtype))


class BlockShapeSite(Site):
    """Records a block's leading input dimensions ``(b, p)``, for points that see tokens flattened."""

    def __init__(self, layer: int, block: nn.Module, points: Sequence[HookPoint], state: ForwardState) -> None:
        self.layer, self.block, self.state = layer, block, state
        self.points = tuple(points)

    def install(self) -> list[RemovableHandle]:
        return [self.block.register_forward_pre_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.state.block_shape[self.layer] = tuple(first_input(args, kwargs).shape[:-1])


class RotaryCaptureSite(Site):
    """Records the ``(cos, sin)`` of this forward pass.

    By default they are the output of the model's rotary module; with ``from_inputs`` (see
    ``ModelLayout.rotary_from_inputs``) they are computed from the module's inputs in a pre-hook.
    """

    def __init__(self, module: nn.Module, points: Sequence[HookPoint], state: ForwardState,
                 from_inputs: Optional[Callable[[nn.Module, tuple, dict], tuple[Tensor, Tensor]]] = None) -> None:
        self.module, self.state, self.from_inputs = module, state, from_inputs
        self.points = tuple(points)

    def install(self) -> list[RemovableHandle]:
        if self.from_inputs is not None:
            return [self.module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)]
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        cos, sin = output[0], output[1]
        self.state.rotary = (cos, sin)

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cos, sin = self.from_inputs(module, args, kwargs)
        self.state.rotary = (cos, sin)


class RecomputedRotarySite(Site):
    """Gives ``hook_rot_q/k`` of a layer recomputed by gradient checkpointing the (cos, sin) of its forward.

    The rotary module runs once per forward, outside the checkpointed layers, so during the backward
    pass's recomputation the forward state holds no (cos, sin). A pre-hook on the layer's attention
    module finds them again: among the attention's own inputs (the model passes the very tensors its
    rotary module returned, held weakly here), or computed from those inputs when the plugin's
    ``ModelLayout.rotary_from_inputs`` reads them from a module of the same class. Otherwise the
    rotary point raises its usual error.
    """

    def __init__(self, attention: nn.Module, points: Sequence[HookPoint], state: ForwardState,
                 rotary_module: nn.Module, from_inputs: Optional[Callable[..., tuple[Tensor, Tensor]]]) -> None:
        self.attention, self.state, self.rotary_module, self.from_inputs = attention, state, rotary_module, from_inputs
        self.points = tuple(points)
        self._seen: dict[int, tuple["weakref.ref[Tensor]", "weakref.ref[Tensor]"]] = {}
        self._saved: list[Any] = []

    def install(self) -> list[Any]:
        self._seen.clear()
        return [self.attention.register_forward_pre_hook(self._pre, with_kwargs=True),
                self.attention.register_forward_hook(self._post, always_call=True)]

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not is_recomputing():
            if self.state.rotary is not None:
                cos, sin = self.state.rotary
                self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
                self._seen[id(cos)] = (weakref.ref(cos), weakref.ref(sin))
            return
        self._saved.append(self.state.rotary)
        self.state.rotary = self._find(module, args, kwargs)

    def _find(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[Tensor, Tensor]]:
        if self.from_inputs is not None and type(module) is type(self.rotary_module):
            return self.from_inputs(module, args, kwargs)
        for value in (*args, *kwargs.values()):
            for t in (value if isinstance(value, (tuple, list)) else (value,)):
                refs = self._seen.get(id(t)) if isinstance(t, Tensor) else None
                if refs is not None and refs[0]() is t and refs[1]() is not None:
                    return t, refs[1]()
        return None

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._saved and is_recomputing():
            self.state.rotary = self._saved.pop()


def _rotate(point_value: Tensor, rot_point: Optional[HookPoint], rotary: Optional[RotarySpec],
            state: ForwardState) -> tuple[Tensor, bool]:
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

    def __init__(self, module: nn.Module, point: HookPoint, heads: int, state: ForwardState,
                 rot_point: Optional[HookPoint] = None, rotary: Optional[RotarySpec] = None) -> None:
        self.module, self.point, self.heads = module, point, heads
        self.rot_point, self.rotary, self.state = rot_point, rotary, state
        self.points = (point,) + ((rot_point,) if rot_point is not None else ())

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = split_heads(first_output(output), self.heads)
        value, changed = self.point.apply(value)
        value, rot_changed = _rotate(value, self.rot_point, self.rotary, self.state)
        if not (changed or rot_changed):
            return None
        return replace_first_output(output, merge_heads(value))


class FusedQKVSite(Site):
    """``hook_q/k/v`` (and rotary points) split from one fused projection, re-fused after edits."""

    def __init__(self, module: nn.Module, layout: FusedQKV, q: HookPoint, k: HookPoint, v: HookPoint,
                 state: ForwardState, rot_q: Optional[HookPoint] = None, rot_k: Optional[HookPoint] = None) -> None:
        self.module, self.layout, self.state = module, layout, state
        self.q, self.k, self.v, self.rot_q, self.rot_k = q, k, v, rot_q, rot_k
        self.points = tuple(p for p in (q, k, v, rot_q, rot_k) if p is not None)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        q, k, v = self.layout.split(first_output(output))
        # split/chunk return views that autograd forbids editing in place: an editing hook gets a copy
        q, cq = self.q.apply(q, protect=True)
        k, ck = self.k.apply(k, protect=True)
        v, cv = self.v.apply(v, protect=True)
        q, crq = _rotate(q, self.rot_q, self.layout.rotary, self.state)
        k, crk = _rotate(k, self.rot_k, self.layout.rotary, self.state)
        if not (cq or ck or cv or crq or crk):
            return None
        return replace_first_output(output, self.layout.merge(q, k, v))


class ResultSite(Site):
    """``attn.hook_result``: per-head outputs of the output projection (``z`` times the read ``W_O``).

    An edit changes the projection's own output by ``sum_h (edited_h - result_h)``, which equals
    ``sum_h edited_h + b_O`` up to rounding, while heads left as they were keep the model's exact
    numbers (a quantized or adapted projection is not recomputed in float; an identity edit is bitwise).
    """

    def __init__(self, module: nn.Module, point: HookPoint, heads: int,
                 weight: Callable[[], tuple[Tensor, Optional[Tensor]]]) -> None:
        self.module, self.point, self.heads, self.weight = module, point, heads, weight
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        z = split_heads(first_input(args, kwargs), self.heads)
        W, _ = self.weight()  # [d_in, d_out] (the bias is in the output already)
        W_O = W.unflatten(0, (self.heads, -1)).to(z.dtype)
        result = torch.einsum("...hd,hdm->...hm", z, W_O)
        edited, changed = self.point.apply(result, protect=True)
        if not changed:
            return None
        out = first_output(output)
        delta = edited.float().sum(-2) - result.float().sum(-2)
        return replace_first_output(output, (out.float() + delta).to(out.dtype))


class ResidualSite(Site):
    """The residual stream around the MLP of one block.

    ``hook_resid_mid`` and ``hook_mlp_in`` are the input of ``ln2``. An edit of ``hook_mlp_in`` changes
    only the MLP's input. An edit of ``hook_resid_mid`` changes the MLP's input *and* the residual:
    the block output is then recomputed as ``resid_mid + mlp_out``, exactly what the block computes.
    ``hook_mlp_out`` is the output of the MLP module, ``hook_resid_post`` the block output.

    Under gradient checkpointing, transformers re-runs a block's forward but not the block's own hooks.
    While a block is checkpointed, and given ``residual_add`` (the module whose output the block adds to
    the residual after the MLP: the MLP module, or a dropout after it), the ``hook_resid_mid`` edit's
    difference ``edited - resid_mid`` is therefore added to that module's output, so that the block's own
    ``residual + mlp_out`` becomes ``edited + mlp_out`` inside the checkpointed forward and gradients
    reach the edit through both branches. Blocks without such a module (OPT, whose dropout follows
    ``fc2`` in the block body) are rebuilt at the block output in every case.
    """

    def __init__(self, layer: int, block: nn.Module, ln2: Optional[nn.Module], mlp_out_module: nn.Module,
                 state: ForwardState, resid_mid: Optional[HookPoint], mlp_in: Optional[HookPoint],
                 mlp_out: HookPoint, resid_post: HookPoint, residual_add: Optional[nn.Module] = None) -> None:
        self.layer, self.block, self.ln2, self.mlp_out_module, self.state = layer, block, ln2, mlp_out_module, state
        self.residual_add = residual_add

        self.resid_mid, self.mlp_in, self.mlp_out, self.resid_post = resid_mid, mlp_in, mlp_out, resid_post
        self.points = tuple(p for p in (resid_mid, mlp_in, mlp_out, resid_post) if p is not None)

    def _edit_in_mlp(self) -> bool:
        """Carry resid_mid edits into the block's residual add: only while the block is gradient-checkpointed.

        Otherwise the block output is rebuilt as ``edited + mlp_out``, which keeps gradients bit for bit
        (the difference form sums the residual gradient in another order).
        """
        return (self.residual_add is not None and self.block.training
                and bool(getattr(self.block, "gradient_checkpointing", False)))

    def wanted(self) -> bool:
        return any(self.signature())

    def _mid_active(self) -> bool:
        return self.resid_mid is not None and self.resid_mid.active

    def install(self) -> list[RemovableHandle]:
        handles = []
        mid = self._mid_active()
        if self.ln2 is not None and (mid or (self.mlp_in is not None and self.mlp_in.active)):
            handles.append(self.ln2.register_forward_pre_hook(self._ln2_pre, with_kwargs=True))
        if mid or self.mlp_out.active:
            handles.append(self.mlp_out_module.register_forward_hook(self._mlp_out))
        if mid and self.residual_add is not None and self.residual_add is not self.mlp_out_module:
            handles.append(self.residual_add.register_forward_hook(self._add_delta))
        if mid or self.resid_post.active:
            handles.append(self.block.register_forward_hook(self._block_out))
        return handles

    def signature(self) -> tuple[bool, ...]:
        """Which of the three PyTorch hooks are needed now (re-installed when this changes)."""
        mid = self._mid_active()
        return (mid or bool(self.mlp_in and self.mlp_in.active), mid or self.mlp_out.active,
                mid or self.resid_post.active)

    def _ln2_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        value = first_input(args, kwargs)
        changed = False
        self.state.resid_mid.pop(self.layer, None)  # never a leftover of a forward that raised
        self.state.mlp_out.pop(self.layer, None)
        if self.resid_mid is not None and self.resid_mid.active:
            original = value
            value, changed = self.resid_mid.apply(value, protect=True)  # the block's residual is this tensor
            if changed:  # the difference (added to the MLP output) or the edited stream (rebuilt at the block output)
                in_mlp = self._edit_in_mlp()
                self.state.resid_mid[self.layer] = (in_mlp, value - original if in_mlp else value)
        if self.mlp_in is not None and self.mlp_in.active:
            value, in_changed = self.mlp_in.apply(value, protect=True)  # an edit reaches the MLP branch only
            changed = changed or in_changed
        return replace_first_input(args, kwargs, value) if changed else None

    def _mlp_out(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        changed = False
        if self.mlp_out.active:
            value, changed = self.mlp_out.apply(value)
        stash = self.state.resid_mid.get(self.layer)
        if stash is not None:
            if stash[0] and self.residual_add is module:
                return self._add_delta(module, args, replace_first_output(output, value))
            if not stash[0]:
                self.state.mlp_out[self.layer] = value
        return replace_first_output(output, value) if changed else None

    def _add_delta(self, module: nn.Module, args: tuple, output: Any) -> Any:
        stash = self.state.resid_mid.get(self.layer)
        if stash is None or not stash[0]:
            return None
        delta = self.state.resid_mid.pop(self.layer)[1]
        value = first_output(output)
        return replace_first_output(output, value + delta.reshape(value.shape).to(value.dtype))

    def _block_out(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        changed = False
        stash = self.state.resid_mid.pop(self.layer, None)
        if stash is not None and not stash[0]:
            # the block may have flattened tokens around its MLP (BlockLayout.flat_mlp)
            value = (stash[1] + self.state.mlp_out.pop(self.layer)).reshape(value.shape)
            changed = True
        if self.resid_post.active:
            value, post_changed = self.resid_post.apply(value)
            changed = changed or post_changed
        return replace_first_output(output, value) if changed else None


class AttentionSite(Site):
    """``hook_attn_scores`` and ``hook_pattern`` of one layer, served by a pattern backend."""

    def __init__(self, layer: int, backend: Any, scores: HookPoint, pattern: HookPoint) -> None:
        self.layer, self.backend = layer, backend
        self.scores, self.pattern = scores, pattern
        self.points = (scores, pattern)

    def install(self) -> list[RemovableHandle]:
        return [self.backend.activate(self.layer, self)]
