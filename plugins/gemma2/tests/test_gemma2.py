"""Gemma 2: the contract suite over random tiny Gemma 2 configs, plus Gemma 2's own quirks."""

from __future__ import annotations

from lensadapters_gemma2.testing import Gemma2Contract


class TestGemma2(Gemma2Contract):
    """The plugin's contract suite (``lensadapters_gemma2.testing``, also run by ``lensadapters check gemma2``)."""
