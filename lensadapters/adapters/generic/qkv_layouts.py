"""Layouts of a fused query/key/value projection beyond ``[q | k | v]`` and per-head ``[heads, (q | k | v), d]``
(:mod:`.describe`): heads in groups, each group's output ``[q | k | v]`` of its heads in some order of the three
parts (a model-parallel layout, CodeGen's ``mp_num`` groups of ``[q | v | k]``). The probe picks the one whose parts
are the queries, keys and values the attention function gets."""

from __future__ import annotations

from itertools import permutations
from typing import Any, Callable

import torch

Tensor = torch.Tensor


def grouped_qkv_split(
    heads: int, d: int, groups: int, order: tuple[int, int, int]
) -> tuple[Callable[..., Any], Callable[..., Tensor]]:
    """``(split, merge)`` of a projection whose output is ``groups`` blocks, each the three parts of its
    ``heads // groups`` heads one after the other, query, key and value at the places ``order`` gives; each part as
    ``[..., heads, d]`` (head ``g * heads // groups + j`` is head ``j`` of group ``g``)."""
    per = heads // groups

    def split(t: Tensor) -> tuple[Tensor, ...]:
        blocks = t.unflatten(-1, (groups, 3, per * d))
        return tuple(blocks[..., at, :].flatten(-2).unflatten(-1, (heads, d)) for at in order)

    def merge(*parts: Tensor) -> Tensor:
        grouped = [p.flatten(-2).unflatten(-1, (groups, per * d)) for p in parts]  # q, k, v
        placed = [grouped[order.index(at)] for at in range(3)]
        return torch.stack(placed, dim=-2).flatten(-3)

    return split, merge


def grouped_qkv_splits(heads: int, kv: int, d: int) -> list[tuple[Callable[..., Any], Callable[..., Tensor]]]:
    """Every grouped layout of a projection of ``heads`` query and as many key/value heads: 2 to ``heads // 2``
    groups (one group is ``[q | k | v]``), the three parts in any order."""
    if heads != kv:
        return []
    counts = [g for g in range(2, heads + 1) if heads % g == 0]
    orders = list(permutations(range(3)))
    return [grouped_qkv_split(heads, d, g, o) for g in counts for o in orders]  # type: ignore[arg-type]
