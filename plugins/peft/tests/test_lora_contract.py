"""The contract suite on LoRA-adapted models, over every installed architecture's declared contract.

Each class is :class:`lensadapters_peft.testing.LoraContract` in front of an architecture plugin's packaged
contract (found through its entry point and ``LENSADAPTERS_CONTRACT``: built-in and third-party plugins
alike), with that contract's ``matrix_overrides`` (every example builds two models and adapts one) and
without its config strata (its float contract covers them): ``PeftModel``s with seed-chosen subsets of
adapted projections, one or two active adapters, rsLoRA and LoRA biases. Besides every generic property it
checks LoRA's own (the ``*_lora`` hook points, disabled / merged / switched adapters, effective weights and
factors).
"""

import warnings

import pytest

pytest.importorskip("peft")
from lensadapters_peft.testing import LoraContract  # noqa: E402

from lensadapters.testing import contract_matrix  # noqa: E402

warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")

contract_matrix(LoraContract, globals())
