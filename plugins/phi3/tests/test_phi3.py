"""Phi-3 / Phi-3.5 / Phi-4-mini: the contract suite over random tiny Phi-3 configs, plus Phi-3's own quirks."""

from __future__ import annotations

from lensadapters_phi3.testing import Phi3Contract


class TestPhi3(Phi3Contract):
    """The plugin's contract suite (``lensadapters_phi3.testing``, also run by ``lensadapters check phi3``)."""
