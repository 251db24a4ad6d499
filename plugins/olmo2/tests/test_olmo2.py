"""OLMo 2: the contract suite over random tiny OLMo 2 configs, plus OLMo 2's own quirks."""

from __future__ import annotations

from lensadapters_olmo2.testing import Olmo2Contract


class TestOlmo2(Olmo2Contract):
    """The plugin's contract suite (``lensadapters_olmo2.testing``, also run by ``lensadapters check olmo2``)."""
