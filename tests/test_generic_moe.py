"""The automatic description of mixture-of-experts MLPs (:mod:`lensadapters.adapters.generic.moe`): a MoE the
generic adapter describes serves the routing points it verified, and an edit there reaches the logits exactly as the
same edit made by a plain PyTorch hook; a MoE it cannot describe leaves the rest of its layer described."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from lensadapters import HookedModel
from lensadapters.adapters.generic import GenericAdapterWarning, findings
from lensadapters.moe import MoELayout, MoESite
from lensadapters.testing import assert_close
from lensadapters.testing.every_model_type import build, input_ids
from lensadapters.testing.generic import check_described_weights
from lensadapters.testing.moe_reference import moe_reference
from lensadapters.testing.strategies import Inputs
from lensadapters.wiring.weights import mlp_weights

FUSED = transformers.__version__.startswith("5.")  # transformers 5 stores the experts as 3-D parameters


def _wrapped(model_type: str) -> tuple[torch.nn.Module, HookedModel]:
    model = build(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GenericAdapterWarning)
        return model, HookedModel.wrap(model)


@pytest.mark.skipif(not FUSED, reason="fused experts modules exist from transformers 5")
@pytest.mark.parametrize("model_type", ["glm4_moe", "aria_text", "flint"])
def test_a_routing_weights_edit_reaches_the_logits_as_a_plain_hook_on_the_experts_call(model_type: str) -> None:
    """GLM-4-MoE (a dense first layer, sigmoid routing with a selection bias, a shared expert), Aria (transposed
    expert parameters, a shared expert) and Flint (a shared expert reading the flattened input): the last layer is
    described as a MoE, its routing weights are what the experts module is called with, and adding a delta there
    moves the logits exactly as adding it to that call's argument with a plain PyTorch pre-hook does. The experts'
    weights read from the description (``W_in``, ``W_gate``, ``W_out`` of each expert) and the shared expert give
    the MoE module's output."""
    model, hm = _wrapped(model_type)
    layer = len(hm.block_modules) - 1
    layout = hm.mlp_layouts[layer]
    assert isinstance(layout, MoELayout), findings(model).missing
    name = f"blocks.{layer}.mlp.hook_routing_weights"
    assert {name, f"blocks.{layer}.mlp.hook_router_logits"} <= set(hm.hook_names)
    ids = input_ids()
    experts = hm.block_modules[layer].get_submodule(layout.experts.module)
    seen: list[torch.Tensor] = []
    record = experts.register_forward_pre_hook(lambda m, args: seen.append(args[2].clone()))
    with torch.no_grad():
        plain, cache = hm.run_with_cache(ids, names_filter=[name])
    record.remove()
    assert_close(cache[name], seen[0].reshape(cache[name].shape), f"{model_type} routing weights")
    delta = torch.randn(cache[name].shape, generator=torch.Generator().manual_seed(3)) * 0.3
    with torch.no_grad():
        edited = hm.run_with_hooks(ids, fwd_hooks=[(name, lambda t, hook: t + delta)])
        handle = experts.register_forward_pre_hook(
            lambda m, args: (args[0], args[1], args[2] + delta.reshape(args[2].shape))
        )
        try:
            by_plain_hook = model(ids).logits
        finally:
            handle.remove()
    assert not torch.allclose(edited, plain)
    assert_close(edited, by_plain_hook, f"{model_type}: a routing weights edit")
    # the experts' weights as the core reads them from the description give the MoE module's output
    moe = hm.block_modules[layer].get_submodule(hm.block_layouts[layer].mlp)
    calls: list = []
    handles = [
        moe.register_forward_hook(lambda m, args, out: calls.append((args[0], out))),
        experts.register_forward_pre_hook(lambda m, args: calls.append(args[1:])),
    ]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    (index, weights), (x, out) = calls
    flat = x.reshape(-1, x.shape[-1])
    assert_close(moe_reference(hm, layer, flat, weights, index).reshape(out.shape).float(), out, "experts' weights")
    # the generic contract's weight check runs on it (regression: it read every MLP as a dense one)
    check_described_weights(hm, Inputs(ids, torch.ones_like(ids), [0]))
    hm.unwrap()


def test_a_moe_that_is_not_described_keeps_the_rest_of_its_layer_and_says_why() -> None:
    """Regression (the whole layer's description was dropped): a MoE whose experts are not described (Qwen2-MoE's
    sigmoid-gated shared expert under transformers 5; under 4.57, where its ModuleList of experts and gated shared
    expert are described, PhiMoE's sparsemixer routing) leaves the layer's queries, keys, values and norm scales
    served and verified; it has hook_mlp_out and no mlp.* point, its MLP weights are refused, and the warning says
    why."""
    model, hm = _wrapped("qwen2_moe" if FUSED else "phimoe")
    names = set(hm.hook_names)
    assert {"blocks.0.attn.hook_q", "blocks.0.ln2.hook_scale", "blocks.0.hook_resid_mid"} <= names
    assert "blocks.0.hook_mlp_out" in names and not any(".mlp." in n for n in names)
    why = findings(model).missing["mlp.hook_pre and mlp.hook_post (and the MLP weights)"]
    assert "mixture of experts" in why
    with pytest.raises(Exception, match="not described"):
        mlp_weights(hm.wiring, len(hm.block_modules) - 1, "in")
    hm.unwrap()


@pytest.mark.skipif(not FUSED, reason="fused experts modules exist from transformers 5")
def test_the_verification_catches_a_wrong_routing() -> None:
    """Regression guard of the verifier on MoE points: with the routing weights described as twice what they are,
    an edit of the router's logits fails (the core routes the edited logits with that routing, the model with its
    own); the right description passes both points."""
    import dataclasses

    from lensadapters.adapters.generic.verify import check_points

    model, hm = _wrapped("glm4_moe")
    wiring, layer = hm.wiring, len(hm.block_modules) - 1
    names = [f"blocks.{layer}.mlp.hook_routing_weights", f"blocks.{layer}.mlp.hook_router_logits"]
    assert all(why is None for why in check_points(wiring, input_ids(), names).values())
    layout = wiring.mlp_layouts[layer]
    site = next(s for s in wiring._sites if isinstance(s, MoESite) and s.layout is layout)
    site.layout = dataclasses.replace(layout, routing=dataclasses.replace(layout.routing, scale=2.0))
    try:
        problems = check_points(wiring, input_ids(), names)
    finally:
        site.layout = layout
    assert problems[names[1]] is not None, problems
    hm.unwrap()


def test_a_moe_whose_output_the_block_normalizes_is_opaque_not_refused() -> None:
    """Regression (the wrap was refused: the core serves MoE points only where the block adds the MoE's output as it
    is): FlexOlmo normalizes each branch's output, so its MoE is opaque, and the rest of the layer is served."""
    from lensadapters.testing.every_model_type import NotBuildable

    try:
        model, hm = _wrapped("flex_olmo")
    except NotBuildable as why:
        pytest.skip(f"flex_olmo: {why}")
    assert {"blocks.0.attn.hook_q", "blocks.0.hook_mlp_out"} <= set(hm.hook_names)
    assert "normalizes its output" in findings(model).missing["mlp.hook_pre and mlp.hook_post (and the MLP weights)"]
    hm.unwrap()


@pytest.mark.skipif(not FUSED, reason="fused experts modules exist from transformers 5")
def test_a_router_given_more_than_the_mlp_input_is_not_described() -> None:
    """Regression (MiniMax-M2 was described without the selection bias its MoE module hands the router, zero in the
    tiny model): a router called with more than the MLP input routes by something a Routing does not name, so the
    MoE is opaque and says so."""
    model, hm = _wrapped("minimax_m2")
    assert not any(isinstance(layout, MoELayout) for layout in hm.mlp_layouts)
    why = findings(model).missing["mlp.hook_pre and mlp.hook_post (and the MLP weights)"]
    assert "called with more than the MLP input" in why
    hm.unwrap()
