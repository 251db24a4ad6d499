"""Gradients through an edit of a branch point :class:`~lensadapters.hooks.sites.ScaledBranchSite` serves (a block
that adds its branches times constants: Granite's and GraniteMoe's ``residual_multiplier``) under gradient
checkpointing, reentrant and not.

Transformers 5.x checkpoints a layer's ``forward`` and runs the layer's own forward hooks outside it, once: the old
site rebuilt the block's output (``mid + mlp_out``) in the block's forward hook, from values a reentrant checkpoint's
first forward computed without gradients (38 of 40, 54 of 56 parameter gradients None for an edit before the MLP, 19
of 40 and 27 of 56 for ``hook_mlp_out``). Float32, a leaf ``delta`` added at the point: every gradient under
checkpointing against the unchecked run's within 1e-5 of the largest (measured: at most 4.0e-6 on 5.24, 5.9e-6 on
4.57, where the layer's hooks are checkpointed too and the old site was exact).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import assert_checkpointed_gradients_match, tiny_model, wrap_generic

CONFIGS = [{"residual_multiplier": 0.22}, {"residual_multiplier": 0.5, "attention_bias": True}]
POINTS = ["hook_attn_out", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out", "attn.hook_result"]
CASES = [(t, c, f"blocks.1.{p}") for t in ("granite", "granitemoe") for c in CONFIGS for p in POINTS]


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize(("model_type", "config", "point"), CASES, ids=lambda c: str(c))
def test_scaled_branch_edit_gradients_under_checkpointing(model_type, config, point, reentrant) -> None:
    assert_checkpointed_gradients_match(model_type, config, point, reentrant)


@pytest.mark.parametrize("point", ["blocks.1.hook_attn_out", "blocks.1.hook_mlp_out"])
def test_scaled_branch_edit_values_bitwise_without_checkpointing(point: str) -> None:
    """Not checkpointed (train mode too), an edit's logits are the old rule's bit for bit (no carry); checkpointed,
    the carried output is the same up to rounding, and ``hook_resid_post`` after it still reads the block's output."""
    model: Any = tiny_model("granite", residual_multiplier=0.22)
    hm: Any = wrap_generic(model)
    ids = input_ids(1)
    seen: list[torch.Tensor] = []
    edit = [(point, lambda t, hook: t * 1.5), ("blocks.1.hook_resid_post", lambda t, hook: seen.append(t.clone()))]

    def logits() -> torch.Tensor:
        with torch.no_grad():
            out = hm.run_with_hooks(ids, use_cache=False, fwd_hooks=edit)
        return getattr(out, "logits", out)

    try:
        model.train()
        trained = logits()
        model.eval()
        evaluated = logits()
        with torch.no_grad():
            plain = hm.run_with_hooks(ids, use_cache=False)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        checked = logits()
    finally:
        hm.unwrap()
    assert torch.equal(trained, evaluated)
    assert torch.equal(seen[0], seen[1])
    assert not torch.equal(evaluated, getattr(plain, "logits", plain))
    torch.testing.assert_close(checked, evaluated, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen[2], seen[1], rtol=1e-5, atol=1e-5)
