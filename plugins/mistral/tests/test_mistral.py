"""Mistral: the contract suite over random tiny Mistral configs, plus Mistral's own quirks."""

from __future__ import annotations

from lensadapters_mistral.testing import MistralContract


class TestMistral(MistralContract):
    """The plugin's contract suite (``lensadapters_mistral.testing``, also run by ``lensadapters check mistral``)."""
