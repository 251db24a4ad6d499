"""The attention output changed before the output projection (an output gate, a norm: BitNet's ``attn_sub_norm``,
gated attention multiplying it by a sigmoid of a projection of the input): a described form.

The probe recognises it from module inputs and outputs alone: no linear module of the attention module reads the
attention function's output and gives the attention output, but exactly one gives the attention output from an input
of that output's shape (:func:`.describe._describe_attention`). What the points are then, as TransformerLens names
them:

* ``attn.hook_z`` is the attention function's output per head ``[b, p, h, d_head]`` (the values weighted by the
  pattern), before the gate or norm; served through the attention interface with the layer's scores and pattern
  (:class:`.sites.AttentionFunctionSite`), so an edit runs through the model's own gate or norm and projection;
* ``attn.hook_result`` and ``W_O``/``b_O`` are refused by name: the map from ``z`` to the attention output is not
  one linear map per head;
* every other point of the layer (``ln1``/``ln2``, queries, keys and values, the MLP) is served as usual.

Each served point is verified at wrap time like every described point (``hook_z`` against the attention function's
output of a plain forward, its edit against the same edit made there).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import nn

from lensadapters.adapters.generic.sites import AttentionFunctionBackend, AttentionFunctionSite

#: model -> the layers whose attention output is changed before the output projection
GATED_Z: "weakref.WeakKeyDictionary[nn.Module, frozenset[int]]" = weakref.WeakKeyDictionary()
WHY = (
    "the attention module changes the attention function's output (hook_z) before the output projection (an output "
    "gate or a norm), so the map from hook_z to the attention output is not one linear map per head"
)
REFUSED_WEIGHTS = ("W_O", "b_O")
GATED_GROUP = "attn.hook_result, W_O or b_O"  # the group of ``Findings.missing`` (the wrap's warning) saying why


def gated_layers(model: nn.Module) -> frozenset[int]:
    return GATED_Z.get(model, frozenset())


def gated_z_sites(
    hooked: Any, backend: AttentionFunctionBackend, missing: dict[str, str]
) -> tuple[list[AttentionFunctionSite], set[str]]:
    """The sites of each such layer's ``hook_attn_scores``, ``hook_pattern`` and ``hook_z`` (claimed from the core)
    and the names claimed; ``hook_result`` is removed, and ``missing`` (what the wrap's warning lists) says why."""
    sites, claimed = [], set()
    if gated_layers(hooked.hf_model):
        missing.setdefault(GATED_GROUP, WHY)
    for i in sorted(gated_layers(hooked.hf_model)):
        result = f"blocks.{i}.attn.hook_result"
        if result in hooked.hook_dict:
            hooked.claim_point(result)
            hooked.remove_point(result)
        points: dict[str, Optional[Any]] = {}
        for name in ("hook_attn_scores", "hook_pattern", "hook_z"):
            full = f"blocks.{i}.attn.{name}"
            points[name] = hooked.claim_point(full) if full in hooked.hook_dict else None
            if points[name] is not None:
                claimed.add(full)
        z = points["hook_z"]
        if z is not None:
            sites.append(AttentionFunctionSite(i, backend, points["hook_attn_scores"], points["hook_pattern"], z))
    return sites, claimed


def refused_gated_weight(hooked: Any, name: str) -> Optional[str]:
    """Why ``name`` is refused (``W_O``/``b_O`` where a layer's attention output is changed before its projection)."""
    return WHY if name in REFUSED_WEIGHTS and gated_layers(hooked.hf_model) else None
