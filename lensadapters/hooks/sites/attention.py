"""Attention scores and patterns (served by a pattern backend) and per-head results."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites.base import (
    Site,
    first_input,
    first_output,
    plus_delta,
    replace_first_output,
    split_heads,
)

Tensor = torch.Tensor


class AttentionSite(Site):
    """``hook_attn_scores`` and ``hook_pattern`` of one layer, served by a pattern backend."""

    def __init__(self, layer: int, backend: Any, scores: HookPoint, pattern: HookPoint) -> None:
        self.layer, self.backend = layer, backend
        self.scores, self.pattern = scores, pattern
        self.points = (scores, pattern)

    def install(self) -> list[RemovableHandle]:
        return [self.backend.activate(self.layer, self)]


class ResultSite(Site):
    """``attn.hook_result``: per-head outputs of the output projection (``z`` times the read ``W_O``).

    An edit changes the projection's own output by ``sum_h (edited_h - result_h)``, which equals
    ``sum_h edited_h + b_O`` up to rounding, while heads left as they were keep the model's exact
    numbers (a quantized or adapted projection is not recomputed in float; an identity edit is bitwise).
    """

    def __init__(
        self, module: nn.Module, point: HookPoint, heads: int, weight: Callable[[], tuple[Tensor, Optional[Tensor]]]
    ) -> None:
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
        wide = torch.promote_types(result.dtype, torch.float32)
        delta = edited.to(wide).sum(-2) - result.to(wide).sum(-2)
        return replace_first_output(output, plus_delta(out, delta))
