"""A gated DeltaNet (linear attention with a recurrent state: transformers' ``*GatedDeltaNet`` modules) in the
description language: its points and the site that serves them, for a plugin to attach to its linear-attention
layers (:func:`gated_deltanet_site`). What differs between models is how the input projections are laid out
(:class:`DeltaNetProjections`): separate ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a`` modules
(:data:`SEPARATE_PROJECTIONS`), or two fused ones, ``in_proj_qkvz`` and ``in_proj_ba``, whose outputs are grouped per
key head (:data:`FUSED_PER_KEY_HEAD`: for key head ``g`` of ``hk``, with ``r = hv / hk`` value heads per key head,
``in_proj_qkvz`` gives ``[q_g (dk) | k_g (dk) | v_g (r*dv) | z_g (r*dv)]`` and ``in_proj_ba`` gives
``[b_g (r) | a_g (r)]``, the value heads of group ``g`` being ``g*r ... g*r + r - 1``).

Points (relative to ``blocks.{i}.``; ``hk``/``hv`` key/value heads, ``dk``/``dv`` their sizes), in the order they
fire, the same names for either layout:

* ``linear_attn.hook_qkv`` ``[b, p, 2*hk*dk + hv*dv]``: the convolution's input, the queries, keys and values of
  every head in the convolution's channel order ``[q (head-major) | k | v]``. Separate projections: ``in_proj_qkv``'s
  output. Fused: those columns of ``in_proj_qkvz``'s output, regrouped from per key head to per role as the model
  regroups them before its convolution;
* ``linear_attn.hook_z`` ``[b, p, hv, dv]``: the gate of the output norm (``in_proj_z``'s output, or the ``z``
  columns of ``in_proj_qkvz``'s output per value head);
* ``linear_attn.hook_b`` / ``hook_a`` ``[b, p, hv]``: the beta and decay logits per value head (``in_proj_b``/
  ``in_proj_a``'s outputs, or the ``b``/``a`` columns of ``in_proj_ba``'s output);
* ``linear_attn.hook_conv`` ``[b, p, 2*hk*dk + hv*dv]``: the causal depthwise convolution's output after its
  activation;
* ``linear_attn.hook_q`` / ``hook_k`` ``[b, p, hk, dk]``, ``hook_v`` ``[b, p, hv, dv]``: that output split per head
  (before the delta rule's L2 norm of queries and keys, and before any repetition of the key heads over the value
  heads);
* ``linear_attn.hook_beta`` ``[b, p, hv]``: ``sigmoid(b)``, the write strength;
* ``linear_attn.hook_decay`` ``[b, p, hv]`` (float32): ``g = -exp(A_log) * softplus(a + dt_bias)``, the log of the
  state's decay per token;
* ``linear_attn.hook_recurrent`` ``[b, p, hv, dv]``: the delta rule's output, before the gated norm;
* ``linear_attn.hook_gated`` ``[b, p, hv, dv]``: the gated norm's output (``norm(recurrent) * silu(z)``), the input
  of ``out_proj``;
* the mixer's output is the block's ``hook_attn_out`` (a core point).

While one of them is hooked, the mixer is computed a second time here when the model calls ``out_proj`` (its last
step), from the module's input and its input projections' outputs as the model computed them (each projection runs
once: a hook on one, a LoRA delta point, fires once), with the module's own submodules and transformers' own
functions of its modeling module (the convolution and delta-rule functions the model's forward calls: module-level
ones on transformers 5, the ones transformers 4 binds to the module), in the model's order, each point applied where
its value is made; an edit of a per-role view of a fused projection is what the model continues with (the same as
that edit made in the fused output: the model only regroups it). ``out_proj``'s input is replaced only when a hook
changed something (``out_proj`` runs once, on what the model continues with), and then the layer's convolution and
recurrent states in the cache are the edited computation's (generation continues from them); otherwise they are
bitwise the model's own.

The recurrent state ``[b, hv, dk, dv]`` is not a point: transformers' delta rule keeps it inside the function (the
chunked form never has the per-token states) and returns only the last one, and only with a cache.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.nn import functional as F

from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import Site, first_output, reads_output
from lensadapters.hooks.specs import ProjectionParts

Tensor = torch.Tensor
GATED_DELTANET_POINTS = (
    "hook_qkv",
    "hook_z",
    "hook_b",
    "hook_a",
    "hook_conv",
    "hook_q",
    "hook_k",
    "hook_v",
    "hook_beta",
    "hook_decay",
    "hook_recurrent",
    "hook_gated",
)
PREFIX = "linear_attn."


@dataclass(frozen=True)
class DeltaNetProjections:
    """How a gated DeltaNet's input projections are laid out (paths relative to the mixer module): ``separate``, the
    four modules ``qkv``, ``z``, ``b``, ``a``; or ``fused`` (``qkvz``, ``ba``), grouped per key head (see the
    module docstring)."""

    qkv: Optional[str] = None
    z: Optional[str] = None
    b: Optional[str] = None
    a: Optional[str] = None
    qkvz: Optional[str] = None
    ba: Optional[str] = None

    @property
    def fused(self) -> bool:
        return self.qkvz is not None

    def paths(self) -> tuple[str, ...]:
        """The projection modules, relative to the mixer."""
        fields = (self.qkvz, self.ba) if self.fused else (self.qkv, self.z, self.b, self.a)
        return tuple(p for p in fields if p is not None)


SEPARATE_PROJECTIONS = DeltaNetProjections(qkv="in_proj_qkv", z="in_proj_z", b="in_proj_b", a="in_proj_a")
FUSED_PER_KEY_HEAD = DeltaNetProjections(qkvz="in_proj_qkvz", ba="in_proj_ba")
#: the mixer's other modules, relative to it
DELTANET_MODULES = ("conv1d", "norm", "out_proj")


def gated_deltanet_paths(projections: DeltaNetProjections) -> tuple[str, ...]:
    """Every module a gated DeltaNet of that layout needs, relative to the mixer."""
    return (*projections.paths(), *DELTANET_MODULES)


def gated_deltanet_point_names() -> list[str]:
    """The points' names relative to ``blocks.{i}.``, in the order they fire."""
    return [PREFIX + p for p in GATED_DELTANET_POINTS]


def split_per_key_head(mixer: Any, qkvz: Tensor, ba: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The fused projections' outputs as ``(qkv [.., 2*hk*dk + hv*dv], z [.., hv, dv], b [.., hv], a [.., hv])``,
    regrouped from per key head to per role (the convolution's channel order)."""
    split_qkvz, _, split_ba, _ = _per_key_head(mixer)
    return (*split_qkvz(qkvz), *split_ba(ba))


def _per_key_head(mixer: Any) -> tuple[Any, Any, Any, Any]:
    """``(split_qkvz, merge_qkvz, split_ba, merge_ba)``: each fused projection's output (any leading dimensions:
    activations, weight columns) regrouped from per key head to per role (``(qkv, z)``, ``(b, a)``: see
    :func:`split_per_key_head`), and back."""
    hk, hv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    r = hv // hk

    def split_qkvz(qkvz: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v, z = qkvz.unflatten(-1, (hk, 2 * dk + 2 * r * dv)).split([dk, dk, r * dv, r * dv], dim=-1)
        qkv = torch.cat((q.flatten(-2), k.flatten(-2), v.flatten(-2)), dim=-1)
        return qkv, z.reshape(*qkvz.shape[:-1], hv, dv)

    def merge_qkvz(qkv: Tensor, z: Tensor) -> Tensor:
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        grouped = (q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hk, r * dv)))
        return torch.cat((*grouped, z.reshape(*z.shape[:-2], hk, r * dv)), dim=-1).flatten(-2)

    def split_ba(ba: Tensor) -> tuple[Tensor, Tensor]:
        b, a = ba.unflatten(-1, (hk, 2 * r)).split([r, r], dim=-1)
        return b.reshape(*ba.shape[:-1], hv), a.reshape(*ba.shape[:-1], hv)

    def merge_ba(b: Tensor, a: Tensor) -> Tensor:
        return torch.cat((b.unflatten(-1, (hk, r)), a.unflatten(-1, (hk, r))), dim=-1).flatten(-2)

    return split_qkvz, merge_qkvz, split_ba, merge_ba


def _projection_parts(pre: str, mixer: Any, projections: DeltaNetProjections) -> list[ProjectionParts]:
    """The parts of each input projection's output, as the points ``linear_attn.hook_qkv``/``hook_z``/``hook_b``/
    ``hook_a`` of layer prefix ``pre`` show them (every projection runs before ``hook_qkv``)."""
    name = {role: f"{pre}{PREFIX}hook_{role}" for role in ("qkv", "z", "b", "a")}
    first = name["qkv"]
    get = mixer.get_submodule
    if projections.fused:
        assert projections.qkvz is not None and projections.ba is not None
        split_qkvz, merge_qkvz, split_ba, merge_ba = _per_key_head(mixer)
        return [
            ProjectionParts(get(projections.qkvz), (name["qkv"], name["z"]), split_qkvz, merge_qkvz, first),
            ProjectionParts(get(projections.ba), (name["b"], name["a"]), split_ba, merge_ba, first),
        ]
    dv = mixer.head_v_dim
    parts = []
    for role in ("qkv", "z", "b", "a"):
        path = getattr(projections, role)
        if role == "z":  # per value head
            split, merge = (lambda t: (t.unflatten(-1, (-1, dv)),)), (lambda z: z.flatten(-2))
        else:
            split, merge = (lambda t: (t,)), (lambda t: t)
        parts.append(ProjectionParts(get(path), (name[role],), split, merge, first))
    return parts


class _CacheSnapshot:
    """One linear-attention layer's cache as it is now, to go back to: the fields of its cache layer (transformers
    5: states, flags and lazily set fields) or its entries of the per-layer state lists (transformers 4's hybrid
    caches: ``conv_states``, ``recurrent_states``)."""

    LISTS = ("conv_states", "recurrent_states")

    def __init__(self, cache: Any, layer: int) -> None:
        self.cache, self.index = cache, layer
        self.layered = hasattr(cache, "layers")
        if self.layered:
            self.layer = cache.layers[layer]
            self.fields = {name: _copy(value) for name, value in vars(self.layer).items()}
        else:
            self.fields = {name: _copy(getattr(cache, name)[layer]) for name in self.LISTS if hasattr(cache, name)}

    def restore(self) -> None:
        if not self.layered:
            for name, saved in self.fields.items():
                states = getattr(self.cache, name)
                states[self.index] = _into(states[self.index], saved)
            return
        for name, saved in self.fields.items():
            current = getattr(self.layer, name, None)
            if isinstance(saved, dict) and isinstance(current, dict):  # per state index (transformers 5.2x)
                for key in [key for key in current if key not in saved]:
                    del current[key]
                for key, value in saved.items():
                    current[key] = _into(current.get(key), value)
            elif isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
                current[:] = [_into(old, value) for old, value in zip(current, saved)]
            else:
                setattr(self.layer, name, saved)


def _into(current: Any, value: Any) -> Any:
    """``value`` written into the cache's tensor ``current`` when the shapes agree (the cache keeps its static
    addresses), else ``value`` itself."""
    if isinstance(value, Tensor) and isinstance(current, Tensor) and current.shape == value.shape:
        return current.copy_(value)
    return value


def _copy(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _copy(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


@dataclass
class _Call:
    hidden: Tensor
    cache: Any
    mask: Optional[Tensor]
    cache_position: Optional[Tensor]


class GatedDeltaNetSite(Site):
    """Every ``linear_attn.*`` point of one gated DeltaNet layer (see the module docstring)."""

    def __init__(self, mixer: Any, points: dict[str, HookPoint], state: Any, projections: DeltaNetProjections) -> None:
        self.module, self.state, self.projections = mixer, state, projections
        self.p = points
        self.points = tuple(points[PREFIX + n] for n in GATED_DELTANET_POINTS)
        self.modeling = sys.modules[type(mixer).__module__]

    def install(self) -> list[Any]:
        m = self.module
        handles = [m.register_forward_pre_hook(self._record, with_kwargs=True)]
        for path in self.projections.paths():  # their outputs as the model computed them (a LoRA delta's edit in)
            handles.append(reads_output(m.get_submodule(path), self._capture(path)))
        # the mixer's output is out_proj's: its input is replaced where a point changed something, so that
        # out_proj (and a hook on it: a LoRA delta point) runs once, on what the model continues with
        handles.append(m.out_proj.register_forward_pre_hook(self._recompute))
        return handles

    def _capture(self, path: str) -> Any:
        def capture(module: Any, args: tuple, output: Any) -> None:
            self.state.site_values(self).setdefault("projected", {})[path] = first_output(output)

        return capture

    def _record(self, module: Any, args: tuple, kwargs: dict) -> None:
        values = self.state.site_values(self)
        values.clear()
        hidden = args[0] if args else kwargs["hidden_states"]
        # the layer's cache: ``cache`` from transformers 5.24, ``cache_params`` before
        cache = kwargs["cache"] if "cache" in kwargs else kwargs.get("cache_params")
        values["call"] = _Call(hidden, cache, kwargs.get("attention_mask"), kwargs.get("cache_position"))
        values["snapshot"] = _CacheSnapshot(cache, module.layer_idx) if cache is not None else None

    def _recompute(self, out_proj: Any, args: tuple) -> Any:
        """At ``out_proj``'s call (the mixer's last step): the mixer computed again from its input with the points
        applied; ``out_proj``'s input replaced by the result where a point changed something."""
        values = self.state.site_values(self)
        call: Optional[_Call] = values.pop("call", None)
        if call is None:  # pragma: no cover - out_proj called outside the mixer's forward
            return None
        snapshot: Optional[_CacheSnapshot] = values.pop("snapshot")
        projected: dict[str, Tensor] = values.pop("projected", {})
        m = self.module
        if snapshot is not None:  # run from the states the module started from; they end as the edited run's
            kept = _CacheSnapshot(call.cache, m.layer_idx)
            snapshot.restore()
        gated, changed = self.forward(m, call, projected)
        if not changed:
            if snapshot is not None:
                kept.restore()  # bitwise the model's own states
            return None
        return (gated, *args[1:])

    def _apply(self, name: str, value: Tensor, changed: bool) -> tuple[Tensor, bool]:
        new, edit = self.p[PREFIX + name].apply(value, protect=True)
        return new, changed or edit

    def _project(self, m: Any, hidden: Tensor, projected: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(qkv, z, b, a)``: the projections' outputs the model computed from the mixer's input in this call
        (``projected``; each projection computed here from ``hidden`` where it was not seen)."""

        def out(path: Optional[str]) -> Tensor:
            assert path is not None
            seen = projected.get(path)
            return seen if seen is not None else m.get_submodule(path)(hidden)

        p = self.projections
        if p.fused:
            return split_per_key_head(m, out(p.qkvz), out(p.ba))
        z = out(p.z)
        return out(p.qkv), z.reshape(*z.shape[:-1], -1, m.head_v_dim), out(p.b), out(p.a)

    def forward(self, m: Any, call: _Call, projected: Optional[dict[str, Tensor]] = None) -> tuple[Tensor, bool]:
        """The mixer's forward up to ``out_proj``'s input ``[b, p, hv * dv]``, with the points applied where their
        values are made (and whether one changed)."""
        ap, changed = self._apply, False
        hidden = self.modeling.apply_mask_to_padding_states(call.hidden, call.mask)
        bsz, seq, _ = hidden.shape
        qkv, z, b, a = self._project(m, hidden, projected or {})
        qkv, changed = ap("hook_qkv", qkv, changed)
        z, changed = ap("hook_z", z, changed)
        b, changed = ap("hook_b", b, changed)
        a, changed = ap("hook_a", a, changed)
        # transformers 4 binds its kernels (or their torch fallbacks) to the module and keeps per-layer state lists
        bound = hasattr(m, "chunk_gated_delta_rule")
        conv = self._conv_bound(m, qkv, call) if bound else self._conv(m, qkv, call)
        conv, changed = ap("hook_conv", conv.transpose(1, 2), changed)
        query, key, value = torch.split(conv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        query, changed = ap("hook_q", query.reshape(bsz, seq, -1, m.head_k_dim), changed)
        key, changed = ap("hook_k", key.reshape(bsz, seq, -1, m.head_k_dim), changed)
        value, changed = ap("hook_v", value.reshape(bsz, seq, -1, m.head_v_dim), changed)
        beta, changed = ap("hook_beta", b.sigmoid(), changed)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        g, changed = ap("hook_decay", g, changed)
        rule = self._rule_bound if bound else self._rule
        core = rule(m, query, key, value, g, beta, call)
        core, changed = ap("hook_recurrent", core, changed)
        gated = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(core.shape)
        gated, changed = ap("hook_gated", gated, changed)
        return gated.reshape(bsz, seq, -1), changed

    # transformers 5: module-level functions, the cache's state accessors --------------------------------------------

    def _conv(self, m: Any, qkv: Tensor, call: _Call) -> Tensor:
        f, cache, seq = self.modeling, call.cache, qkv.shape[1]
        conv_state = cache.get_conv_state(m.layer_idx, state_idx=0) if cache is not None else None
        mixed = qkv.transpose(1, 2)
        weight = m.conv1d.weight.squeeze(1)
        if conv_state is not None and seq == 1 and not cache.is_recording_past(m.layer_idx):
            return f.causal_conv1d_update(mixed, conv_state, weight, m.conv1d.bias, m.activation)
        if cache is not None:
            mixed = cache.update_conv_state(mixed, m.layer_idx, conv_kernel_size=m.conv_kernel_size)
        mixed = f.causal_conv1d_fn(mixed, weight, m.conv1d.bias, activation=m.activation)
        return mixed[:, :, -seq:] if cache is not None else mixed

    def _rule(self, m: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, call: _Call) -> Tensor:
        f, cache = self.modeling, call.cache
        recurrent_state = cache.get_recurrent_state(m.layer_idx, state_idx=0) if cache is not None else None
        stepwise = recurrent_state is not None and q.shape[1] == 1
        rule = f.torch_recurrent_gated_delta_rule if stepwise else f.torch_chunk_gated_delta_rule
        core, last = rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=recurrent_state,
            output_final_state=cache is not None,
            use_qk_l2norm_in_kernel=True,
        )
        if cache is not None:
            cache.update_recurrent_state(last, m.layer_idx)
        return core

    # transformers 4: kernels bound to the module, per-layer state lists ----------------------------------------------

    @staticmethod
    def _precomputed(m: Any, seq: int, call: _Call) -> bool:
        cache = call.cache
        return cache is not None and cache.has_previous_state and seq == 1 and call.cache_position is not None

    def _conv_bound(self, m: Any, qkv: Tensor, call: _Call) -> Tensor:
        cache, seq = call.cache, qkv.shape[1]
        mixed = qkv.transpose(1, 2)
        weight = m.conv1d.weight.squeeze(1)
        if self._precomputed(m, seq, call):
            return m.causal_conv1d_update(mixed, cache.conv_states[m.layer_idx], weight, m.conv1d.bias, m.activation)
        if cache is not None:
            cache.conv_states[m.layer_idx] = F.pad(mixed, (m.conv_kernel_size - mixed.shape[-1], 0))
        if m.causal_conv1d_fn is not None:
            return m.causal_conv1d_fn(x=mixed, weight=weight, bias=m.conv1d.bias, activation=m.activation, seq_idx=None)
        return F.silu(m.conv1d(mixed)[:, :, :seq])

    def _rule_bound(self, m: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, call: _Call) -> Tensor:
        cache = call.cache
        ratio = m.num_v_heads // m.num_k_heads
        if ratio > 1:
            q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
        precomputed = self._precomputed(m, q.shape[1], call)
        rule = m.recurrent_gated_delta_rule if precomputed else m.chunk_gated_delta_rule
        core, last = rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=cache.recurrent_states[m.layer_idx] if precomputed else None,
            output_final_state=cache is not None,
            use_qk_l2norm_in_kernel=True,
        )
        if cache is not None:
            cache.recurrent_states[m.layer_idx] = last
        return core


def gated_deltanet_site(
    hooked: Any, layer: int, mixer: Any, projections: DeltaNetProjections, after: Optional[str] = None
) -> GatedDeltaNetSite:
    """The site of block ``layer``'s gated DeltaNet ``mixer`` (``hooked`` the plugin-facing model, in
    ``lensadapters_extra_sites``): its points created in firing order after ``after`` (default the block's
    ``ln1.hook_normalized``), and its input projections' parts declared (``hooked.declare_projection_parts``: the
    ``hook_qkv``/``hook_z``/``hook_b``/``hook_a`` each projection's output holds, and ``out_proj``'s output, the
    block's ``hook_attn_out`` where the block adds the mixer's output as it is: so that a LoRA delta on one is shown
    split alike)."""
    pre = f"blocks.{layer}."
    previous = after or pre + "ln1.hook_normalized"
    points = {}
    for name in gated_deltanet_point_names():
        points[name] = hooked.new_point(pre + name, after=previous)
        previous = pre + name
    for parts in _projection_parts(pre, mixer, projections):
        hooked.declare_projection_parts(parts)
    bl = hooked.block_layouts[layer]
    if (
        bl is not None
        and bl.ln1_post is None
        and not bl.scaled
        and hooked.block_modules[layer].get_submodule(bl.attn) is mixer
    ):  # the block's hook_attn_out is the mixer's output, out_proj's (whole, one part)
        out = f"{pre}hook_attn_out"
        hooked.declare_projection_parts(ProjectionParts(mixer.out_proj, (out,), lambda t: (t,), lambda t: t))
    return GatedDeltaNetSite(mixer, points, hooked.forward_state, projections)
