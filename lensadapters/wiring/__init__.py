"""The wiring of one wrapped model: a plugin's description bound to the model's modules.

``core`` (:class:`Wiring`: the points, the sites that serve them, their lazy installation), ``weights``
(every weight read from live parameters through the plugins), ``head_inputs`` (the per-head input points).
Uses the plugin system and the hook machinery below it; the analysis layer and the user API sit above.
"""

from lensadapters.wiring.core import Wiring
from lensadapters.wiring.names import (
    PATTERN_POINTS,
    block_point_names,
    blocks_without_head_inputs,
    is_gated,
    non_attention_blocks,
    qkv_point_names,
)

__all__ = [
    "PATTERN_POINTS",
    "Wiring",
    "block_point_names",
    "blocks_without_head_inputs",
    "is_gated",
    "non_attention_blocks",
    "qkv_point_names",
]
