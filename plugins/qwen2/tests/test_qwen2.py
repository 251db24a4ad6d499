"""Qwen2 / Qwen2.5: the contract suite over random tiny Qwen2 configs, plus Qwen2's own quirks."""

from __future__ import annotations

from lensadapters_qwen2.testing import Qwen2Contract


class TestQwen2(Qwen2Contract):
    """The plugin's contract suite (``lensadapters_qwen2.testing``, also run by ``lensadapters check qwen2``)."""
