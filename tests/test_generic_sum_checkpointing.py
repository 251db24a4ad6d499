"""Gradients through an edit of a branch point :class:`SumSite` serves (a layer whose own sums compute its branch
contributions: GraniteMoeHybrid's shared MLP beside its experts and ``residual_multiplier``, Falcon-H1's
``attention_out_multiplier``/``ssm_out_multiplier``) under gradient checkpointing, reentrant and not.

Transformers 5.x checkpoints a layer's ``forward`` and runs the layer's own forward hooks outside it, once: the old
site rebuilt the layer's output in the layer's forward hook, from values a reentrant checkpoint's first forward
computed without gradients (58 to 66 parameter gradients None), and the recomputation ran without its edits (off
by 0.076 to 0.48 of the largest gradient, non-reentrant). Float32, a leaf ``delta`` added at the point: every
gradient under checkpointing against the unchecked run's within 1e-5 of the largest (measured: at most 1.5e-6 on
5.24, 2.8e-6 on 4.57).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import assert_checkpointed_gradients_match, tiny_model, wrap_generic

GRANITE = {"residual_multiplier": 0.22}
FALCON = {"attention_out_multiplier": 0.75, "ssm_out_multiplier": 1.25}
CASES = [
    ("granitemoehybrid", GRANITE, "blocks.1.hook_attn_out"),
    ("granitemoehybrid", GRANITE, "blocks.0.hook_resid_mid"),
    ("granitemoehybrid", {}, "blocks.1.hook_mlp_out"),  # the shared MLP and the experts' sum, unscaled
    ("falcon_h1", FALCON, "blocks.1.hook_attn_out"),
    ("falcon_h1", FALCON, "blocks.1.hook_mixer_out"),
    ("falcon_h1", FALCON, "blocks.1.hook_mlp_out"),
]


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize(("model_type", "config", "point"), CASES, ids=lambda c: str(c))
def test_sum_edit_gradients_under_checkpointing(model_type, config, point, reentrant) -> None:
    assert_checkpointed_gradients_match(model_type, config, point, reentrant)


def test_sum_edit_values_bitwise_without_checkpointing() -> None:
    """Not checkpointed (train mode too), an edit's logits are the old rule's bit for bit: no carry."""
    model: Any = tiny_model("granitemoehybrid", **GRANITE)
    hm: Any = wrap_generic(model)
    ids = input_ids(1)
    edit = [("blocks.1.hook_attn_out", lambda t, hook: t * 1.5)]
    try:
        model.train()
        with torch.no_grad():
            trained = hm.run_with_hooks(ids, use_cache=False, fwd_hooks=edit)
        model.eval()
        with torch.no_grad():
            evaluated = hm.run_with_hooks(ids, use_cache=False, fwd_hooks=edit)
            plain = hm.run_with_hooks(ids, use_cache=False)
    finally:
        hm.unwrap()
    assert torch.equal(getattr(trained, "logits", trained), getattr(evaluated, "logits", evaluated))
    assert not torch.equal(getattr(evaluated, "logits", evaluated), getattr(plain, "logits", plain))
