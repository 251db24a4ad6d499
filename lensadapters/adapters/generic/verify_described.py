"""Verification of the generic adapter's described points: each described layer's representative (the first layer
of the same class and description), checked on a probe forward pass of a second wiring of the same description
(:func:`verify_description`); the plugin serves only the points that pass."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from lensadapters.adapters.generic.recheck import check_second_wiring

#: the models of a probe wiring being verified now (their own wiring serves every point unverified: it is the probe)
VERIFYING: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _representatives(hooked: Any) -> dict[int, int]:
    """Each described layer's representative: the first layer with the same class and the same description (its
    points are checked; the others' verdicts are the representative's), and the last layer checks itself."""
    seen: dict[Any, int] = {}
    out = {}
    n = len(hooked.block_modules)
    for i, (layer, bl) in enumerate(zip(hooked.block_modules, hooked.block_layouts)):
        if bl is None:
            continue
        key = (
            type(layer),
            bl,
            repr(hooked.qkv_layouts[i]).split(" at 0x")[0],
            repr(hooked.mlp_layouts[i]).split(" at 0x")[0],
        )
        out[i] = i if i == n - 1 else seen.setdefault(key, i)
    return out


def verify_description(hooked: Any) -> dict[str, str]:
    """The described points of ``hooked`` (a wiring) that fail :func:`.verify.check_points`, with why: every point
    of a representative layer, ``hook_embed`` and the final norm's, checked on a probe forward pass of a second wiring
    of the same description (built, checked, uninstalled)."""
    reps = _representatives(hooked)

    def names(probe: Any) -> list[str]:
        found = [n for n in probe.hook_names if not n.startswith("blocks.")]
        for name in probe.hook_names:
            if name.startswith("blocks.") and int(name.split(".")[1]) in set(reps.values()):
                found.append(name)
        return found

    results, hook_names = check_second_wiring(hooked, VERIFYING, names)
    failed = {name: why for name, why in results.items() if why is not None}
    for name in hook_names:  # a layer's verdicts are its representative's
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            rep = reps.get(int(i))
            if rep is not None and rep != int(i):
                why = failed.get(f"blocks.{rep}.{rest}")
                if why is not None:
                    failed[name] = why
    return failed
