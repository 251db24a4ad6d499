"""The contract suites (``lensadapters_bart.testing``): the encoder-decoder's form on every family (also run by
``lensadapters check bart``), and the generic adapter's on the families' ``*ForCausalLM``."""

from lensadapters_bart.testing import BartCausalContract, BartContract, PreLNCausalContract


class TestBart(BartContract):
    """The generic encoder-decoder properties on tiny models of every family."""


class TestBartCausal(BartCausalContract):
    """The generic adapter properties on the post-LN families' causal LMs."""


class TestPreLNCausal(PreLNCausalContract):
    """The generic adapter properties on the pre-LN families' causal LMs."""
