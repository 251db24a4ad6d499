"""The contract suite in an encoder's form (``lensadapters_modernbert.testing``, also run by ``lensadapters check
modernbert``)."""

from lensadapters_modernbert.testing import ModernBertContract


class TestModernBert(ModernBertContract):
    """The generic adapter properties on tiny ModernBERT models."""
