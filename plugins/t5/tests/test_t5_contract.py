"""The contract suite in an encoder-decoder's form (``lensadapters_t5.testing``, also run by ``lensadapters check
t5``)."""

from lensadapters_t5.testing import T5Contract


class TestT5(T5Contract):
    """The generic encoder-decoder properties on tiny T5 models."""
