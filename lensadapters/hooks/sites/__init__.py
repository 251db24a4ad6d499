"""Sites: the PyTorch hooks that realize hook points on an unmodified model.

A site watches one place of the model (a module's input or output) and serves one or more hook
points there. It is installed only while one of its points has a user function (or another site
needs it), so a model with no hooks runs exactly Hugging Face's forward. Every site follows one
rule: if no hook changed anything, the model's own tensor is passed on untouched.

Plugins build their own sites on :class:`Site` (see ``docs/writing-a-plugin.md``) and may reuse the
generic ones here (``OutputSite``, ``InputSite``...).
"""

from lensadapters.hooks.sites.attention import AttentionSite, ResultSite
from lensadapters.hooks.sites.base import (
    ForwardState,
    Handle,
    Site,
    completes_output,
    first_input,
    first_output,
    merge_heads,
    reads_output,
    replace_first_input,
    replace_first_output,
    split_heads,
)
from lensadapters.hooks.sites.generic import BlockShapeSite, InputSite, OutputSite, PositionEmbedSite, ScaledOutputSite
from lensadapters.hooks.sites.mlp import FusedGateUpSite
from lensadapters.hooks.sites.norm import NormSite
from lensadapters.hooks.sites.qkv import (
    AttentionRotarySite,
    FusedQKVSite,
    NormedRotarySite,
    ProjectionSite,
    RecomputedRotarySite,
    RotaryCaptureSite,
    heads_view,
)
from lensadapters.hooks.sites.residual import ResidualSite
from lensadapters.hooks.sites.scaled import ScaledBranchSite

__all__ = [
    "AttentionRotarySite",
    "AttentionSite",
    "BlockShapeSite",
    "ForwardState",
    "FusedGateUpSite",
    "FusedQKVSite",
    "Handle",
    "InputSite",
    "NormSite",
    "NormedRotarySite",
    "OutputSite",
    "PositionEmbedSite",
    "ProjectionSite",
    "RecomputedRotarySite",
    "ResidualSite",
    "ResultSite",
    "ScaledBranchSite",
    "RotaryCaptureSite",
    "ScaledOutputSite",
    "Site",
    "completes_output",
    "first_input",
    "first_output",
    "heads_view",
    "merge_heads",
    "reads_output",
    "replace_first_input",
    "replace_first_output",
    "split_heads",
]
