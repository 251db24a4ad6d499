"""Which hook points a harvest reads and how far the model has to run for them."""

from __future__ import annotations

import re
from typing import Optional, Sequence

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
