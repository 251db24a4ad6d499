"""Qwen3: the contract suite over random tiny Qwen3 configs, plus Qwen3's own quirks."""

from __future__ import annotations

from lensadapters_qwen3.testing import Qwen3Contract


class TestQwen3(Qwen3Contract):
    """The plugin's contract suite (``lensadapters_qwen3.testing``, also run by ``lensadapters check qwen3``)."""
