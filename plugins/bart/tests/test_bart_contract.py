"""The contract suites (``lensadapters_bart.testing``): the encoder-decoder's form on every family (also run by
``lensadapters check bart``), and the generic adapter's on the families' ``*ForCausalLM``."""

from lensadapters_bart.testing import BartCausalContract, BartContract


class TestBart(BartContract):
    """The generic encoder-decoder properties on tiny models of every family."""


class TestBartCausal(BartCausalContract):
    """The generic adapter properties on the families' causal LMs."""
