"""Qwen 3.5's gated full attention (the query projection's output gate) and the MoE layers' shared expert: the
core's sites for them (:mod:`lensadapters.adapters.gated_parts`, through :mod:`lensadapters.plugin_api`)."""

from __future__ import annotations

from lensadapters.plugin_api import SHARED_EXPERT_POINTS as SHARED_POINTS
from lensadapters.plugin_api import QueryGateSite, query_gate_site, shared_expert_sites

__all__ = ["SHARED_POINTS", "QueryGateSite", "query_gate_site", "shared_expert_sites"]
