"""Which rotary embedding a model applies, read from the probe: the rotary module outside the layers (its ``(cos, sin)``
or complex table), or one inside each attention module, and the rotations tried on its angles (rotate-half, whole or
partial, turning either way; interleaved pairs from a half or a full table). Used by :mod:`.describe`."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.probe import Recording, _close
from lensadapters.hooks.rotary import half_table_rotate_half_spec, rotate_half_spec
from lensadapters.hooks.sites.qkv import rotary_angles
from lensadapters.hooks.specs import (
    RotarySpec,
)

Tensor = torch.Tensor


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


def reversed_rotate_half_spec(rotary_dim: int) -> RotarySpec:
    """Rotate-half RoPE turning the other way: ``x * cos + cat(x2, -x1) * sin`` (NanoChat's ``rotate_half``), which
    is rotate-half with ``sin`` negated (bitwise: a product with a negated factor is the negated product)."""
    half = rotate_half_spec(rotary_dim)
    return RotarySpec(
        rotary_dim, lambda x, cos, sin: half.apply(x, cos, -sin), lambda y, cos, sin: half.invert(y, cos, -sin)
    )


def sin_first_spec(spec: RotarySpec) -> RotarySpec:
    """``spec`` for a rotary module that returns ``(sin, cos)``, not ``(cos, sin)`` (CodeGen's table split in two)."""
    return RotarySpec(
        spec.rotary_dim, lambda x, cos, sin: spec.apply(x, sin, cos), lambda y, cos, sin: spec.invert(y, sin, cos)
    )


def _rotary_candidates(d_head: int, config: Any, cos: Tensor) -> list[RotarySpec]:
    """Rotate-half (table of ``r`` or ``r/2`` entries) and interleaved pairs (table of ``r`` entries, or ``r/2``: a
    complex table), on the whole head or on the first dimensions the table covers (partial rotary), each from the
    module's ``(cos, sin)`` or from a ``(sin, cos)`` it returns: each is tried on the probe's queries and keys."""
    specs = _cos_first_candidates(d_head, cos)
    return specs + [sin_first_spec(spec) for spec in specs]


def _cos_first_candidates(d_head: int, cos: Tensor) -> list[RotarySpec]:
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
