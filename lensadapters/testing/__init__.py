"""Test kit for adapter plugins: hypothesis strategies and the contract suite (``pip install lensadapters[testing]``)."""

from .contract import AdapterContract, Capabilities, assert_close, perturb, reinit
from .strategies import Inputs, as_strategy, token_inputs

__all__ = ["AdapterContract", "Capabilities", "assert_close", "perturb", "reinit", "Inputs", "as_strategy",
           "token_inputs"]
