"""The contract suite on 8-bit models, over every installed architecture's declared contract.

Each class is :class:`lensadapters_bnb.testing.Int8Contract` in front of an architecture plugin's packaged
contract (found through its entry point and ``LENSADAPTERS_CONTRACT``: built-in and third-party plugins
alike), with that contract's ``matrix_overrides`` (every example saves and reloads a model) and without its
config strata (its float contract covers them). The TransformerLens identities and the head-ablation property
are checked against :func:`lensadapters_bnb.matmul_error_bound` instead of a fixed float tolerance.
"""

import pytest

pytest.importorskip("bitsandbytes")
from lensadapters_bnb.testing import Int8Contract  # noqa: E402

from lensadapters.testing import contract_matrix  # noqa: E402

contract_matrix(Int8Contract, globals())
