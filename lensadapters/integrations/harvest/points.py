"""Which hook points a harvest reads, how far the model has to run for them, and whether contexts of the chosen size
run through it (the per-token shape of each point, from one probing forward)."""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import torch

from lensadapters.errors import LensAdaptersError, UnknownHookError

_BLOCK = re.compile(r"^blocks\.(\d+)\.")
#: hook points whose values are not one row per token ([batch, pos, ...])
_NOT_PER_TOKEN = ("attn.hook_attn_scores", "attn.hook_pattern")


class HarvestHookError(LensAdaptersError, ValueError):
    """A hook point that cannot be harvested (unknown, or not one value per token)."""


def check_points(names: Sequence[str], known: Sequence[str]) -> list[str]:
    """The requested names, in the model's execution order, after checking each one."""
    if not names:
        raise HarvestHookError("no hook points to harvest: name at least one (hooks=[...], --hooks NAME ...)")
    order = {name: i for i, name in enumerate(known)}
    for name in names:
        if name not in order:
            raise UnknownHookError(name, known)
        if name.endswith(_NOT_PER_TOKEN):
            raise HarvestHookError(
                f"{name} is [batch, head, query, key], not one value per token: a harvest stores "
                f"per-token activations [context_size, ...] (use run_with_cache for patterns)"
            )
    return sorted(dict.fromkeys(names), key=order.__getitem__)


def stop_layer(names: Sequence[str], known: Sequence[str], n_layers: int) -> Optional[int]:
    """``stop_at_layer`` for these points: one past the last block they are in (0 for points before the first
    block), or ``None`` when a point comes after the last block (``ln_final.*``: the whole model runs)."""
    last_block_point = max((i for i, n in enumerate(known) if _BLOCK.match(n)), default=-1)
    stop = 0
    for name in names:
        match = _BLOCK.match(name)
        if match:
            stop = max(stop, int(match.group(1)) + 1)
        elif known.index(name) > last_block_point:
            return None
    return min(stop, n_layers)


class HarvestContextError(LensAdaptersError, ValueError):
    """Contexts of the requested size cannot run through the model (longer than its positions, or failing)."""


def check_context_size(hm: Any, context_size: int) -> None:
    n_ctx = getattr(hm.cfg, "n_ctx", None)
    if isinstance(n_ctx, int) and n_ctx > 0 and context_size > n_ctx:
        raise HarvestContextError(
            f"context_size={context_size} is longer than the model's {n_ctx} positions (n_ctx, from its config's "
            f"max_position_embeddings): choose context_size <= {n_ctx} (--context-size)"
        )


@torch.no_grad()
def probe(hm: Any, points: list[str], stop: Optional[int], context_size: int) -> dict[str, list[int]]:
    """The per-token shape of each point (after ``[batch, pos]``), from a forward of one whole context (so a context
    the model cannot run fails here, before anything is written)."""
    tokens = torch.zeros(1, context_size, dtype=torch.long, device=hm.device)
    try:
        _, cache = hm.run_with_cache(
            tokens, names_filter=points, stop_at_layer=stop, return_type=None, attention_mask=torch.ones_like(tokens)
        )
    except LensAdaptersError:
        raise
    except Exception as exc:  # noqa: BLE001 - named below, with the cause attached
        raise HarvestContextError(
            f"a forward of one context of {context_size} tokens fails ({type(exc).__name__}: {exc}): the model "
            f"cannot run contexts of this size; choose a smaller context_size (--context-size)"
        ) from exc
    shapes = {}
    for name in points:
        shape = tuple(cache[name].shape)
        if shape[:2] != (1, context_size):
            raise HarvestHookError(
                f"{name} has shape {shape} for one context of {context_size} tokens: a harvest stores values of shape "
                f"[batch, pos, ...], one per token"
            )
        shapes[name] = list(shape[2:])
    return shapes
