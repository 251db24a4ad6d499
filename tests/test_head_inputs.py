"""Head-input hook points (``hook_attn_in``, ``hook_q_input``, ``hook_k_input``, ``hook_v_input``): computed only
while hooked, shaped as in TransformerLens, and an edit of one head's copy changes that head's side of the
attention and nothing else."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from lensadapters import HookedModel
from lensadapters.testing import assert_close
from lensadapters.testing.tiny_models import ARCH_NAMES, from_config, gqa_llama, needs, tiny

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIDE = {"q_input": "q", "k_input": "k", "v_input": "v"}


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("arch", ARCH_NAMES)
@SETTINGS
@given(data=st.data())
def test_one_heads_input_edit_changes_only_that_heads_projection(arch: str, data: st.DataObject) -> None:
    hm = HookedModel.wrap(tiny(arch, data.draw(st.integers(0, 60), label="seed")))
    served = [(i, p) for i in range(hm.cfg.n_layers) for p in SIDE if f"blocks.{i}.hook_{p}" in hm.hook_names]
    if not served:  # blocks with another token mixer, or queries a plugin serves its own way: no per-head inputs
        hm.unwrap()
        return
    layer, point = data.draw(st.sampled_from(served), label="layer, point")
    heads = hm.cfg.n_heads if point == "q_input" else hm.cfg.n_key_value_heads
    head = data.draw(st.integers(0, heads - 1), label="head")
    ids = torch.randint(0, hm.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(head))
    projection = f"blocks.{layer}.attn.hook_{SIDE[point]}"
    name = f"blocks.{layer}.hook_{point}"

    noise = torch.randn(hm.cfg.d_model, generator=torch.Generator().manual_seed(layer))

    def edit(x: torch.Tensor, hook: Any) -> torch.Tensor:  # (a norm ignores shifts and scalings: add noise)
        assert x.shape == (2, 5, heads, hm.cfg.d_model), x.shape
        x = x.clone()
        x[:, :, head] = x[:, :, head] + noise
        return x

    with torch.no_grad():
        _, before = hm.run_with_cache(ids, names_filter=[projection, name])
        with hm.hooks([(name, edit)]):
            _, after = hm.run_with_cache(ids, names_filter=[projection])
    others = [h for h in range(heads) if h != head]
    assert torch.equal(after[projection][:, :, others], before[projection][:, :, others])  # bitwise
    assert (after[projection][:, :, head] - before[projection][:, :, head]).abs().max() > 1e-4
    # the input is the block input repeated per head; the edited head's projection is W applied to its norm
    resid = hm.run_with_cache(ids, names_filter=f"blocks.{layer}.hook_resid_pre")[1]["resid_pre", layer]
    assert torch.equal(before[name], resid[:, :, None].expand(-1, -1, heads, -1))
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_head_inputs_cost_nothing_unhooked_and_identity_edits_are_bitwise(arch: str) -> None:
    model = tiny(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    hm = HookedModel.wrap(model)
    before = hook_count(model)
    with torch.no_grad():
        reference = hm(ids).logits
        _, cache = hm.run_with_cache(ids)  # default caching leaves the [b, p, h, d_model] inputs out
        head_inputs = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")
        assert not any(key.endswith(head_inputs) for key in cache)
        names = [n for n in hm.hook_names if n.endswith(head_inputs)]
        logits = hm.run_with_hooks(ids, fwd_hooks=[(n, lambda x, hook: x.clone()) for n in names])
    assert torch.equal(logits, reference)
    assert hook_count(model) == before
    hm.unwrap()


@needs("llama")
def test_grouped_query_attention_has_key_value_head_inputs_and_no_attn_in() -> None:
    config = gqa_llama()
    hm = HookedModel.wrap(from_config(config))
    assert "blocks.0.hook_attn_in" not in hm.hook_names
    with torch.no_grad():
        _, cache = hm.run_with_cache(torch.zeros(1, 3, dtype=torch.long), names_filter=lambda n: "_input" in n)
    assert cache["blocks.0.hook_q_input"].shape == (1, 3, 4, 32)
    assert cache["blocks.0.hook_k_input"].shape == cache["blocks.0.hook_v_input"].shape == (1, 3, 2, 32)
    hm.unwrap()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_attn_in_edit_is_the_same_edit_of_all_three_inputs(arch: str) -> None:
    hm = HookedModel.wrap(tiny(arch, 1))
    if "blocks.0.hook_attn_in" not in hm.hook_names:
        hm.unwrap()
        pytest.skip("grouped-query attention: no attn_in")
    ids = torch.randint(0, hm.cfg.d_vocab, (1, 6), generator=torch.Generator().manual_seed(1))
    noise = torch.randn(hm.cfg.d_model, generator=torch.Generator().manual_seed(2))

    def edit(x: torch.Tensor, hook: Any) -> torch.Tensor:
        x = x.clone()
        x[:, :, 0] += noise
        return x

    with torch.no_grad():
        one = hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_attn_in", edit)])
        three = hm.run_with_hooks(ids, fwd_hooks=[(f"blocks.0.hook_{p}", edit) for p in SIDE])
    assert_close(one, three, "attn_in vs q/k/v inputs")
    assert (one - hm(ids).logits).abs().max() > 1e-4
    hm.unwrap()


@needs("llama")
@pytest.mark.parametrize("point", ["hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input"])
def test_gradient_through_a_head_input_edit_that_changes_nothing_yet(point: str) -> None:
    """``d(metric)/dp`` of the edit ``x + p * c`` at ``p = 0`` (the value unchanged: attribution patching's
    derivative) is the finite-difference derivative, hooked alone and with the other points hooked too."""
    from lensadapters.testing.gradients import gradient_check

    config = LlamaConfig(
        vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    model = from_config(config, 3).double()
    hm = HookedModel.wrap(model)
    ids = torch.randint(0, 48, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask)
    names = [f"blocks.{layer}.{point}" for layer in range(2)]
    for batched in (False, True):
        for name in names:
            check, _ = gradient_check(hm, kwargs, mask.bool(), [name], batched=batched)
            assert check.names == [name]
            assert check.numeric.abs().min() > 1e-3, "a derivative too small to tell a cut gradient from rounding"
            assert not check.failures, check.failures
    hm.unwrap()
