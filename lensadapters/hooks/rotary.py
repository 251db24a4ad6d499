"""Reusable rotary position embedding helpers for plugins.

Hugging Face's "rotate half" RoPE (GPT-NeoX, Llama, and most models since) pairs dimension ``i``
with ``i + r/2`` of the first ``r`` dimensions of a head, where ``r`` is the last dimension of the
``(cos, sin)`` that the model's rotary module returns (``cos``/``sin`` repeat their ``r/2``
frequencies twice: ``cat(freqs, freqs)``). The remaining ``d_head - r`` dimensions pass through
unrotated (partial rotary, GPT-NeoX ``rotary_pct``).

The functions here work on queries/keys laid out as ``[batch, pos, heads, d_head]`` (the layout of
``hook_q``/``hook_rot_q``) with ``cos``/``sin`` as ``[batch or 1, pos, r]`` (or ``[pos, r]``), and
compute exactly what Hugging Face's ``apply_rotary_pos_emb`` computes (same operations, same
order, so ``hook_rot_q`` is bitwise the rotated query the model uses).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lensadapters.hooks.specs import RotarySpec

Tensor = torch.Tensor

__all__ = ["rotate_half", "apply_rotate_half", "invert_rotate_half", "rotate_half_spec", "half_table_rotate_half_spec"]
__all__ += ["sectioned_rotate_half_spec", "merge_rotary_sections", "float32_rotate_half_spec", "axial_rotate_half_spec"]


def rotate_half(x: Tensor) -> Tensor:
    """``cat(-x2, x1)`` for ``x = cat(x1, x2)`` split at the middle of the last dimension."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _check(x: Tensor, cos: Tensor, rotary_dim: Optional[int]) -> int:
    r = cos.shape[-1]
    if rotary_dim is not None and r != rotary_dim:
        raise RuntimeError(
            f"the model's rotary module returned cos/sin for {r} dimensions, but the plugin declared "
            f"rotary_dim={rotary_dim}; the model's layout differs from what the plugin expects"
        )
    if r > x.shape[-1] or r % 2:
        raise RuntimeError(
            f"rotary dimension {r} does not fit heads of size {x.shape[-1]} (must be even and <= d_head)"
        )
    return r


def apply_rotate_half(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: Optional[int] = None) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` (``[b, p, h, d_head]``) as Hugging Face does."""
    r = _check(x, cos, rotary_dim)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    if r == x.shape[-1]:  # the whole head rotates: no pass-through part to concatenate (one copy less)
        return (x * cos) + (rotate_half(x) * sin)
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat([(x_rot * cos) + (rotate_half(x_rot) * sin), x_pass], dim=-1)


def invert_rotate_half(y: Tensor, cos: Tensor, sin: Tensor, rotary_dim: Optional[int] = None) -> Tensor:
    """The ``x`` with ``apply_rotate_half(x, cos, sin) == y`` (up to rounding), computed in float32 (at least: a
    float64 ``y`` in float64, so that an edit rotated back in a float64 model keeps float64's precision and its
    gradient is exact).

    Each rotated pair is ``(y1, y2) = (x1 c - x2 s, x2 c + x1 s)``; its inverse is
    ``(x1, x2) = (y1 c + y2 s, y2 c - y1 s) / (c² + s²)``, i.e. ``(y c - rotate_half(y) s) / (c² + s²)``.
    Dividing by ``c² + s²`` also undoes the ``attention_scaling`` some RoPE variants (YaRN, LongRoPE)
    fold into ``cos``/``sin``.
    """
    r = _check(y, cos, rotary_dim)
    wide = torch.promote_types(y.dtype, torch.float32)
    c, s = cos.unsqueeze(-2).to(wide), sin.unsqueeze(-2).to(wide)
    y_rot, y_pass = y[..., :r].to(wide), y[..., r:]
    x_rot = ((y_rot * c - rotate_half(y_rot) * s) / (c * c + s * s)).to(y.dtype)
    return x_rot if r == y.shape[-1] else torch.cat([x_rot, y_pass], dim=-1)


def rotate_half_spec(rotary_dim: Optional[int] = None) -> RotarySpec:
    """A ``RotarySpec`` for rotate-half RoPE on the first ``rotary_dim`` dimensions of each head.

    With ``rotary_dim=None`` the dimension is taken from ``cos``/``sin`` on every call (the spec's
    ``rotary_dim`` is then 0); with a number, a mismatch with the model's ``cos``/``sin`` is an error.
    """

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rotate_half(x, cos, sin, rotary_dim)

    def invert(y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return invert_rotate_half(y, cos, sin, rotary_dim)

    return RotarySpec(rotary_dim or 0, apply, invert)


def float32_rotate_half_spec() -> RotarySpec:
    """A ``RotarySpec`` for rotate-half RoPE over the whole head computed in float32 and cast back to the input's
    dtype: ``x`` and ``(cos, sin)`` upcast, ``x * cos + rotate_half(x) * sin``, then ``.to(x.dtype)`` (the
    operations of the vision towers' ``apply_rotary_pos_emb_vision``; in float32 the same numbers as
    :func:`rotate_half_spec`'s)."""

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        _check(x, cos, x.shape[-1])
        xf = x.float()
        c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        return ((xf * c) + (rotate_half(xf) * s)).to(x.dtype)

    def invert(y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return invert_rotate_half(y, cos, sin, y.shape[-1])

    return RotarySpec(0, apply, invert)


def half_table_rotate_half_spec(rotary_dim: Optional[int] = None) -> RotarySpec:
    """A ``RotarySpec`` for rotate-half RoPE whose rotary module returns each frequency once: ``cos``/``sin`` of
    ``r/2`` dimensions (``freqs`` rather than ``cat(freqs, freqs)``), which the attention applies as
    ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` on the halves of ``x``. That is rotate-half with the table
    repeated (bitwise: the same products, a sum with a negated product is the difference), computed so here.
    """

    def doubled(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rotate_half(x, *doubled(cos, sin), rotary_dim)

    def invert(y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return invert_rotate_half(y, *doubled(cos, sin), rotary_dim)

    return RotarySpec(rotary_dim or 0, apply, invert)


def merge_rotary_sections(table: Tensor, sections: Sequence[int]) -> Tensor:
    """One ``[b, p, r]`` table of a rotary module that returns one table per position axis (multimodal RoPE:
    ``[axes, b, p, r]``, each token's temporal, height and width positions): the ``r`` features are cut into
    ``sections`` twice over (once per half of rotate-half) and chunk ``i`` is taken from axis ``i % axes``, as
    transformers 4.x's ``apply_multimodal_rotary_pos_emb`` does (the same slices, concatenated: bitwise). A table
    that is already one per token (``[b, p, r]``: the rotary module merged its axes itself) is returned as it is."""
    if table.dim() < 4:
        return table
    chunks = table.split(list(sections) * 2, dim=-1)
    return torch.cat([chunk[i % table.shape[0]] for i, chunk in enumerate(chunks)], dim=-1)


def sectioned_rotate_half_spec(sections: Sequence[int], rotary_dim: Optional[int] = None) -> RotarySpec:
    """A ``RotarySpec`` for rotate-half RoPE whose rotary module may return one ``(cos, sin)`` table per position
    axis, merged by the attention along ``sections`` (:func:`merge_rotary_sections`); per-token tables are used as
    they are."""

    def merged(t: Tensor) -> Tensor:
        return merge_rotary_sections(t, sections)

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rotate_half(x, merged(cos), merged(sin), rotary_dim)

    def invert(y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return invert_rotate_half(y, merged(cos), merged(sin), rotary_dim)

    return RotarySpec(rotary_dim or 0, apply, invert)


def axial_rotate_half_spec(axes: int = 2) -> RotarySpec:
    """Rotate-half RoPE on each of ``axes`` equal parts of a head, each with the same part of ``(cos, sin)``: the
    2-D rotary of Gemma 4's vision tower (``apply_multidimensional_rope`` with ``(x, y)`` patch positions: a head's
    first half rotated by the rows' angles, its second half by the columns'), the same operations as
    transformers' (bitwise)."""

    def parts(t: Tensor) -> tuple[Tensor, ...]:
        size = 2 * (t.shape[-1] // (2 * axes))
        if size <= 0 or size * axes != t.shape[-1]:
            raise RuntimeError(f"a head of {t.shape[-1]} features is not {axes} rotated parts")
        return t.split(size, dim=-1)

    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return torch.cat([apply_rotate_half(*p) for p in zip(parts(x), parts(cos), parts(sin))], dim=-1)

    def invert(y: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return torch.cat([invert_rotate_half(*p) for p in zip(parts(y), parts(cos), parts(sin))], dim=-1)

    return RotarySpec(0, apply, invert)
