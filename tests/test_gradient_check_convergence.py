"""The gradient check (``lensadapters.testing.gradients.gradient_check``) where finite differences do not converge:
a point whose metric is far from linear within the smallest step is left out (``GradientCheck.unconverged``), and a
wrong gradient at a smooth point still fails."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from lensadapters import HookedModel
from lensadapters.testing.gradients import gradient_check
from lensadapters.testing.tiny_models import from_config, needs

#: upstream of layer 1's MLP (where the tests' plain PyTorch hooks act), and one point downstream of it
UPSTREAM = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_mid", "blocks.1.ln2.hook_normalized"]
DOWNSTREAM = ["blocks.1.hook_resid_post"]


def _model() -> tuple[torch.nn.Module, dict, torch.Tensor]:
    config = LlamaConfig(
        vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    model = from_config(config, 3).double()
    ids = torch.randint(0, 48, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return model, dict(input_ids=ids, attention_mask=mask), mask.bool()


class _WrongBackward(torch.autograd.Function):
    """The identity whose backward is three times the gradient: a planted wrong gradient (the forward exact)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return 3 * grad


class _Merged:
    def __init__(self, checks: list[Any]):
        self.failures = [f for c in checks for f in c.failures]
        self.names = [n for c in checks for n in c.names]
        self.unconverged = sorted(n for c in checks for n in c.unconverged)
        self.tied = sorted(n for c in checks for n in c.tied)


def _check(model: torch.nn.Module, kwargs: dict, valid: torch.Tensor, batched: bool) -> Any:
    """Every point side by side (``batched``), or each point alone (the check takes one point at a time then)."""
    names = UPSTREAM + DOWNSTREAM
    hm = HookedModel.wrap(model)
    try:
        groups = [names] if batched else [[name] for name in names]
        return _Merged([gradient_check(hm, kwargs, valid, group, seed=1, batched=batched)[0] for group in groups])
    finally:
        hm.unwrap()


@needs("llama")
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "alone"])
def test_a_wrong_gradient_at_a_smooth_point_still_fails(batched: bool) -> None:
    """A planted wrong backward in layer 1's MLP (a plain PyTorch hook): every point upstream of it fails, none is
    left out as unconverged (the small steps agree with each other, not with autograd); the point downstream
    passes; without the planted backward nothing fails."""
    model, kwargs, valid = _model()
    clean = _check(model, kwargs, valid, batched)
    assert not clean.failures and not clean.unconverged, (clean.failures, clean.unconverged)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, args, out: _WrongBackward.apply(out))
    try:
        check = _check(model, kwargs, valid, batched)
    finally:
        handle.remove()
    failed = {f.split(":")[0] for f in check.failures}
    assert failed == set(UPSTREAM), check.failures
    assert check.unconverged == [] and check.tied == []


@needs("llama")
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "alone"])
def test_a_point_whose_finite_differences_do_not_converge_is_left_out(batched: bool) -> None:
    """Layer 1's MLP output plus a smooth step of width 1e-7 near the value (``tanh``, a plain PyTorch hook): autograd
    is exact, but no central difference at a step of 1e-3 or 1e-4 is a derivative there (they scale as 1/h and
    disagree with each other). The points upstream of it are left out as unconverged, not failed; the point
    downstream is still compared and passes."""
    model, kwargs, valid = _model()
    with torch.no_grad():
        seen: dict[str, torch.Tensor] = {}
        grab = model.model.layers[1].mlp.register_forward_hook(lambda m, args, out: seen.update(out=out))
        model(**kwargs)
        grab.remove()
    # a step in each row's first feature at its last token, 2e-7 from the value (its width 1e-7)
    centre = seen["out"][:, -1, 0] + 2e-7

    def sharp(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(out.shape[0]) % centre.shape[0]
        jump = 0.01 * torch.tanh((out[:, -1, 0] - centre[rows]) / 1e-7)
        return out + torch.nn.functional.pad(jump[:, None, None], (0, out.shape[-1] - 1, out.shape[1] - 1, 0))

    handle = model.model.layers[1].mlp.register_forward_hook(sharp)
    try:
        check = _check(model, kwargs, valid, batched)
    finally:
        handle.remove()
    assert not check.failures, check.failures
    assert check.unconverged == sorted(UPSTREAM)
    assert check.names == DOWNSTREAM
