"""Gradients through an edit of a mixer-form layer's ``hook_resid_mid`` (``ResidMidSite``: the input of the norm, or
MLP, reading ``resid_pre + mixer_out``) under gradient checkpointing, reentrant and not. The layer adds its own copy
of ``resid_mid`` to the MLP's output; transformers 5.x runs a layer's own forward hooks outside the checkpointed
function (a reentrant checkpoint's first forward runs without gradients), so while the layer trains with
checkpointing the edit's difference is carried into the MLP branch's output inside the layer, which the
recomputation recomputes with gradients.

Float32, train mode without dropout, a leaf ``delta`` added at the point: the gradients of every parameter and of
``delta`` under checkpointing against the wrapped model's run without it, within 1e-5 of the largest gradient
(measured on transformers 5.24: at most 8.2e-7, OLMo-Hybrid's; the old code was off by 0.15 of it on Jamba and
0.175 on OLMo-Hybrid under reentrant checkpointing).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch

from lensadapters import HookedModel, Registry
from lensadapters.adapters.generic import GenericAdapterWarning
from lensadapters.testing.every_model_type import NotBuildable, build, input_ids

#: (model type, layers, the edited point)
CASES = [
    ("jamba", 8, "blocks.1.hook_resid_mid"),  # an MoE layer's: the MLP child a sparse block
    ("falcon_h1", None, "blocks.1.hook_resid_mid"),  # after the sum of two scaled mixers (.parallel's split)
    ("olmo_hybrid", None, "blocks.0.hook_resid_mid"),
]


def _no_dropout(model: Any) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for name in dir(model.config):
        if "dropout" in name and isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)


def grads(model_type: str, layers: Optional[int], point: str, checkpointing: Optional[bool]) -> dict[str, Any]:
    """The gradients of a loss on the logits with ``point`` adding a leaf ``delta``; ``checkpointing``: None, or
    whether reentrant."""
    try:
        model: Any = build(model_type, layers=layers)
    except NotBuildable as why:
        pytest.skip(f"{model_type}: {why}")
    _no_dropout(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericAdapterWarning)
        hm: Any = HookedModel.wrap(model, registry=Registry())
    assert point in hm.hook_dict, point
    model.train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    ids = input_ids(1)
    d = int(model.config.hidden_size)
    g = torch.Generator().manual_seed(2)
    delta = (0.3 * torch.randn(1, ids.shape[1], d, generator=g)).requires_grad_(True)
    try:
        logits = hm.run_with_hooks(ids, use_cache=False, fwd_hooks=[(point, lambda t, hook: t + delta)])
        logits = getattr(logits, "logits", logits)
        logits.square().sum().backward()
    finally:
        hm.unwrap()
    return {"delta": delta.grad} | {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize(("model_type", "layers", "point"), CASES, ids=lambda c: str(c))
def test_resid_mid_edit_gradients_under_checkpointing(model_type, layers, point, reentrant) -> None:
    """Every gradient (each parameter's and the delta's) under checkpointing is the unchecked run's within 1e-5 of
    the largest gradient (float32 rounding: the recomputation and the carried difference sum in another order)."""
    unchecked = grads(model_type, layers, point, None)
    checked = grads(model_type, layers, point, reentrant)
    assert unchecked["delta"] is not None and unchecked["delta"].abs().sum() > 0
    assert sorted(checked) == sorted(unchecked)
    top = max(g.abs().max().item() for g in unchecked.values())
    worst = max((checked[n] - g).abs().max().item() for n, g in unchecked.items()) / top
    assert worst < 1e-5, f"{model_type}: {worst:.3g} of the largest gradient ({top:.3g})"
    for name, grad in unchecked.items():
        torch.testing.assert_close(checked[name], grad, rtol=1e-5, atol=1e-5 * top, msg=name)
