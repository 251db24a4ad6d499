"""Gemma 3 (text): the contract suite over random tiny Gemma 3 configs, plus Gemma 3's own quirks."""

from __future__ import annotations

from lensadapters_gemma3.testing import Gemma3Contract


class TestGemma3(Gemma3Contract):
    """The plugin's contract suite (``lensadapters_gemma3.testing``, also run by ``lensadapters check gemma3``)."""
