"""Test kit for adapter plugins: hypothesis strategies and the contract suite (``pip install lensadapters[testing]``)."""

from .contract import AdapterContract, assert_close, perturb, reinit
from .strategies import Inputs, token_inputs

__all__ = ["AdapterContract", "assert_close", "perturb", "reinit", "Inputs", "token_inputs"]
