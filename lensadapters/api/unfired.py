"""Warnings for hooks that could not run: a point that fires only in some forwards (a projector's points fire only
in a forward with images) hooked in a ``with hm.hooks(...)`` block none of whose forwards reached it."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from lensadapters.hooks.hook_point import HookPoint


class UnfiredHookWarning(UserWarning):
    """A hook on a conditional point did not run, because no forward of its block met the point's condition."""


def watch_conditional_points(
    touched: list[HookPoint], context: int, scope: tuple[Optional[int], Optional[int]]
) -> dict[str, Any]:
    """Add a read-only watcher, in the block's ``context``, to each conditional point a hook of the block went to;
    returns ``{name: [point, fired?]}`` for :func:`warn_unfired`."""
    watched: dict[str, Any] = {}
    for point in touched:
        mine = [e for e in point.fwd_hooks + point.bwd_hooks if e.context == context]
        if point.fires_when is None or point.name in watched or not mine:
            continue
        record = watched[point.name] = [point, False]

        def seen(tensor: torch.Tensor, hook: HookPoint, record: list = record) -> None:
            record[1] = True

        point.add(seen, "fwd", context=context, readonly=True, thread=scope[0], depth=scope[1])
    return watched


def warn_unfired(watched: dict[str, Any]) -> None:
    """Warn, naming each point, when the hooks of a block never ran at a conditional point."""
    missed = [point for point, fired in watched.values() if not fired]
    if missed:
        names = ", ".join(f"{p.name} (it fires only {p.fires_when})" for p in missed)
        warnings.warn(
            f"the hooks on {names} did not run: no forward in this block met that condition; pass the input "
            f"the point needs, or hook another point",
            UnfiredHookWarning,
            stacklevel=4,
        )
