"""The automatic description: for a model no plugin claims, the declarative description a plugin would write
(``ModelLayout`` with rotary and final norm, and per layer ``BlockLayout``, ``SeparateQKV``/``FusedQKV`` and
``MLPLayout``/``FusedGateUp``), read from the probe forward pass (:mod:`.probe`) and the config, never from a table
of names. Every claim is checked on the probe's values, against what the model's own modules computed:

* **pre-norms** (``ln1``/``ln2``): a direct child of the layer that computes LayerNorm or RMSNorm of its input with
  its own weight (offset ``0`` or ``1``, ``eps`` read from the module), whose output is exactly the input of the
  attention module (``ln1``) or of the MLP module (``ln2``); the block is *parallel* when the MLP reads ``ln1``'s
  output or ``ln2`` reads the layer's input, *sequential* when ``ln2`` (or the MLP) reads ``resid_pre + attn_out``;
* **output projection**: the linear module inside the attention module whose input is the attention function's
  output (heads merged) and whose output is the attention module's output;
* **values**: the linear module (or the values' part of one fused projection, laid out ``[q | k | v]`` or per head
  ``[heads, (q | k | v), d]``) whose output, split into heads, is the value tensor the model passes to the attention
  function (a module wrapping a linear one is not a candidate: its child is);
* **queries and keys**: the two other projections whose outputs, through the q/k norms found between them and the
  attention function (a norm module inside the attention module reading the projection's output per head or over
  the whole width) and then rotary (rotate-half or interleaved pairs on the first ``partial_rotary_factor`` of each
  head, with the ``(cos, sin)`` the model's rotary module returned, or the real and imaginary parts of the complex
  table it returned; or none, layer by layer), and then a norm the attention module applies after rotary
  (:mod:`.rotated_norm`), are the query and key tensors the model passes to the attention function;
* **multi-head latent attention** where no projection gives the values (:mod:`.latent`): the down- and
  up-projections, the latents' norms, the rope columns and their rotary;
* **MLP**: the linear module whose output is the MLP module's output (``W_out``), and the one or two (or one fused
  gate-up) projections reading the MLP's input, such that the activation named by the config (or the module's
  ``act_fn``, or else SiLU or ReLU, which no other activation passes for) reproduces the down projection's input:
  ``act(gate) * up`` (gated) or ``act(pre)`` (plain).

What fails is not described (the layer stays opaque, served by the generic adapter's own points) and the reason
is kept for the warning. A description is then *verified* at wrap time point by point (:mod:`.verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from lensadapters.adapters.generic.moe import describe_other_mlp
from lensadapters.adapters.generic.norms import NormBehaviour, norm_behaviour
from lensadapters.adapters.generic.probe import InterfaceCall, Recording, _close
from lensadapters.adapters.generic.rotated_norm import RotatedNorm, norm_after_rotary
from lensadapters.adapters.vlm import text_config
from lensadapters.hooks.rotary import half_table_rotate_half_spec, rotate_half_spec
from lensadapters.hooks.sites.qkv import rotary_angles
from lensadapters.hooks.specs import (
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    MLPLayout,
    ProjectionNorm,
    RotarySpec,
    SeparateQKV,
    cat_gate_up,
    chunk_gate_up,
)

Tensor = torch.Tensor
QKV = Union[SeparateQKV, FusedQKV]
MLP = Union[MLPLayout, FusedGateUp]


#: activations tried (each checked on the probe) after the MLP module's own and the config's: none of them can pass
#: for another on the probe (GELU's exact and tanh forms can, on small inputs: neither is guessed)
COMMON_ACTIVATIONS = ("silu", "relu")


class NotDescribed(Exception):
    """A layer (or the model) cannot be described: the message says which claim failed."""


@dataclass
class LayerDescription:
    block: BlockLayout
    qkv: QKV
    mlp: Any  # MLP, a MoELayout (:mod:`.moe`), or OpaqueMLP (its inside not described: why)
    norms: dict[str, NormBehaviour]  # path relative to the layer -> how it normalizes
    gated: bool
    act_fn: Optional[str]
    attn_out: Optional[str] = None  # the module whose output is hook_attn_out, where it is not ``block.attn``'s
    #: norms the attention module applies to the rotated queries/keys ("q"/"k"), :mod:`.rotated_norm`
    rotated_norms: dict[str, RotatedNorm] = field(default_factory=dict)


@dataclass
class Description:
    """The automatic description of a model (``layers[i]`` ``None``: layer ``i`` stays opaque, ``why[i]`` says why)."""

    layers: list[Optional[LayerDescription]]
    rotary: Optional[str] = None  # path of the rotary module outside the layers
    rotary_input: Optional[str] = None  # or the attention modules' argument carrying each layer's (cos, sin)
    #: or, with ``rotary`` the first layer's attention module, its rotary module called on its inputs
    rotary_from_inputs: Optional[Callable[..., tuple[Tensor, Tensor]]] = None
    rotary_dim: Optional[int] = None
    why: dict[int, str] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return any(layer is not None for layer in self.layers)


def _is_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) or (
        isinstance(weight, Tensor) and weight.dim() == 2 and "Linear" in type(module).__name__
    )


def _activation(module: nn.Module, config: Any) -> list[tuple[Optional[str], Callable[[Tensor], Tensor]]]:
    """Candidate activations: the MLP module's own (``act_fn``, ``act``, ``activation_fn``...), then the config's,
    then :data:`COMMON_ACTIVATIONS`."""
    from transformers.activations import ACT2FN

    found: list[tuple[Optional[str], Callable[[Tensor], Tensor]]] = []
    for name in ("act_fn", "act", "activation_fn", "activation", "act_func"):
        fn = getattr(module, name, None)
        if callable(fn):
            found.append((None, fn))
    # a parameter-free child module of the MLP (Bloom's ``gelu_impl``): the activation where it reproduces the values
    found += [(None, child) for child in module.children() if next(child.parameters(), None) is None]
    for key in ("hidden_act", "hidden_activation", "activation_function", "act_fn"):
        act_name = getattr(config, key, None)
        if isinstance(act_name, str) and act_name in ACT2FN:
            found.append((act_name, ACT2FN[act_name]))
    names = [n for n, _ in found if n is not None]
    # then the common activations under their own names (a module that calls F.silu and names none in its config)
    return [(names[0] if names else n, fn) for n, fn in found] + [(n, ACT2FN[n]) for n in COMMON_ACTIVATIONS]


def _rotate_pairs(x: Tensor) -> Tensor:
    """``(x0, x1, x2, x3...)`` to ``(-x1, x0, -x3, x2...)``: the rotation of interleaved pairs."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def interleaved_spec(rotary_dim: int, from_half_layout: bool, once: bool = False) -> RotarySpec:
    """RoPE on interleaved pairs of the first ``rotary_dim`` dimensions of each head (``x * cos + pairs(x) * sin``).
    ``from_half_layout``: the rotary module returns the table in rotate-half layout (``cat(freqs, freqs)``), which the
    attention turns into the interleaved one (``cos[..., :r/2].repeat_interleave(2)``). ``once``: the table holds
    each pair's angle once (``r/2`` entries: a complex table ``e^{i theta}`` read as ``(real, imag)``, which the
    attention multiplies each pair, seen as a complex number, by), repeated for both members of the pair."""

    def table(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        if from_half_layout:
            cos, sin = (t[..., : t.shape[-1] // 2] for t in (cos, sin))
        if from_half_layout or once:
            cos, sin = (t.repeat_interleave(2, dim=-1) for t in (cos, sin))
        return cos.unsqueeze(-2), sin.unsqueeze(-2)

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        c, s = table(cos, sin)
        r = c.shape[-1]
        if r > x.shape[-1] or r != rotary_dim:
            raise RuntimeError(f"rotary dimension {r} does not fit heads of size {x.shape[-1]}")
        x_rot, x_pass = x[..., :r], x[..., r:]
        rotated = (x_rot.float() * c.float() + _rotate_pairs(x_rot.float()) * s.float()).to(x.dtype)
        return rotated if r == x.shape[-1] else torch.cat([rotated, x_pass], dim=-1)

    def invert(y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        c, s = (t.float() for t in table(cos, sin))
        r = c.shape[-1]
        y_rot, y_pass = y[..., :r].float(), y[..., r:]
        x_rot = ((y_rot * c - _rotate_pairs(y_rot) * s) / (c * c + s * s)).to(y.dtype)
        return x_rot if r == y.shape[-1] else torch.cat([x_rot, y_pass], dim=-1)

    return RotarySpec(rotary_dim, apply, invert)


def fused_qkv_split(heads: int, kv: int, d: int) -> tuple[Callable[..., Any], Callable[..., Tensor]]:
    """``(split, merge)`` of one projection's ``[q | k | v]`` output, each part as ``[..., heads, d]``."""
    widths = [heads * d, kv * d, kv * d]

    def split(t: Tensor) -> tuple[Tensor, ...]:
        return tuple(part.unflatten(-1, (part.shape[-1] // d, d)) for part in t.split(widths, dim=-1))

    def merge(*parts: Tensor) -> Tensor:
        return torch.cat([part.flatten(-2) for part in parts], dim=-1)

    return split, merge


def per_head_qkv_split(heads: int, d: int) -> tuple[Callable[..., Any], Callable[..., Tensor]]:
    """``(split, merge)`` of one projection's output laid out per head, ``[heads, (q | k | v), d]``."""

    def split(t: Tensor) -> tuple[Tensor, ...]:
        parts = t.unflatten(-1, (heads, 3, d))
        return parts[..., 0, :], parts[..., 1, :], parts[..., 2, :]

    def merge(*parts: Tensor) -> Tensor:
        return torch.stack(parts, dim=-2).flatten(-3)

    return split, merge


def reversed_rotate_half_spec(rotary_dim: int) -> RotarySpec:
    """Rotate-half RoPE turning the other way: ``x * cos + cat(x2, -x1) * sin`` (NanoChat's ``rotate_half``), which
    is rotate-half with ``sin`` negated (bitwise: a product with a negated factor is the negated product)."""
    half = rotate_half_spec(rotary_dim)
    return RotarySpec(
        rotary_dim, lambda x, cos, sin: half.apply(x, cos, -sin), lambda y, cos, sin: half.invert(y, cos, -sin)
    )


def _rotary_candidates(d_head: int, config: Any, cos: Tensor) -> list[RotarySpec]:
    """Rotate-half (table of ``r`` or ``r/2`` entries) and interleaved pairs (table of ``r`` entries, or ``r/2``: a
    complex table), on the whole head or on the first dimensions the table covers (partial rotary): each is tried on
    the probe's queries and keys."""
    dims = dict.fromkeys([d_head, cos.shape[-1], 2 * cos.shape[-1]])
    specs = []
    for r in dims:
        if r % 2 or r > d_head:
            continue
        if cos.shape[-1] == r:
            specs += [rotate_half_spec(r), interleaved_spec(r, False), interleaved_spec(r, True)]
            specs.append(reversed_rotate_half_spec(r))
        if 2 * cos.shape[-1] == r:
            specs += [half_table_rotate_half_spec(r), interleaved_spec(r, False, once=True)]
    return specs


def _heads(t: Tensor, heads: int) -> Tensor:
    """``[b, p, heads * d]`` as ``[b, p, heads, d]``."""
    return t.unflatten(-1, (heads, t.shape[-1] // heads))


def _norm_between(
    rec: Recording, i: int, attn: str, proj_out: Tensor, heads: int
) -> list[tuple[Optional[ProjectionNorm], Optional[str], Tensor]]:
    """``(norm, path, per-head output)``: no norm, or each norm module inside the attention module reading
    ``proj_out`` (whole width, per head, or per head after the transpose)."""
    options: list[tuple[Optional[ProjectionNorm], Optional[str], Tensor]] = [(None, None, _heads(proj_out, heads))]
    prefix = attn + "."
    per_head = _heads(proj_out, heads)
    for (layer, path), (x, y) in rec.inner.items():
        if layer != i or not path.startswith(prefix) or x is None or y is None:
            continue
        if _close(x, proj_out):
            options.append((ProjectionNorm(path, "bpf"), path, _heads(y, heads)))
        elif _close(x, per_head):
            options.append((ProjectionNorm(path, "bphd"), path, y))
        elif _close(x, per_head.transpose(1, 2)):
            options.append((ProjectionNorm(path, "bhpd"), path, y.transpose(1, 2)))
    return options


def _match_rotated(
    options: list[tuple[Optional[ProjectionNorm], Optional[str], Tensor]],
    target: Tensor,
    rotaries: list[Optional[RotarySpec]],
    cos_sin: Optional[tuple[Tensor, Tensor]],
    after: Optional[Callable[[Tensor, Tensor], Optional[RotatedNorm]]] = None,
) -> Optional[tuple[Optional[ProjectionNorm], Optional[str], Optional[RotarySpec], Optional[RotatedNorm]]]:
    """The (norm, rotary, norm after rotary) under which a projection's output is ``target`` (``[b, heads, p, d]``);
    ``after`` finds a norm the attention module applies to the rotated values (:mod:`.rotated_norm`)."""
    want = target.transpose(1, 2)
    rotated: list[tuple[Optional[RotarySpec], Tensor]] = []  # with no norm before rotary: for a norm after it
    for norm, path, value in options:
        for spec in rotaries:
            if spec is None:
                got = value
            elif cos_sin is None:
                continue
            else:
                try:
                    got = spec.apply(value, *cos_sin)
                except RuntimeError:
                    continue
            if _close(got, want):
                return norm, path, spec, None
            if norm is None:
                rotated.append((spec, got))
    # a norm after rotary only where none before it fits (a norm of each head with unit weights commutes with
    # rotary on the probe: it is the one the model calls before, where the model calls one before)
    if after is None:
        return None
    for spec, got in rotated:
        post = after(got, want)
        if post is not None:
            return None, None, spec, post
    return None


def _keep_rotated_norms(
    into: Optional[dict[str, RotatedNorm]], q: Optional[RotatedNorm], k: Optional[RotatedNorm]
) -> None:
    """The queries' and keys' norms after rotary into ``into``; one module read at the same call by both is not
    what the model does (the claim is wrong), and so is one role's norm being another's first call."""
    if into is None:
        return
    if q is not None and k is not None and q.module == k.module and q.call == k.call:
        raise NotDescribed(f"the norm after rotary {q.module} reads the queries and the keys in the same call")
    for norm in (q, k):  # a later call only of a module whose first call (recorded) read the other's rotated values
        if (
            norm is not None
            and norm.call
            and not any(o is not None and o.module == norm.module for o in (q, k) if o is not norm)
        ):
            raise NotDescribed(f"the probe did not see {norm.module} read rotated queries or keys")
    into.update({role: norm for role, norm in (("q", q), ("k", k)) if norm is not None})


def _qk_norm_behaviours(
    layer: nn.Module, rec: Recording, i: int, paths: tuple[Optional[str], ...], norms: dict[str, NormBehaviour]
) -> None:
    """Each q/k norm's behaviour into ``norms``; one that is not LayerNorm or RMSNorm is not described."""
    for path in paths:
        if path is not None:
            x, y = rec.inner[(i, path)]
            behaviour = norm_behaviour(layer.get_submodule(path), x, y) if x is not None and y is not None else None
            if behaviour is None or behaviour.eps is None:
                raise NotDescribed(f"the q/k norm {path} is not LayerNorm or RMSNorm of its input with a readable eps")
            norms[path] = behaviour


def _describe_attention(
    layer: nn.Module,
    i: int,
    attn: str,
    call: InterfaceCall,
    rec: Recording,
    rotary: list[Optional[RotarySpec]],
    cos_sin: Optional[tuple[Tensor, Tensor]],
    attn_in: Tensor,
    attn_out: Tensor,
    rotated_norms: Optional[dict[str, RotatedNorm]] = None,
) -> tuple[QKV, str, dict[str, NormBehaviour]]:
    """The layer's queries, keys and values, output projection and q/k norms; ``rotated_norms`` (where given) gets
    the norms the attention module applies after rotary (:mod:`.rotated_norm`), which are tried only then."""
    prefix = attn + "."
    post_norm = norm_after_rotary(layer, rec, i, attn) if rotated_norms is not None else None
    heads, kv, d = call.heads, call.kv_heads, call.d_head
    assert call.query is not None and call.key is not None and call.value is not None
    linears: dict[str, Any] = {  # the linear modules (not a wrapper around one, whose output is its child's)
        path[len(prefix) :]: io
        for (layer_i, path), io in rec.inner.items()
        if layer_i == i
        and path.startswith(prefix)
        and io[0] is not None
        and io[1] is not None
        and _is_linear(layer.get_submodule(path))
    }
    z = call.output.value.flatten(-2)  # [b, p, heads * d]
    o_proj = [p for p, (x, y) in linears.items() if _close(x, z) and _close(y, attn_out)]
    if len(o_proj) != 1:
        if any(_close(y, attn_out) for x, y in linears.values()):
            raise NotDescribed(
                "the output projection's input is not the attention function's output: the attention module changes "
                "it in between (an output gate or a norm), which no declarative form describes"
            )
        raise NotDescribed("no single linear module maps the attention function's output to the attention output")
    readers: dict[str, Any] = {p: y for p, (x, y) in linears.items() if _close(x, attn_in) and p != o_proj[0]}
    norms: dict[str, NormBehaviour] = {}
    value_t = call.value.transpose(1, 2)  # [b, p, kv, d]
    fused = [p for p, y in readers.items() if y.shape[-1] == (heads + 2 * kv) * d]
    if fused and len(readers) == 1:
        layouts = [fused_qkv_split(heads, kv, d)] + ([per_head_qkv_split(heads, d)] if heads == kv else [])
        split, merge = next(((s, m) for s, m in layouts if _close(s(readers[fused[0]])[2], value_t)), (None, None))
        if split is None or merge is None:
            raise NotDescribed(
                "neither the fused projection's last part nor its third part of each head is the values the "
                "attention function gets"
            )
        q, k, v = split(readers[fused[0]])
        q_options, k_options = (_norm_between(rec, i, attn, t.flatten(-2), n) for t, n in ((q, heads), (k, kv)))
        q_match = _match_rotated(q_options, call.query, rotary, cos_sin, post_norm)
        k_match = _match_rotated(k_options, call.key, rotary, cos_sin, post_norm)
        if q_match is None or k_match is None or q_match[2] is not k_match[2]:
            raise NotDescribed(
                "the fused projection's queries and keys, through a q/k norm and rotated, are not what attention gets"
            )
        _qk_norm_behaviours(layer, rec, i, (q_match[1], k_match[1]), norms)
        _keep_rotated_norms(rotated_norms, q_match[3], k_match[3])
        fused_qkv = FusedQKV(
            f"{attn}.{fused[0]}", split, merge, rotary=q_match[2], q_norm=q_match[0], k_norm=k_match[0]
        )
        return fused_qkv, f"{attn}.{o_proj[0]}", norms
    values = [p for p, y in readers.items() if y.shape[-1] == kv * d and _close(_heads(y, kv), value_t)]
    if len(values) != 1:
        raise NotDescribed("no single projection of the attention input is the values the attention function gets")
    rest = [p for p in readers if p != values[0]]
    found: dict[str, tuple[str, Optional[ProjectionNorm], Optional[str], Optional[RotarySpec], Optional[RotatedNorm]]]
    found = {}
    for role, target, n in (("q", call.query, heads), ("k", call.key, kv)):
        for p in rest:
            if readers[p].shape[-1] != n * d or p in [f[0] for f in found.values()]:
                continue
            match = _match_rotated(_norm_between(rec, i, attn, readers[p], n), target, rotary, cos_sin, post_norm)
            if match is not None:
                found[role] = (p, *match)
                break
        if role not in found:
            raise NotDescribed(
                f"no projection of the attention input gives the {'queries' if role == 'q' else 'keys'} the attention "
                f"function gets, through a q/k norm, a rotary embedding (rotate-half or interleaved pairs) and a norm "
                f"after it"
            )
    (qp, qn, qpath, qrot, qpost), (kp, kn, kpath, krot, kpost) = found["q"], found["k"]
    if qrot is not krot:
        raise NotDescribed("queries and keys rotate differently")
    _qk_norm_behaviours(layer, rec, i, (qpath, kpath), norms)
    _keep_rotated_norms(rotated_norms, qpost, kpost)
    # the order the model runs them: the norms right after their projection, or after all three projections
    order = [p for (layer_i, p) in rec.inner if layer_i == i]
    after = qn is not None and order.index(f"{attn}.{values[0]}") < order.index(qn.module)
    qkv = SeparateQKV(
        f"{attn}.{qp}",
        f"{attn}.{kp}",
        f"{attn}.{values[0]}",
        rotary=qrot,
        q_norm=qn,
        k_norm=kn,
        norms_after_projections=after,
    )
    return qkv, f"{attn}.{o_proj[0]}", norms


def _describe_mlp(
    model: nn.Module, layer: nn.Module, i: int, mlp: str, rec: Recording
) -> tuple[MLP, bool, Optional[str]]:
    prefix = mlp + "."
    x, y = rec.inner.get((i, mlp), (None, None))
    if x is None or y is None:
        raise NotDescribed("the probe saw no input or output of the MLP module")
    linears: dict[str, Any] = {
        path[len(prefix) :]: io
        for (layer_i, path), io in rec.inner.items()
        if layer_i == i and path.startswith(prefix) and _is_linear(layer.get_submodule(path)) and io[0] is not None
    }
    down = [p for p, (a, b) in linears.items() if _close(b, y)]
    readers = [p for p, (a, b) in linears.items() if _close(a, x) and p not in down]
    if len(down) != 1 or not 1 <= len(readers) <= 2:
        raise NotDescribed("the MLP is not one or two projections of its input and one output projection")
    post = linears[down[0]][0]
    acts = _activation(layer.get_submodule(mlp), text_config(model))
    out = f"{mlp}.{down[0]}"
    for name, act in acts:
        if len(readers) == 2:
            for gate, up in (readers, readers[::-1]):
                if _close(act(linears[gate][1]) * linears[up][1], post):
                    return MLPLayout(f"{mlp}.{gate}", out, f"{mlp}.{up}"), True, name
        else:
            pre = linears[readers[0]][1]
            if pre is not None and pre.shape[-1] == 2 * post.shape[-1]:
                gate_t, up_t = chunk_gate_up(pre)
                if _close(act(gate_t) * up_t, post):
                    return FusedGateUp(f"{mlp}.{readers[0]}", out, chunk_gate_up, cat_gate_up), True, name
            elif _close(act(pre), post):
                return MLPLayout(f"{mlp}.{readers[0]}", out), False, name
    raise NotDescribed("no activation named by the config or the MLP module reproduces the down projection's input")


def describe_layer(
    model: nn.Module,
    layer: nn.Module,
    i: int,
    found: Any,
    rec: Recording,
    rotary: list[Optional[RotarySpec]],
    cos_sin: Optional[tuple[Tensor, Tensor]],
) -> LayerDescription:
    if "hook_resid_pre" not in found.points:
        raise NotDescribed("the layer's input and output are not the residual stream (see hook_resid_pre)")
    calls = [c for c in rec.calls if c.layer == i] or [c for c in rec.own_calls if c.layer == i]
    if len(calls) != 1 or calls[0].query is None:
        raise NotDescribed(
            "the layer does not call transformers' attention interface exactly once"
            + (f", and {rec.own_why[i]}" if i in rec.own_why else "")
        )
    attn = found.attn or next(
        (n for n, c in layer.named_children() if any(m is calls[0].module for m in c.modules())), None
    )
    if attn is None:
        raise NotDescribed("the attention function is called with no module of the layer")
    others = [n for n, c in layer.named_children() if n != attn and any(p.dim() >= 2 for p in c.parameters())]
    mlp = found.mlp or (others[0] if len(others) == 1 else None)
    if mlp is None:
        raise NotDescribed("the layer has not exactly one MLP module beside its attention module")
    resid_pre, resid_post = rec.layer_in[i].value, rec.layer_out[i].value
    attn_in, attn_out = rec.inner.get((i, attn), (None, None))
    mlp_in, mlp_out = rec.inner.get((i, mlp), (None, None))
    if attn_in is None or attn_out is None or mlp_in is None or mlp_out is None:
        raise NotDescribed("the probe did not see the attention and MLP modules' inputs and outputs")
    norms: dict[str, NormBehaviour] = {}
    roles: dict[str, Optional[str]] = dict.fromkeys(("ln1", "ln2", "ln1_post", "ln2_post"))
    for name, child in layer.named_children():
        if name in (attn, mlp):
            continue
        x, y = rec.inner.get((i, name), (None, None))
        if x is None or y is None:
            continue
        behaviour = norm_behaviour(child, x, y)
        if behaviour is None or behaviour.eps is None:  # a scale is served only with the module's own eps
            continue
        for role, fits in (
            ("ln1", _close(x, resid_pre) and _close(y, attn_in)),
            ("ln1_post", _close(x, attn_out)),
            ("ln2_post", _close(x, mlp_out)),
            ("ln2", _close(y, mlp_in)),
        ):
            if fits and roles[role] is None:
                roles[role], norms[name] = name, behaviour
                break
    ln1, ln2, ln1_post, ln2_post = roles["ln1"], roles["ln2"], roles["ln1_post"], roles["ln2_post"]
    if ln1 is None and not _close(attn_in, resid_pre):
        raise NotDescribed("the attention module reads neither the layer's input nor a pre-norm of it")
    attn_branch: Any = rec.inner[(i, ln1_post)][1] if ln1_post is not None else attn_out
    mlp_branch: Any = rec.inner[(i, ln2_post)][1] if ln2_post is not None else mlp_out
    mid = resid_pre + attn_branch
    mlp_reads = rec.inner[(i, ln2)][0] if ln2 is not None else mlp_in
    if ln2 is None and ln1 is not None and _close(mlp_in, attn_in):
        parallel = True  # both branches read ln1's output (one shared pre-norm)
    elif _close(mlp_reads, mid):
        parallel = False
    elif _close(mlp_reads, resid_pre):
        parallel = True
    else:
        raise NotDescribed("the MLP reads neither a pre-norm of resid_pre + attn_out nor of resid_pre")
    if parallel and (ln1_post is not None or ln2_post is not None):
        raise NotDescribed("a parallel block with norms after its branches")
    if not _close(resid_post, (resid_pre if parallel else mid) + mlp_branch + (attn_branch if parallel else 0)):
        raise NotDescribed("the layer's output is not its input plus its attention and MLP branches")
    rotated_norms: dict[str, RotatedNorm] = {}
    try:
        qkv, o_proj, qk_norms = _describe_attention(
            layer, i, attn, calls[0], rec, rotary, cos_sin, attn_in, attn_out, rotated_norms
        )
    except NotDescribed:  # multi-head latent attention? (.latent)
        from lensadapters.adapters.generic.latent import describe_latent_attention

        latent = describe_latent_attention(layer, i, attn, calls[0], rec, cos_sin, attn_in, attn_out)
        if latent is None:
            raise
        (qkv, o_proj), qk_norms = latent, {}
    norms.update(qk_norms)
    mlp_layout: Any
    try:
        mlp_layout, gated, act_fn = _describe_mlp(model, layer, i, mlp, rec)
    except NotDescribed:  # a mixture of experts: the rest of the layer is described all the same (see .moe)
        mlp_layout, gated, act_fn = describe_other_mlp(model, layer, i, mlp, rec, ln2_post is not None), True, None
        if mlp_layout is None:
            raise
    block = BlockLayout(
        ln1=ln1, attn=attn, o_proj=o_proj, ln2=ln2, mlp=mlp, parallel=parallel, ln1_post=ln1_post, ln2_post=ln2_post
    )
    return LayerDescription(block, qkv, mlp_layout, norms, gated, act_fn, rotated_norms=rotated_norms)


class NotThisShape(NotDescribed):
    """A layer is not of the shape a further describer reads (the first describer's reason is the layer's)."""


#: a further describer of a layer, tried where :func:`describe_layer` fails: ``(model, layer, i, recording, (rotary
#: candidates, (cos, sin)))`` to its description, :class:`NotThisShape` where the layer is not of its shape
LayerDescriber = Callable[[nn.Module, nn.Module, int, Recording, tuple[Any, Any]], LayerDescription]


def _describe_any(others: Sequence[LayerDescriber], *args: Any) -> LayerDescription:
    """A layer's description (:func:`describe_layer`'s arguments): one attention and one MLP child, else the first of
    ``others`` that describes it; the first reason where none does."""
    try:
        return describe_layer(*args)
    except NotDescribed as why:
        model, layer, i, found, rec, rotary, cos_sin = args
        if "hook_resid_pre" not in found.points:
            raise
        for other in others:
            try:
                return other(model, layer, i, rec, (rotary, cos_sin))
            except NotThisShape:
                continue
        raise why from None


def _rotary_module(
    model: nn.Module, rec: Recording, d_head: int
) -> tuple[Optional[str], Optional[tuple[Tensor, Tensor]]]:
    """The one module outside the layers that returned ``(cos, sin)`` once (class name with ``Rotary``), or a complex
    table ``e^{i theta}`` (read as its real and imaginary parts, :func:`.rotary_angles`, as the core reads it)."""
    tables = {name: rotary_angles(r.value) for name, r in rec.outside_out.items() if r.value.is_complex()}
    found = [
        (name, out)
        for name, out in {**rec.outside_raw, **tables}.items()
        if "rotary" in type(model.get_submodule(name)).__name__.lower()
        and len(out) == 2
        and rec.outside_out[name].calls == 1
        and out[0].shape == out[1].shape
        and out[0].shape[-1] <= d_head
    ]
    if len(found) != 1:
        return None, None
    return found[0][0], (found[0][1][0], found[0][1][1])


def _rotary_inside_attention(
    model: nn.Module, layers: list[nn.Module], rec: Recording
) -> Optional[tuple[str, Callable[..., tuple[Tensor, Tensor]], tuple[Tensor, Tensor]]]:
    """``(path of the first layer's attention module, from_inputs, (cos, sin))`` where each layer's attention module
    holds a rotary module (class name with ``Rotary``) that returned the same ``(cos, sin)`` in every layer: the core
    computes them before the projections, from the attention module's hidden states and ``position_ids``, as the
    rotary module does (``ModelLayout.rotary_from_inputs``); the verification checks the rotated queries and keys."""
    found = {
        (i, path): pair
        for (i, path), pair in rec.pairs.items()
        if "." in path and "rotary" in type(layers[i].get_submodule(path)).__name__.lower()
    }
    paths = {path for _, path in found}
    if len(paths) != 1 or len(found) != len(layers):
        return None
    path = paths.pop()
    first = found[(0, path)]
    if not all(_close(c, first[0]) and _close(s, first[1]) for c, s in found.values()):
        return None
    attn, rest = path.rsplit(".", 1)
    layer_path = next((name for name, m in model.named_modules() if m is layers[0]), None)
    if layer_path is None:
        return None

    def from_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
        hidden, positions = args[0] if args else kwargs.get("hidden_states"), kwargs.get("position_ids")
        if not isinstance(hidden, Tensor) or not isinstance(positions, Tensor):
            raise RuntimeError(
                f"{type(module).__name__} was called without hidden states and position_ids: hook_rot_q/hook_rot_k "
                "cannot compute the rotary angles of its rotary module"
            )
        cos, sin = module.get_submodule(rest)(hidden, positions)
        return cos, sin

    # the claim checked on the probe: the rotary module called so gives the angles it gave (an older rotary module
    # takes a sequence length, not the positions: not this form)
    hidden = rec.inner.get((0, attn), (None, None))[0]
    try:
        assert hidden is not None
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        cos, sin = from_inputs(layers[0].get_submodule(attn), (hidden,), {"position_ids": positions})
    except Exception:  # noqa: BLE001 - whatever fails, the angles are not computed this way
        return None
    if not (_close(cos, first[0]) and _close(sin, first[1])):
        return None
    return f"{layer_path}.{attn}", from_inputs, first


def describe(
    model: nn.Module,
    layers: list[nn.Module],
    blocks: tuple[Any, ...],
    rec: Recording,
    others: Sequence[LayerDescriber] = (),
) -> Description:
    """Each layer's description (``others``: further describers, tried in turn where :func:`describe_layer` fails)."""
    first = next((c for c in rec.calls + rec.own_calls if c.layer is not None), None)
    d_head = first.d_head if first is not None else 0
    rotary_path, cos_sin = _rotary_module(model, rec, d_head)
    rotaries: list[Optional[RotarySpec]] = [None]
    if cos_sin is not None:
        rotaries = [*_rotary_candidates(d_head, text_config(model), cos_sin[0]), None]
    out = Description([None] * len(layers), rotary=rotary_path)
    complex_table = next(
        (
            f"the rotary module {name} returns a complex table (rotary as complex multiplication), not the (cos, sin) "
            f"the description reads"
            for name, record in rec.outside_out.items()
            if cos_sin is None and record.value.is_complex()
        ),
        None,
    )
    inside = _rotary_inside_attention(model, layers, rec) if rotary_path is None else None
    if inside is not None:  # a rotary module inside each attention module, the same angles in every layer
        out.rotary, out.rotary_from_inputs, cos_sin = inside
        rotaries = [*_rotary_candidates(d_head, text_config(model), cos_sin[0]), None]
    elif rotary_path is None:  # the layers' (cos, sin) differ: read where each attention module is given them
        out.rotary_input = "position_embeddings"
    for i, (layer, found) in enumerate(zip(layers, blocks)):
        try:
            layer_rotaries, layer_cos_sin = rotaries, cos_sin
            if rotary_path is None and inside is None:
                given = [v for (j, path), v in rec.position_embeddings.items() if j == i and "." not in path]
                if given:
                    layer_cos_sin = given[0]
                    layer_rotaries = [*_rotary_candidates(d_head, text_config(model), given[0][0]), None]
            out.layers[i] = _describe_any(others, model, layer, i, found, rec, layer_rotaries, layer_cos_sin)
        except NotDescribed as why:
            out.why[i] = str(why) + (f"; {complex_table}" if complex_table and "rotary" in str(why) else "")
        except Exception as exc:  # anything unexpected: the layer is not described
            out.why[i] = f"describing it raised {type(exc).__name__}: {exc}"
    if not any(layer is not None and layer.qkv.rotary is not None for layer in out.layers):
        out.rotary = out.rotary_input = out.rotary_from_inputs = None
    else:
        spec = next(layer.qkv.rotary for layer in out.layers if layer is not None and layer.qkv.rotary is not None)
        out.rotary_dim = spec.rotary_dim if spec is not None else None
    return out
