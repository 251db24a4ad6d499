"""Small plain-PyTorch helpers of the verification's references (:mod:`.references`, :mod:`.plain_references`):
each head's share of a projection's output, and a forward hook that ignores the calls it makes itself."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

Tensor = torch.Tensor


def _per_head(module: nn.Module, x: Tensor, heads: int) -> Tensor:
    """Each head's share of ``module``'s output for its input ``x`` ``[b, p, heads, d]`` (``hook_result``)."""
    zero = module(torch.zeros_like(x.flatten(-2)))
    parts = []
    for h in range(heads):
        masked = torch.zeros_like(x)
        masked[..., h, :] = x[..., h, :]
        parts.append(module(masked.flatten(-2)) - zero)
    return torch.stack(parts, dim=-2)


def _once(module: nn.Module, fn: Callable[..., Any]) -> Any:
    """A forward hook that does not run for the calls ``fn`` itself makes of ``module``."""
    busy: list[bool] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if busy:
            return None
        busy.append(True)
        try:
            return fn(module, args, kwargs, output)
        finally:
            busy.clear()

    return module.register_forward_hook(hook, with_kwargs=True)
