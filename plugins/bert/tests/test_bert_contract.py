"""The contract suite in an encoder's form (``lensadapters_bert.testing``, also run by ``lensadapters check bert``)."""

from lensadapters_bert.testing import BertContract


class TestBert(BertContract):
    """The generic adapter properties on tiny BERT and RoBERTa models."""
