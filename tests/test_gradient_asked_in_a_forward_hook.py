"""A forward hook that asks for its activation's gradient and returns nothing — ``act.register_hook(...)`` or
``act.retain_grad()``, as TransformerLens users write attribution code — gets that gradient. A hook that may edit is
given a copy of the model's tensor; an unedited copy used to be dropped for the model's own tensor, so the gradient
asked of the copy never came, silently. It must equal the gradient a backward hook at the same point receives."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lensadapters import HookedModel
from lensadapters.hf import size_fields
from lensadapters.testing import reinit

POINTS = (
    "blocks.0.hook_resid_pre",
    "blocks.1.hook_resid_mid",
    "blocks.0.attn.hook_q",
    "blocks.1.attn.hook_pattern",
    "blocks.0.attn.hook_z",
    "blocks.1.mlp.hook_post",
    "blocks.0.ln2.hook_scale",
    "blocks.1.hook_resid_post",
)


@pytest.fixture(scope="module")
def hooked() -> HookedModel:
    torch.manual_seed(0)
    config = LlamaConfig(**size_fields(hidden=16, d_mlp=24, layers=2, heads=4, kv_heads=2, vocab=32, positions=32))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    reinit(model, 0)
    return HookedModel.wrap(model.eval())


def _ids() -> torch.Tensor:
    return torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))


def _backward_hook_gradient(hm: HookedModel, point: str) -> torch.Tensor:
    grads: list[torch.Tensor] = []
    hm.model.zero_grad(set_to_none=True)
    with hm.hooks(bwd_hooks=[(point, lambda grad, hook: grads.append(grad.detach().clone()))]):
        hm(_ids()).logits.square().sum().backward()
    assert len(grads) == 1
    return grads[0]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("asks", ["register_hook", "retain_grad"])
def test_a_gradient_asked_in_a_forward_hook_comes_and_is_the_backward_hooks(hooked, point: str, asks: str) -> None:
    seen: list[torch.Tensor] = []

    def ask(act: torch.Tensor, hook) -> None:  # noqa: ANN001
        if asks == "register_hook":
            act.register_hook(lambda grad: seen.append(grad.detach().clone()))
        else:
            act.retain_grad()
            seen.append(act)

    hooked.model.zero_grad(set_to_none=True)
    logits = hooked.run_with_hooks(_ids(), fwd_hooks=[(point, ask)])
    logits.square().sum().backward()
    assert len(seen) == 1, f"{point}: the forward hook did not run once"
    got = seen[0] if asks == "register_hook" else seen[0].grad
    assert got is not None, f"{point}: the gradient asked in the forward hook never came"
    expected = _backward_hook_gradient(hooked, point)
    assert torch.equal(got, expected), f"{point}: {(got - expected).abs().max()}"


@pytest.mark.parametrize("point", POINTS)
def test_asking_for_a_gradient_changes_no_value(hooked, point: str) -> None:
    """The model goes on with the copy the gradient was asked of: the same numbers as the hooked run without the
    request (a hook that only reads)."""
    with torch.no_grad():
        reading = hooked.run_with_hooks(_ids(), fwd_hooks=[(point, lambda act, hook: None)])
    asking = hooked.run_with_hooks(
        _ids(), fwd_hooks=[(point, lambda act, hook: act.register_hook(lambda g: None) and None)]
    )
    torch.testing.assert_close(asking.detach(), reading, rtol=0, atol=0)
