"""The contract suite in an encoder-decoder's form (``lensadapters_bart.testing``, also run by ``lensadapters check
bart``)."""

from lensadapters_bart.testing import BartContract


class TestBart(BartContract):
    """The generic encoder-decoder properties on tiny BART models."""
