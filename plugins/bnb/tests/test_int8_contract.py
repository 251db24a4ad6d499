"""The contract suite on 8-bit models, over every installed architecture's declared contract.

Each class is :class:`lensadapters_bnb.testing.Int8Contract` in front of an architecture plugin's packaged
contract (found through its entry point and ``LENSADAPTERS_CONTRACT``: built-in and third-party plugins
alike), with that contract's ``matrix_overrides`` (every example saves and reloads a model) and without its
config strata (its float contract covers them). The TransformerLens identities and the head-ablation property
are checked against :func:`lensadapters_bnb.matmul_error_bound` instead of a fixed float tolerance.
"""

import pytest

pytest.importorskip("bitsandbytes")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from lensadapters_bnb.testing import RELOAD_SETTINGS, Int8Contract  # noqa: E402

from lensadapters.testing import contract_matrix  # noqa: E402

MATRIX = contract_matrix(Int8Contract, globals())
#: the 8-bit classes whose architecture declares points whose edits norms further on undo (``absorbed_points``)
ABSORBING = [globals()[name] for name in MATRIX if globals()[name].absorbed_points]


@pytest.mark.skipif(not ABSORBING, reason="no installed architecture declares absorbed points")
@pytest.mark.parametrize("variant", ABSORBING, ids=[c.__name__ for c in ABSORBING])
@settings(RELOAD_SETTINGS, max_examples=1)
@given(data=st.data())
def test_the_int8_edit_property_checks_an_absorbed_point_on_its_witness(variant: type, data: st.DataObject) -> None:
    """An edit of a declared ``absorbed_points`` point (Gemma 4's ``ln1.hook_scale``) changes the logits of an
    8-bit model by at most the norms' eps, as it does the float model's: the 8-bit edit property checks it as the
    float one does, on the next hook point (it asserted a logit change, and failed on a drawn Gemma 4 example at
    threshold 6). Each absorbed point of every layer."""
    contract = variant()
    model, inputs = contract.draw(data)
    hm = contract.wrap(model)
    absorbed = [f"blocks.{layer}.{point}" for layer in range(hm.cfg.n_layers) for point in contract.absorbed_points]
    with torch.no_grad():
        reference = hm(**inputs.kwargs()).logits
        for name in absorbed:
            contract.assert_edit_shows(hm, model, inputs, name, reference)
    hm.unwrap()
