"""Multi-head latent attention (MLA: DeepSeek-V2/V3 and the models built like them) in the description language.

A layer's MLA is declared by :class:`LatentAttention` (paths relative to the block, as every layout's): which module
gives the per-head queries (the up-projection of a query latent, or a projection of the normalized residual), the
query latent's down-projection and norm where there is one, the key/value down-projection whose output is
``[kv latent | shared rope key]``, the latent's norm, and the up-projection whose output is per head
``[no-rope key | value]``; the head sizes, and the rotary embedding of the rope columns (:func:`latent_rotary`).

From it the core serves (:func:`latent_sites`), with TransformerLens' names where they exist:

* ``attn.hook_q_latent`` ``[b, p, q_rank]``: the query latent's norm output (only with a query latent);
* ``attn.hook_k_rope`` ``[b, p, rope]``: the key columns every head shares, the down-projection's last columns,
  before rotary;
* ``attn.hook_kv_latent`` ``[b, p, kv_rank]``: the key/value latent's norm output;
* ``attn.hook_q`` ``[b, p, h, nope + rope]``: each head's query as the up-projection gives it (``[no-rope | rope]``),
  ``hook_k`` (same shape): ``[k_nope_h | k_rope]``, ``hook_v`` ``[b, p, h, v_head_dim]``;
  ``hook_rot_q``/``hook_rot_k``: rotary applied to the rope columns, as the model passes them to attention;
* ``hook_attn_in``, ``hook_q_input``, ``hook_k_input``, ``hook_v_input`` ``[b, p, h, d_model]`` (TransformerLens'
  ``use_split_qkv_input``, computed only while hooked): the block input once per head, each head's query, key (its
  rope key included) and value computed from its own copy through the latents (:class:`LatentHeadInputSite`), so
  that edge attribution gets query, key and value edges.

An edit changes everything downstream as the model would have computed it. The model computes one rope key and
expands it over the heads, so an edit of ``hook_k``/``hook_rot_k`` (any columns, any head) reaches the keys the
attention function gets (the rotated edited keys in place of the elements it changed, through
:meth:`~lensadapters.hooks.attention.InterfacePatternBackend.route_keys`), and, where the model caches those per-head
keys (transformers 4), what the cache stores. Refused by name: an edit of ``hook_k``/``hook_rot_k``/``hook_v``
during cached generation where the model caches the latents and decompresses the earlier positions again at every
step (transformers 5). A backward hook on ``hook_rot_k`` gets the gradient of the keys the attention function gets
(per head), on ``hook_k`` that gradient through rotary; the gradients before them then flow through this site's
per-head keys (the same, to rounding, as the model's own backward, which sums the heads' before rotary).
``W_K``/``W_V`` (and ``W_Q`` with a query latent) are refused (:func:`refused_weight`: an RMS norm of the latent
lies between the down- and up-projections, so no matrix maps the residual to them); :func:`latent_weights` gives the
exact per-head maps from the latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from lensadapters.errors import HookReturnError
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.rotary import apply_rotate_half, invert_rotate_half
from lensadapters.hooks.sites import (
    OutputSite,
    Site,
    completes_output,
    first_input,
    first_output,
    replace_first_output,
)
from lensadapters.hooks.sites.qkv import rotary_angles
from lensadapters.hooks.specs import RotarySpec, SeparateQKV

Tensor = torch.Tensor
#: the layouts of the rope columns :func:`latent_rotary` applies
ROPE_LAYOUTS = ("rotate_half", "interleaved", "complex")
#: the points a latent attention adds to the core's
LATENT_POINTS = ("attn.hook_q_latent", "attn.hook_k_rope", "attn.hook_kv_latent")


@dataclass(frozen=True)
class LatentAttention:
    """One layer's multi-head latent attention (paths relative to the block; see the module docstring).

    ``q`` gives the per-head queries ``[h * (nope + rope)]``: the up-projection of the query latent (``q_down`` then
    the norm ``q_norm``, whose output is ``hook_q_latent``), or, with neither, a projection of the attention input.
    ``kv_down``'s output is ``[kv latent (kv_rank) | shared rope key (rope)]``, ``kv_norm`` normalizes the latent and
    ``kv_up`` maps it to ``[no-rope key (nope) | value (v_head_dim)]`` per head. ``rotary`` rotates the rope columns
    ``[nope:]`` of ``[..., nope + rope]`` (:func:`latent_rotary`)."""

    q: str
    kv_down: str
    kv_norm: str
    kv_up: str
    heads: int
    kv_rank: int
    nope: int
    rope: int
    v_head_dim: int
    rotary: Optional[RotarySpec] = None
    q_down: Optional[str] = None
    q_norm: Optional[str] = None

    @property
    def d_head(self) -> int:
        return self.nope + self.rope

    def qkv(self) -> "LatentQKV":
        """The core's view of the projections (the layer's ``lensadapters_attn_qkv``): ``hook_q`` and ``hook_rot_q``
        from ``q``; the keys, values and per-head inputs are this form's own points (:func:`latent_sites`: the
        core's head-input site does not serve them), the rope columns shared."""
        return LatentQKV(
            self.q,
            self.kv_up,
            self.kv_up,
            rotary=self.rotary,
            head_inputs=False,
            shared_key_columns=self.rope,
            latent=self,
        )

    def modules(self) -> tuple[str, ...]:
        """Every module path the form names."""
        q = (self.q_down, self.q_norm) if self.q_down is not None and self.q_norm is not None else ()
        return (*q, self.q, self.kv_down, self.kv_norm, self.kv_up)


@dataclass(frozen=True)
class LatentQKV(SeparateQKV):
    """The :class:`SeparateQKV` of a latent attention (:meth:`LatentAttention.qkv`), which carries its form."""

    latent: Optional[LatentAttention] = None


def form_of(hooked: Any, layer: int) -> Optional[LatentAttention]:
    """Layer ``layer``'s latent attention form (``None``: the layer has none); ``hooked``: a wiring or a model."""
    wiring = hooked.wiring if hasattr(hooked, "wiring") else hooked
    qkv = wiring.qkv_layouts[layer]
    return qkv.latent if isinstance(qkv, LatentQKV) else None


def three_d(t: Tensor) -> Tensor:
    """``[b, 1, p, f]`` (a latent viewed as one head, as transformers 5 caches it) as ``[b, p, f]``."""
    return t.flatten(1, -2) if t.dim() == 4 else t


def _unrotate_pairs(y1: Tensor, y2: Tensor, c: Tensor, s: Tensor, dtype: Any) -> Tensor:
    """The pairs ``(x1, x2)`` that ``(x1 c - x2 s, x2 c + x1 s) == (y1, y2)``, interleaved, in ``dtype`` (computed in
    at least float32)."""
    c, s = (t.to(torch.promote_types(dtype, torch.float32)) for t in (c, s))
    y1, y2 = y1.to(c.dtype), y2.to(c.dtype)
    norm = c * c + s * s
    x1, x2 = (y1 * c + y2 * s) / norm, (y2 * c - y1 * s) / norm
    return torch.stack((x1, x2), dim=-1).flatten(-2).to(dtype)


def latent_rotary(nope: int, rope: int, layout: str = "rotate_half") -> RotarySpec:
    """Rotary on the rope columns ``[nope:]`` of ``[b, p, h, nope + rope]``: ``"rotate_half"``; ``"interleaved"``
    pairs ``(x[2i], x[2i+1])`` rotated and laid out ``[even' | odd']`` (the table ``[..., rope]`` in rotate-half
    layout, its first half used); or ``"complex"``: the interleaved pairs as complex numbers times ``cos + i sin``
    (a table of one angle per pair, ``[b, p, rope/2]``), in float32, kept interleaved and cast back."""
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"layout={layout!r}: one of {', '.join(ROPE_LAYOUTS)}")
    complex_pairs = layout == "complex"

    def parts(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        if complex_pairs:  # one angle per pair already
            return cos.unsqueeze(2).float(), sin.unsqueeze(2).float()
        return cos[..., : rope // 2].unsqueeze(2), sin[..., : rope // 2].unsqueeze(2)

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        head, r = x[..., :nope], x[..., nope:]
        if layout == "rotate_half":
            return torch.cat((head, apply_rotate_half(r, cos, sin)), dim=-1)
        c, s = parts(cos, sin)
        if complex_pairs:
            x1, x2 = r[..., 0::2].float(), r[..., 1::2].float()
            pairs = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
            return torch.cat((head, pairs.to(x.dtype)), dim=-1)
        x1, x2 = r[..., 0::2], r[..., 1::2]
        return torch.cat((head, x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    def invert(y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        head, r = y[..., :nope], y[..., nope:]
        if layout == "rotate_half":
            return torch.cat((head, invert_rotate_half(r, cos, sin)), dim=-1)
        y1, y2 = (r[..., 0::2], r[..., 1::2]) if complex_pairs else (r[..., : rope // 2], r[..., rope // 2 :])
        return torch.cat((head, _unrotate_pairs(y1, y2, *parts(cos, sin), y.dtype)), dim=-1)

    return RotarySpec(rope, apply, invert)


class LatentKVSite(Site):
    """``attn.hook_k_rope``, ``hook_k``, ``hook_rot_k`` and ``hook_v`` of one layer (see the module docstring).

    The down-projection's output gives the shared rope key (an edit replaces its columns); the up-projection's the
    per-head no-rope keys and values (an edit of ``hook_v`` replaces its rows of this forward's positions: a model
    caching the latents runs it over the cached positions too). An edit of the keys is made on the keys the
    attention function gets (or the cache of per-head keys stores). ``served``: the names of the points served (the
    others, absent, are never hooked here).
    """

    def __init__(
        self,
        hooked: Any,
        layer: int,
        form: LatentAttention,
        served: Optional[Iterable[str]] = None,
        inputs: Optional["LatentHeadInputSite"] = None,
    ) -> None:
        self.hooked, self.state, self.form, self.inputs = hooked, hooked.forward_state, form, inputs
        self.attention = hooked.attention_modules[layer]
        block = hooked.block_modules[layer]
        self.kv_a, self.kv_b = block.get_submodule(form.kv_down), block.get_submodule(form.kv_up)
        self.rank, self.nope, self.rope, self.v = form.kv_rank, form.nope, form.rope, form.v_head_dim
        self.heads, self.layer, self._routed = form.heads, layer, False
        pre = f"blocks.{layer}.attn."
        names = ("hook_k_rope", "hook_k", "hook_rot_k", "hook_v")
        allowed = set(names if served is None else (n.rsplit(".", 1)[-1] for n in served))
        self.k_rope, self.k, self.rot_k, self.v_point = (
            hooked.point(pre + n) if n in allowed else HookPoint(pre + n, lambda p: None) for n in names
        )
        self.points = tuple(p for p, n in zip((self.k_rope, self.k, self.rot_k, self.v_point), names) if n in allowed)
        if inputs is not None:  # the head inputs' key and value edits are made here (LatentHeadInputSite)
            self.points += tuple(p for p in (inputs.attn_in, inputs.k_input, inputs.v_input) if p is not None)

    def _keys_wanted(self) -> bool:
        return self.k.active or self.rot_k.active or (self.inputs is not None and self.inputs.feeds_keys())

    def signature(self) -> tuple[bool, ...]:
        # the angles and the route of the keys through the attention function only while a key point is hooked
        return (self.wanted(), self._keys_wanted())

    def install(self) -> list[Any]:
        handles = [self.kv_a.register_forward_hook(self._kv_a), self.kv_b.register_forward_hook(self._kv_b)]
        self._routed = False
        if self._keys_wanted():
            # the layer's (cos, sin), as the model hands them to its attention, and its cache
            handles.append(self.attention.register_forward_pre_hook(self._before_attention, with_kwargs=True))
            route = getattr(self.hooked.pattern_backend, "route_keys", None)
            if route is not None:  # the keys' edit reaches the attention function (else an edit is refused)
                handles.append(route(self.layer, self._edit_keys))
                self._routed = True
        return handles

    def _before_attention(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        angles = kwargs.get("position_embeddings")
        complex_angles = isinstance(angles, torch.Tensor) and angles.is_complex()
        if not (complex_angles or (isinstance(angles, (tuple, list)) and len(angles) == 2)):
            raise RuntimeError(
                f"{self.rot_k.name}: {type(module).__name__} was called without its rotary (cos, sin) or complex "
                "rotations as position_embeddings"
            )
        values = self._values()
        values["angles"] = rotary_angles(angles)
        values.pop("keys", None)
        for name in CACHE_ARGUMENTS:  # a cache of per-head keys gets the edited ones (transformers 4's)
            cache = kwargs.get(name)
            if cache is not None:
                return args, {**kwargs, name: _KeyEditingCache(cache, self._edit_cached_keys)}
        return None

    def _values(self) -> dict[str, Any]:
        return self.state.site_values(self)

    def _kv_a(self, module: nn.Module, args: tuple, output: Any) -> Any:
        out = first_output(output)
        rope, changed = self.k_rope.apply(out[..., self.rank :], protect=True)
        self._values()["k_rope"] = rope
        if not changed:
            return None
        return replace_first_output(output, torch.cat((out[..., : self.rank], rope.to(out.dtype)), dim=-1))

    def _kv_b(self, module: nn.Module, args: tuple, output: Any) -> Any:
        raw = first_output(output)
        values = self._values()
        rope = values.get("k_rope")
        if rope is None:  # pragma: no cover - the down-projection runs first
            return None
        out = raw.flatten(1, -2)  # a model caching the latents runs it on the latent viewed as one head
        p = rope.shape[-2]
        new = out[:, out.shape[1] - p :].unflatten(-1, (self.heads, self.nope + self.v))
        k_nope, v = new[..., : self.nope], new[..., self.nope :]
        k = torch.cat((k_nope, rope.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope).to(k_nope.dtype)), dim=-1)
        # the head inputs' edits (hook_attn_in, hook_k_input, hook_v_input), before hook_k and hook_v see them
        dk, dv = self.inputs.take_kv() if self.inputs is not None else (None, None)
        edited_k, k_changed = self.k.apply(k if dk is None else _plus(k, dk), protect=True)
        k_changed = k_changed or dk is not None
        rotated = edited = None
        if k_changed or self.rot_k.active:
            assert self.form.rotary is not None
            cos, sin = values["angles"]
            rotated = self.form.rotary.apply(k, cos, sin)
            edited = self.form.rotary.apply(edited_k, cos, sin) if k_changed else rotated
        rot_changed = False
        if self.rot_k.active:
            assert edited is not None  # computed above whenever hook_rot_k is hooked
            edited, rot_changed = self.rot_k.apply(edited, protect=True)
        edited_v, v_changed = self.v_point.apply(v if dv is None else _plus(v, dv), protect=True)
        v_changed = v_changed or dv is not None
        if (k_changed or rot_changed or v_changed) and out.shape[1] != p:
            raise HookReturnError(
                f"an edit of {self.k.name.rsplit('.', 1)[0]}.hook_k/hook_rot_k/hook_v (or of the block's "
                "hook_attn_in/hook_k_input/hook_v_input) during cached generation: "
                "the model caches the latents and decompresses the earlier positions again at every step, so the "
                "edit would be lost there; edit attn.hook_kv_latent or attn.hook_k_rope, or generate with "
                "use_cache=False"
            )
        if k_changed or rot_changed:
            if not self._routed:
                raise HookReturnError(
                    f"an edit of {self.k.name} or {self.rot_k.name} (or of the block's hook_attn_in/hook_k_input): "
                    "this model's attention is not served through transformers' attention interface, where the "
                    "per-head keys are edited; edit hook_k_rope or hook_kv_latent instead"
                )
            assert rotated is not None and edited is not None
            values["keys"] = (rotated, edited)  # what the attention function (or the cache) gets, and instead
        if not v_changed:
            return None
        merged = torch.cat((k_nope, edited_v), dim=-1).flatten(-2)
        return replace_first_output(output, merged.to(out.dtype).reshape(raw.shape))

    def _edited(self, keys: Tensor) -> Tensor:
        """``keys`` ``[b, h, p, d]`` (the model's rotated keys of this forward's positions) with this forward's edit:
        each changed element the edited key's, every other as the model computed it (the two rotaries may round
        apart), and autograd's path through the edited keys (an edit that changes nothing at ``p = 0`` of
        ``x + p * c`` still has its derivative)."""
        rotated, edited = self._values().pop("keys")
        before, after = (t.transpose(1, 2).to(keys.dtype) for t in (rotated, edited))
        chosen = torch.where(after != before, after, keys)
        # the values are ``chosen``'s exactly: where ``keys`` differs from ``after`` it is by rounding, and the
        # difference of two floats that close is exact (Sterbenz), so adding it back gives ``keys``
        out = after + (chosen - after).detach()
        # in the model's layout too (the attention kernels round a transposed operand differently)
        return out.contiguous() if keys.is_contiguous() else out

    def _edit_cached_keys(self, keys: Tensor) -> Tensor:
        pending = self._values().get("keys")
        if pending is None or keys.shape[:-1] != pending[0].transpose(1, 2).shape[:-1]:
            return keys  # no edit, or the latents a transformers 5 model caches (before the up-projection runs)
        return self._edited(keys)

    def _edit_keys(self, keys: Tensor) -> Tensor:
        pending = self._values().get("keys")
        if pending is None:
            return keys
        if keys.shape[-2] != pending[0].shape[1]:
            raise HookReturnError(
                f"an edit of {self.k.name} or {self.rot_k.name}: the attention function got "
                f"{keys.shape[-2]} key positions, this forward computed {pending[0].shape[1]}, and the cache was not "
                "given to the attention module by name; generate with use_cache=False"
            )
        return self._edited(keys)


def _plus(t: Tensor, delta: Tensor) -> Tensor:
    """``t + delta``, added in ``delta``'s (wide) dtype and cast back to ``t``'s."""
    return (t.to(delta.dtype) + delta).to(t.dtype)


#: TransformerLens' per-head input points, in the order they fire
HEAD_INPUTS = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")


class LatentHeadInputSite(Site):
    """``hook_attn_in``, ``hook_q_input``, ``hook_k_input`` and ``hook_v_input`` of one latent layer
    (TransformerLens' ``use_attn_in``/``use_split_qkv_input``): the block input before the attention norm, one copy
    per head ``[b, p, h, d_model]``, head ``h``'s query (``hook_q_input``), key (``hook_k_input``) or value
    (``hook_v_input``) computed from its own copy; ``hook_attn_in`` feeds all three of its head and fires first.

    Computed only while hooked, on the attention norm's input. Where a copy is edited, that head's query is
    ``q_up_h(q_norm(q_down(ln1(copy))))`` (``q_h(ln1(copy))`` without a query latent), its key
    ``[kv_up_h(kv_norm(kv_down(ln1(copy))[:rank])) | kv_down(ln1(copy))[rank:]]`` before rotary (the rope key its
    own: every other head keeps the shared one) and its value ``kv_up_h``'s value columns of the same latent: the
    down-projections and norms are the model's own modules run on the copies (their ``forward``, no hook of theirs
    fires), the up-projection that head's slice of the live effective weight (``read_linear``), in at least
    float32. The difference from the unedited copy enters the query projection's output (before ``hook_q`` sees
    it) and the keys and values :class:`LatentKVSite` gives ``hook_k``/``hook_v`` and the attention function;
    heads whose copy is left as it was keep the model's numbers, and the gradient of every copy is the exact
    derivative of that head's query, key or value (an edit's path stays in the autograd graph). An edit of the
    keys or values during cached generation where the model caches the latents is refused by name, as
    ``hook_k``'s."""

    def __init__(self, hooked: Any, layer: int, form: LatentAttention, points: dict[str, HookPoint]) -> None:
        self.hooked, self.state, self.form, self.layer = hooked, hooked.forward_state, form, layer
        self.attn_in, self.q_input = points.get("hook_attn_in"), points.get("hook_q_input")
        self.k_input, self.v_input = points.get("hook_k_input"), points.get("hook_v_input")
        self.points = tuple(points[n] for n in HEAD_INPUTS if n in points)
        block, layout = hooked.block_modules[layer], hooked.block_layouts[layer]
        self.norm = None if layout.ln1 is None else block.get_submodule(layout.ln1)
        self.entry = self.norm if self.norm is not None else block.get_submodule(layout.attn)
        get = block.get_submodule
        self.q_module = get(form.q)
        self.q_down = get(form.q_down) if form.q_down is not None and form.q_norm is not None else None
        self.q_norm = get(form.q_norm) if self.q_down is not None and form.q_norm is not None else None
        self.kv_down, self.kv_norm, self.kv_up = get(form.kv_down), get(form.kv_norm), get(form.kv_up)
        self.scale = float(getattr(layout, "attn_in_scale", 1.0))

    def _active(self, point: Optional[HookPoint]) -> bool:
        return point is not None and point.active

    def feeds_keys(self) -> bool:
        """Whether an edit here may reach the keys (the keys' route through the attention function is needed)."""
        return self._active(self.attn_in) or self._active(self.k_input)

    @property
    def _pending(self) -> dict:
        return self.state.site_values(self)

    def take_kv(self) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The pending changes of the keys ``[b, p, h, nope + rope]`` and values ``[b, p, h, v]`` (``None``: none)."""
        pending = self._pending
        return pending.pop("k", None), pending.pop("v", None)

    def install(self) -> list[Any]:
        return [
            self.entry.register_forward_pre_hook(self._inputs, with_kwargs=True),
            completes_output(self.q_module, self._queries),
        ]

    def _inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        pending = self._pending
        pending.clear()
        x = first_input(args, kwargs)
        heads = self.form.heads
        base = x.unsqueeze(-2)
        attn_in, attn_changed = None, False
        if self._active(self.attn_in):
            assert self.attn_in is not None
            attn_in, attn_changed = self.attn_in.apply(base.repeat_interleave(heads, dim=-2), protect=True)
        streams: dict[str, tuple[Tensor, bool]] = {}
        for which, point in (("q", self.q_input), ("k", self.k_input), ("v", self.v_input)):
            start = attn_in.clone() if attn_in is not None and attn_changed else base.repeat_interleave(heads, -2)
            value, changed = point.apply(start, protect=True) if point is not None and point.active else (start, False)
            streams[which] = (value, changed or attn_changed)
        if not any(changed for _, changed in streams.values()):
            return None
        reference = dict(zip("qkv", self._projected(base, streams)))  # the model's, from the one unedited input
        for which, (value, changed) in streams.items():
            if not changed:
                continue
            edited, unedited = self._projected(value, {which: (value, True)})["qkv".index(which)], reference[which]
            assert edited is not None and unedited is not None
            # heads whose copy was left as it was add an exact zero (the model's numbers), but keep the autograd
            # path: an edit that leaves the value unchanged (x + p*c at p = 0) still has its gradient
            rows = (value != base).any(-1, keepdim=True)
            diff = edited - unedited
            pending[which] = torch.where(rows, diff, diff - diff.detach())
        return None

    def _projected(self, copies: Tensor, wanted: dict[str, tuple[Tensor, bool]]) -> list[Optional[Tensor]]:
        """Each head's query, key (before rotary) and value from its copy ``[b, p, h or 1, d_model]`` (one copy:
        every head's from it), ``None`` where ``wanted`` has no changed stream of that kind; in at least float32."""
        read = self.norm.forward(copies) if self.norm is not None else copies
        if self.scale != 1.0:  # the constant the block multiplies the norm's output by (BlockLayout.attn_in_scale)
            read = read * self.scale
        wide = torch.promote_types(read.dtype, torch.float32)
        heads, nope = self.form.heads, self.form.nope

        def expand(t: Tensor) -> Tensor:
            return t.expand(*t.shape[:-2], heads, t.shape[-1])

        out: list[Optional[Tensor]] = [None, None, None]
        if wanted.get("q", (None, False))[1]:
            if self.q_down is not None and self.q_norm is not None:
                latent = self.q_norm.forward(self.q_down.forward(read))
            else:
                latent = read
            out[0] = _per_head(self.hooked, self.q_module, expand(latent), heads, wide)
        if wanted.get("k", (None, False))[1] or wanted.get("v", (None, False))[1]:
            down = self.kv_down.forward(read)
            rank = self.form.kv_rank
            kv = _per_head(self.hooked, self.kv_up, expand(self.kv_norm.forward(down[..., :rank])), heads, wide)
            if wanted.get("k", (None, False))[1]:
                out[1] = torch.cat((kv[..., :nope], expand(down[..., rank:]).to(wide)), dim=-1)
            if wanted.get("v", (None, False))[1]:
                out[2] = kv[..., nope:]
        return out

    def _queries(self, module: nn.Module, args: tuple, output: Any) -> Any:
        delta = self._pending.pop("q", None)
        if delta is None:
            return None
        out = first_output(output)
        shaped = out.unflatten(-1, (self.form.heads, -1))
        return replace_first_output(output, _plus(shaped, delta).flatten(-2))


def _per_head(hooked: Any, module: nn.Module, x: Tensor, heads: int, wide: torch.dtype) -> Tensor:
    """Head ``h``'s slice of the linear ``module``'s output on its own row ``x[..., h, :]`` (``[b, p, h, f]``), from
    the live effective weight, in ``wide``."""
    lw = hooked.read_linear(module)
    W = lw.W.to(wide).unflatten(-1, (heads, -1))  # [d_in, h, d_head]
    out = torch.einsum("...hi,ihd->...hd", x.to(wide), W)
    return out if lw.b is None else out + lw.b.to(wide).unflatten(-1, (heads, -1))


#: the names transformers passes an attention module its cache by
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache")


class _KeyEditingCache:
    """The cache an attention module gets while its keys are edited: ``update`` stores (and returns) the edited keys
    of this forward's positions; everything else is the model's cache's."""

    def __init__(self, cache: Any, edit: Any) -> None:
        self._cache, self._edit = cache, edit

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._cache.update(self._edit(key_states), value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def latent_points(hooked: Any, layer: int, form: LatentAttention) -> list[str]:
    """Create layer ``layer``'s latent points (the per-head inputs after ``hook_resid_pre``, ``hook_q_latent``
    before ``hook_q``, ``hook_k_rope`` and ``hook_kv_latent`` after ``hook_rot_q``) and claim the core's key and value
    points; their names."""
    pre = f"blocks.{layer}.attn."
    names, anchor = [], f"blocks.{layer}.hook_resid_pre"
    for name in HEAD_INPUTS:
        anchor = hooked.new_point(f"blocks.{layer}.{name}", after=anchor).name
        names.append(anchor)
    if form.q_norm is not None:
        names.append(hooked.new_point(pre + "hook_q_latent", before=pre + "hook_q").name)
    names.append(hooked.new_point(pre + "hook_k_rope", after=pre + "hook_rot_q").name)
    names.append(hooked.new_point(pre + "hook_kv_latent", after=pre + "hook_k_rope").name)
    return names + [hooked.claim_point(pre + n).name for n in ("hook_k", "hook_rot_k", "hook_v")]


def latent_layer_sites(
    hooked: Any, layer: int, form: LatentAttention, served: Optional[Iterable[str]] = None
) -> list[Site]:
    """The sites of layer ``layer``'s latent points (made by :func:`latent_points`), of those ``served`` (all by
    default)."""
    block, pre = hooked.block_modules[layer], f"blocks.{layer}.attn."
    names = set(hooked.hook_dict if served is None else served)
    sites: list[Site] = []
    if form.q_norm is not None and pre + "hook_q_latent" in names:
        sites.append(OutputSite(block.get_submodule(form.q_norm), hooked.point(pre + "hook_q_latent")))
    if pre + "hook_kv_latent" in names:
        sites.append(OutputSite(block.get_submodule(form.kv_norm), hooked.point(pre + "hook_kv_latent")))
    inputs = {n: hooked.point(f"blocks.{layer}.{n}") for n in HEAD_INPUTS if f"blocks.{layer}.{n}" in names}
    head_inputs = LatentHeadInputSite(hooked, layer, form, inputs) if inputs else None
    if head_inputs is not None:
        sites.append(head_inputs)
    mine = [pre + n for n in ("hook_k_rope", "hook_k", "hook_rot_k", "hook_v")]
    if any(n in names for n in mine) or head_inputs is not None:
        sites.append(LatentKVSite(hooked, layer, form, [n for n in mine if n in names], head_inputs))
    return sites


def latent_sites(hooked: Any) -> list[Site]:
    """Every latent layer's points and their sites (a plugin's ``lensadapters_extra_sites``)."""
    sites: list[Site] = []
    for layer in range(len(hooked.block_modules)):
        form = form_of(hooked, layer)
        if form is not None:
            latent_points(hooked, layer, form)
            sites += latent_layer_sites(hooked, layer, form)
    return sites


def _linear(wiring: Any, module: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    lw = wiring.read_linear(module)
    return lw.W, lw.b


def latent_weights(hm: Any, layer: int) -> dict[str, Any]:
    """The exact per-head linear maps of layer ``layer``'s latent attention, as TransformerLens-shaped tensors read
    from the live parameters: ``W_Q_latent`` ``[h, q_rank, d_head]`` (``hook_q == hook_q_latent @ W_Q_latent``;
    ``W_Q`` ``[h, d_model, d_head]`` from the attention input where there is no query latent), ``W_K_latent``
    ``[h, kv_rank, nope]`` and ``W_V_latent`` ``[h, kv_rank, v_head_dim]`` (the no-rope keys and the values from
    ``hook_kv_latent``), ``W_K_rope`` ``[d_model, rope]`` and ``b_K_rope`` (``hook_k_rope`` from the attention
    input), and ``W_Q_down``/``W_KV_down`` ``(W, b)``, the down-projections into the latents before their norms."""
    wiring = hm.wiring if hasattr(hm, "wiring") else hm
    form = form_of(wiring, layer)
    if form is None:
        raise ValueError(f"layer {layer} has no multi-head latent attention")
    block = wiring.block_modules[layer]
    get = block.get_submodule
    out: dict[str, Any] = {}
    W, _ = _linear(wiring, get(form.q))
    out["W_Q" if form.q_norm is None else "W_Q_latent"] = W.unflatten(-1, (form.heads, -1)).permute(1, 0, 2)
    if form.q_down is not None:
        out["W_Q_down"] = _linear(wiring, get(form.q_down))
    W_b, _ = _linear(wiring, get(form.kv_up))
    W_b = W_b.unflatten(-1, (form.heads, form.nope + form.v_head_dim)).permute(1, 0, 2)
    out["W_K_latent"], out["W_V_latent"] = W_b[..., : form.nope], W_b[..., form.nope :]
    W_a, b_a = _linear(wiring, get(form.kv_down))
    out["W_KV_down"] = (W_a[:, : form.kv_rank], None if b_a is None else b_a[: form.kv_rank])
    out["W_K_rope"] = W_a[:, form.kv_rank :]
    out["b_K_rope"] = None if b_a is None else b_a[form.kv_rank :]
    return out


_REFUSED = {"_W_K": "W_K", "_b_K": "b_K", "_W_V": "W_V", "_b_V": "b_V", "W_K": "W_K", "W_V": "W_V"}


def refused_weight(hooked: Any, name: str) -> Optional[str]:
    """Why the weight ``name`` is not served for the wiring ``hooked`` (``None``: it is, or no layer has latent
    attention): ``W_K``/``W_V`` and their biases, and ``W_Q``/``b_Q`` where a layer has a query latent."""
    forms = [f for f in (form_of(hooked, i) for i in range(len(hooked.block_modules))) if f is not None]
    with_q_latent = any(f.q_norm is not None for f in forms)
    if not forms or not (name in _REFUSED or (with_q_latent and name in ("W_Q", "b_Q"))):
        return None
    shown = _REFUSED.get(name, name)
    what = "queries" if shown[-1] == "Q" else "keys" if shown[-1] == "K" else "values"
    return (
        f"{shown}: multi-head latent attention RMS-normalizes a latent between its down- and up-projections, so no "
        f"matrix maps the residual to the per-head {what}; lensadapters.plugin_api.latent_weights(hm, layer) "
        "gives the exact maps from the latents "
        "(attn.hook_q_latent, attn.hook_kv_latent) and the shared rope key's"
    )
