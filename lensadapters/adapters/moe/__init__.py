"""Mixture-of-experts MLPs: the description (``MoELayout``), routing and per-expert hook points, expert weights.

A plugin describes a MoE block declaratively (:mod:`lensadapters.moe.specs`); the core builds the hook points
(:mod:`lensadapters.moe.sites`) and reads the experts' weights from the live parameters
(:mod:`lensadapters.moe.experts`).
"""

from lensadapters.adapters.moe.experts import expert_weights, expert_weights_and_biases, router_bias, router_weight
from lensadapters.adapters.moe.routing import expert_rows
from lensadapters.adapters.moe.sites import (
    EXPERT_POINTS,
    ROUTING_POINTS,
    MoESite,
    build_moe_site,
    is_expert_point,
    moe_point_names,
)
from lensadapters.adapters.moe.specs import (
    ExpertModules,
    Experts,
    FusedExperts,
    GroupedExperts,
    MoELayout,
    Routing,
    is_moe,
    stored_moe_layout,
)

__all__ = [
    "EXPERT_POINTS",
    "ROUTING_POINTS",
    "ExpertModules",
    "Experts",
    "FusedExperts",
    "GroupedExperts",
    "MoELayout",
    "MoESite",
    "Routing",
    "build_moe_site",
    "expert_rows",
    "expert_tokens",
    "expert_weights",
    "expert_weights_and_biases",
    "is_expert_point",
    "is_moe",
    "moe_point_names",
    "router_bias",
    "router_weight",
    "stored_moe_layout",
]


def expert_tokens(indices, expert: int):  # type: ignore[no-untyped-def]
    """Which tokens expert ``expert`` computed, row by row: ``(batch, position, slot)`` index tensors for the rows
    of ``mlp.experts.{expert}.*`` given that layer's ``mlp.hook_expert_indices`` ``[b, p, k]``."""
    b, p, k = indices.shape
    slot, token = expert_rows(indices.reshape(b * p, k), expert)
    return token // p, token % p, slot
