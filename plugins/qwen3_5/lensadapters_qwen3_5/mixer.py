"""The gated DeltaNet (linear attention) layers of Qwen 3.5: the core's gated DeltaNet site
(:mod:`lensadapters.adapters.gated_deltanet`, through :mod:`lensadapters.plugin_api`) with separate projections
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). Its points, relative to ``blocks.{i}.``:
``linear_attn.hook_qkv``, ``hook_z``, ``hook_b``, ``hook_a``, ``hook_conv``, ``hook_q``/``hook_k``/``hook_v``,
``hook_beta``, ``hook_decay``, ``hook_recurrent``, ``hook_gated`` (what each is: the core module's docstring)."""

from __future__ import annotations

from lensadapters.plugin_api import GATED_DELTANET_POINTS as POINTS
from lensadapters.plugin_api import SEPARATE_PROJECTIONS as PROJECTIONS
from lensadapters.plugin_api import GatedDeltaNetSite as DeltaNetSite
from lensadapters.plugin_api import gated_deltanet_point_names as point_names

__all__ = ["POINTS", "PROJECTIONS", "DeltaNetSite", "point_names"]
