"""Mixtral: the contract suite in its mixture-of-experts form over random tiny Mixtral configs (2-5 experts, top-1
to top-all routing, GQA/MQA, sliding window or none, every experts implementation of transformers 5), plus the
plugin's own checks."""

from __future__ import annotations

from lensadapters_mixtral.testing import MixtralContract


class TestMixtral(MixtralContract):
    """The plugin's contract suite (``lensadapters_mixtral.testing``, also run by ``lensadapters check mixtral``)."""
