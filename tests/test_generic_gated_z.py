"""The attention output changed before the output projection (:mod:`lensadapters.adapters.generic.gated_z`): BitNet's
``attn_sub_norm`` (a norm) and Laguna's/AFMoE's output gates, described automatically, and BitNet's ``ffn_sub_norm``
between the MLP's hidden and its down projection. ``attn.hook_z`` is the attention function's output (before the
norm or gate), its edits and gradients those of a plain PyTorch hook there; ``attn.hook_result`` and ``W_O`` are
refused by name; ``mlp.hook_post`` is the down projection's input (after the MLP's norm)."""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import pytest
import torch
import transformers
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lensadapters.adapters.generic import findings
from lensadapters.adapters.generic.plugin import summary
from lensadapters.errors import WeightUnavailableError
from lensadapters.testing.every_model_type import build
from lensadapters.testing.generic_support import built_and_wrapped, sample_ids, wrap_generic

GATED = [t for t in ("bitnet", "laguna", "afmoe") if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]


@pytest.fixture(scope="module")
def bitnet() -> Iterator[tuple[Any, Any]]:
    yield from built_and_wrapped("bitnet")


@pytest.mark.parametrize("model_type", GATED)
def test_a_gated_or_normalized_attention_output_is_described_with_hook_z_and_no_result(model_type: str) -> None:
    """Every layer is described (hook_z served, its attention points and ``mlp.hook_post`` verified at wrap time;
    Laguna's expert points have no reference, as before), ``hook_result`` is absent and ``W_O`` is refused with the
    reason; the other weights are served."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: Any = build(model_type)
    hm = wrap_generic(model)
    try:
        found = findings(model)
        assert found.description is not None and all(d is not None and d.z_changed for d in found.description.layers)
        assert not [name for name in found.unverified if ".attn." in name or ".mlp.hook_post" in name]
        n = model.config.num_hidden_layers
        assert all(f"blocks.{i}.attn.hook_z" in hm.hook_names for i in range(n))
        assert not any(f"blocks.{i}.attn.hook_result" in hm.hook_names for i in range(n))
        with pytest.raises(WeightUnavailableError, match="output gate or a norm"):
            _ = hm.W_O
        assert hm.W_Q.shape[0] == n
        assert "No attn.hook_result, W_O or b_O: the attention module changes" in summary(hm.wiring)
    finally:
        hm.unwrap()


def test_bitnet_hook_z_is_the_sub_norms_input_and_its_edit_and_gradient_are_a_plain_hooks(
    bitnet: tuple[Any, Any],
) -> None:
    """``hook_z`` is what ``attn_sub_norm`` reads (per head); adding a delta there gives the logits and the delta's
    gradient of the same addition by a plain PyTorch pre-hook on the norm (on a batch of two)."""
    model, hm = bitnet
    ids, layer = sample_ids(model), 1
    norm = hm.block_modules[layer].self_attn.attn_sub_norm
    heads, d = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    start = torch.randn(2, 7, heads, d, generator=torch.Generator().manual_seed(4))
    seen: list[torch.Tensor] = []
    plain_delta = start.clone().requires_grad_(True)

    def plain(module: nn.Module, args: tuple) -> Any:
        seen.append(args[0].detach().clone())
        return (args[0] + plain_delta.flatten(-2),)

    handle = norm.register_forward_pre_hook(plain)
    try:
        expected = model(input_ids=ids).logits
    finally:
        handle.remove()
    expected.square().sum().backward()
    read: list[torch.Tensor] = []
    delta = start.clone().requires_grad_(True)

    def edit(value: torch.Tensor, hook: Any) -> torch.Tensor:
        read.append(value.detach().clone())
        return value + delta

    logits = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", edit)])
    logits.square().sum().backward()
    torch.testing.assert_close(read[0].flatten(-2), seen[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert plain_delta.grad is not None and delta.grad is not None
    torch.testing.assert_close(delta.grad, plain_delta.grad, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits, model(input_ids=ids).logits, atol=1e-3)  # the edit moved them


def test_bitnet_mlp_hook_post_is_the_down_projections_input_after_its_norm(bitnet: tuple[Any, Any]) -> None:
    """``mlp.hook_post`` is ``down_proj``'s input, the output of ``ffn_sub_norm`` (not its input), and an edit there
    is what the down projection reads."""
    model, hm = bitnet
    ids, mlp = sample_ids(model), hm.block_modules[0].mlp
    seen: dict[str, torch.Tensor] = {}
    handles = [
        mlp.ffn_sub_norm.register_forward_pre_hook(lambda m, a: seen.setdefault("norm_in", a[0].detach().clone())),
        mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("down_in", a[0].detach().clone())),
    ]
    try:
        _, cache = hm.run_with_cache(ids, names_filter=["blocks.0.mlp.hook_post"])
    finally:
        for h in handles:
            h.remove()
    post = cache["blocks.0.mlp.hook_post"]
    torch.testing.assert_close(post, seen["down_in"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(post, seen["norm_in"], atol=1e-3)


@pytest.mark.skipif(transformers.__version__.startswith("4."), reason="Laguna is in transformers 5.x")
def test_laguna_hook_z_times_its_gate_is_the_output_projections_input() -> None:
    """Laguna multiplies the attention function's output by ``softplus(g_proj(x))``: ``hook_z`` times that gate (as
    the model broadcasts it) is ``o_proj``'s input, checked independently of the description."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: Any = build("laguna")
    hm = wrap_generic(model)
    try:
        attn, seen = hm.block_modules[0].self_attn, dict[str, torch.Tensor]()
        handles = [
            attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("o_in", a[0].detach().clone())),
            attn.g_proj.register_forward_hook(lambda m, a, y: seen.setdefault("g", y.detach().clone())),
        ]
        try:
            _, cache = hm.run_with_cache(sample_ids(model), names_filter=["blocks.0.attn.hook_z"])
        finally:
            for h in handles:
                h.remove()
        z, gate = cache["blocks.0.attn.hook_z"], torch.nn.functional.softplus(seen["g"])
        gated = z * gate.unsqueeze(-1) if gate.shape[-1] == z.shape[-2] else z.flatten(-2) * gate
        torch.testing.assert_close(gated.flatten(-2), seen["o_in"], rtol=1e-5, atol=1e-5)
    finally:
        hm.unwrap()
