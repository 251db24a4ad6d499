"""Mixtral: the contract suite in its mixture-of-experts form over random tiny Mixtral configs (2-5 experts, top-1
to top-all routing, GQA/MQA, sliding window or none, every experts implementation of transformers 5), plus the
plugin's own checks."""

from __future__ import annotations

import lensadapters_mixtral
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lensadapters_mixtral.testing import MixtralContract, mixtral_config, mixtral_configs

from lensadapters import HookedModel
from lensadapters.registry import Registry, get_registry
from lensadapters.testing import assert_close
from lensadapters.testing.family_checks import assert_window_patterns_match_eager, int8_model
from lensadapters.testing.moe_reference import assert_moe_reference, mlp_input, mlp_points, wrap_adapted_experts
from lensadapters.testing.plugins import assert_entry_point, needs_plugin


class TestMixtral(MixtralContract):
    """The plugin's contract suite (``lensadapters_mixtral.testing``, also run by ``lensadapters check mixtral``)."""


# --- Mixtral's own checks ---------------------------------------------------------------------------------------

CONTRACT = TestMixtral()
FEW = settings(deadline=None, max_examples=max(2, settings.default.max_examples // 4))


def registry(*plugins: object) -> Registry:
    reg = Registry()
    for plugin in (lensadapters_mixtral, *plugins):
        reg.register(plugin, plugin.__name__)
    return reg


def test_entry_point() -> None:
    assert_entry_point("mixtral", lensadapters_mixtral)


@FEW
@given(data=st.data())
def test_sliding_window_patterns_match_hf_eager(data: st.DataObject) -> None:
    """With a sliding window (not in the contract's configs) patterns are HF eager's and the model stays bitwise."""
    config = data.draw(mixtral_configs(sliding_window=st.integers(2, 4)), label="config")
    hm = assert_window_patterns_match_eager(CONTRACT, config, data.draw(st.integers(0, 99), label="seed"))
    hm.unwrap()


def _lora_model(seed: int) -> tuple[torch.Tensor, torch.nn.Module]:
    """The base model's ``W_in`` and a LoRA model on the experts (adapters with random, nonzero deltas)."""
    peft = pytest.importorskip("peft")
    model = CONTRACT.make_model(mixtral_config(layers=2, experts=4, top_k=2), seed)
    base_W_in = CONTRACT.wrap(model).W_in.clone()
    HookedModel.wrap(model).unwrap()
    fused = hasattr(model.model.layers[0], "mlp")
    if fused:  # transformers 5: LoRA on the fused 3-D expert parameters (PEFT's target_parameters)
        config = peft.LoraConfig(
            r=4,
            target_modules=["q_proj"],
            init_lora_weights=False,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )
    else:  # transformers 4.57: LoRA on each expert's linear layers
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "w1", "w2", "w3"], init_lora_weights=False)
    return base_W_in, peft.get_peft_model(model, config)


@pytest.mark.parametrize("seed", [0, 1])
def test_lora_on_experts(seed: int) -> None:
    """LoRA on the experts (fused parameters or expert modules): hook points see the adapted experts, the model
    stays bitwise while they are read, expert weights include the deltas (the reference MoE computed from them
    is ``hook_mlp_out``), and with the adapters disabled they are the base weights."""
    needs_plugin("peft", "LoRA layers")
    base_W_in, peft_model = _lora_model(seed)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(seed))
    hm, reference = wrap_adapted_experts(peft_model, ids, get_registry())
    with torch.no_grad():
        assert not torch.allclose(hm.W_in, base_W_in), "the LoRA delta is missing from W_in"
        with peft_model.disable_adapter():
            assert_close(hm.W_in, base_W_in, "adapters disabled: base W_in")
            _, off = hm.run_with_cache(ids, names_filter=mlp_points)
            assert_moe_reference(hm, off, [0], "adapters disabled: base experts")
        edited = hm.run_with_hooks(ids, fwd_hooks=[("blocks.0.mlp.experts.1.hook_gate", lambda t, hook: t * 2)])
        assert not torch.allclose(edited, reference)
    hm.unwrap()


def test_int8_model() -> None:
    """An 8-bit Mixtral (bitsandbytes on the CPU): transformers 4.57 quantizes each expert's linear layers, whose
    weights are read dequantized; transformers 5 keeps the fused expert parameters in float (bitsandbytes
    quantizes linear layers only). Reading every MoE point keeps the output bitwise, the per-expert points follow
    the read weights within int8 rounding, and the results sum to ``hook_mlp_out``."""
    pytest.importorskip("bitsandbytes")
    needs_plugin("bnb", "8-bit layers")
    config = mixtral_config(layers=1, experts=3, top_k=2, hidden=64, d_mlp=64, n_heads=4, head_dim=16)
    model = int8_model(CONTRACT.make_model(config, 0, "eager"))
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
        hm = HookedModel.wrap(model, registry=get_registry())
        logits, cache = hm.run_with_cache(
            ids, names_filter=lambda n: ".mlp." in n or n.endswith(("ln2.hook_normalized", "hook_mlp_out"))
        )
        assert torch.equal(logits, reference)
        x = mlp_input(hm, cache, 0).reshape(-1, 64)
        index = cache["blocks.0.mlp.hook_expert_indices"].reshape(-1, 2)
        total = torch.zeros_like(x)
        for e in range(3):
            slot, token = torch.where(index.T == e)
            gate = cache[f"blocks.0.mlp.experts.{e}.hook_gate"]
            diff = (x[token] @ hm.W_gate[0, e] - gate).abs().max() if len(token) else torch.tensor(0.0)
            assert diff <= 0.05 * (1 + gate.abs().max()), f"expert {e}: hook_gate vs dequantized W_gate"
            total.index_add_(0, token, cache[f"blocks.0.mlp.experts.{e}.hook_result"])
        assert_close(total, cache["mlp_out", 0].reshape(-1, 64), "results sum to hook_mlp_out")
        quantized = [n for n, m in model.named_modules() if "experts" in n and type(m).__name__ == "Linear8bitLt"]
        assert bool(quantized) == (not hasattr(model.model.layers[0], "mlp"))
    hm.unwrap()


def test_gradients_at_moe_points() -> None:
    """``run_with_cache(incl_bwd=True)`` gives gradients at the routing points (not the integer indices) and at
    every expert's points; a routing-weight gradient is the gradient of the loss through the experts' outputs."""
    model = CONTRACT.make_model(mixtral_config(layers=2, experts=4, top_k=2), 0)
    hm = CONTRACT.wrap(model)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    _, cache = hm.run_with_cache(ids, labels=ids, incl_bwd=True, names_filter=lambda n: ".mlp." in n)
    for layer in range(2):
        pre = f"blocks.{layer}.mlp."
        assert pre + "hook_expert_indices_grad" not in cache
        for name in ("hook_router_logits", "hook_expert_weights", "hook_routing_weights"):
            assert cache[pre + name + "_grad"].shape == cache[pre + name].shape
        for e in range(4):
            for point in ("hook_gate", "hook_pre", "hook_post", "hook_result"):
                assert cache[f"{pre}experts.{e}.{point}_grad"].shape == cache[f"{pre}experts.{e}.{point}"].shape
        # d loss / d weight[t, s] = <d loss / d result row, result row / weight>
        index = cache[pre + "hook_expert_indices"].reshape(-1, 2)
        weights = cache[pre + "hook_routing_weights"].reshape(-1, 2)
        expected = torch.zeros_like(weights)
        for e in range(4):
            slot, token = torch.where(index.T == e)
            result, grad = cache[f"{pre}experts.{e}.hook_result"], cache[f"{pre}experts.{e}.hook_result_grad"]
            expected[token, slot] = (grad * result).sum(-1) / weights[token, slot]
        assert_close(cache[pre + "hook_routing_weights_grad"].reshape(-1, 2), expected, "routing weight gradient")
    hm.unwrap()


def test_a_routing_tie_at_the_value_is_left_out_of_the_gradient_check_not_failed() -> None:
    """Regression: the gradient property failed a Qwen 3.5 MoE draw at ``hook_router_logits`` and the expert points,
    where two experts' logits sat within the smallest finite-difference step of each other: the central difference
    straddles the expert switch, and no step gives the one-sided derivative autograd (rightly) gives. Here experts 1
    and 2 have the same router row (an exact tie for the second slot on every token): the check finds the expert
    choice differing between ``+h`` and ``-h`` (its ``hook_expert_indices``, hooked as the contract hooks every
    point) and leaves the point out (``GradientCheck.tied``); every point upstream of the router (the tie holds
    whatever they are) is still compared, and agrees."""
    from lensadapters.testing.gradients import gradient_check

    model = CONTRACT.gradient_model(CONTRACT.make_model(mixtral_config(layers=1, experts=4, top_k=2), 0))
    layer = model.model.layers[0]
    gate = (layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe).gate  # transformers 5 / 4.57
    with torch.no_grad():
        gate.weight[0] = 0.0
        gate.weight[2] = gate.weight[1]
        gate.weight[3] = -gate.weight[1]
        gate.weight[1] *= 0.0
    hm = CONTRACT.wrap(model)
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    kwargs, valid = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.ones_like(ids, dtype=torch.bool)
    logits = "blocks.0.mlp.hook_router_logits"
    upstream = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.0.attn.hook_z", "blocks.0.hook_resid_mid"]
    indices = "blocks.0.mlp.hook_expert_indices"  # read, not edited: how the check sees the expert choice
    check, _ = gradient_check(hm, kwargs, valid, [logits, indices, *upstream], seed=1)
    assert check.tied == [logits], (check.tied, check.failures)
    assert set(upstream) <= set(check.names) and not check.failures, check.failures
    hm.unwrap()


def test_an_expert_point_whose_token_count_equals_the_copies_is_not_taken_for_batch_first() -> None:
    """Regression: the batched gradient check gave point ``k`` of ``N`` its own copy of the input (row ``k``) and
    told a batch-first value by its leading dimension being ``N``; a per-expert point whose routed-token count
    happened to be ``N`` was edited at "its row", a token of another copy, and compared with that copy's finite
    differences (a spurious mismatch, or a spurious agreement). Here two drawn rows, one sending two tokens to the
    expert and the other none, make the expert hold ``N`` tokens over ``N`` copies (``N`` even): the check tells it
    by its layout (routed tokens), returns it as not batch-first, and on its own it passes; the other points are
    checked side by side."""
    from lensadapters.testing.gradients import gradient_check

    model = CONTRACT.gradient_model(CONTRACT.make_model(mixtral_config(layers=1, experts=8, top_k=2), 0))
    hm = CONTRACT.wrap(model)
    others = [n for n in hm.hook_names if ".mlp." not in n and "hook_attn_scores" not in n]
    indices = "blocks.0.mlp.hook_expert_indices"
    found = None
    for seed in range(50):  # two rows and an expert that the first row's tokens choose twice, the second's never
        ids = torch.randint(3, 64, (2, 4), generator=torch.Generator().manual_seed(seed))
        _, cache = hm.run_with_cache(ids, names_filter=indices)
        per_row = [(cache[indices][r] == e).sum().item() for r in range(2) for e in range(8)]
        chosen = [e for e in range(8) if (per_row[e], per_row[8 + e]) == (2, 0)]
        if chosen:
            found = ids, chosen[0]
            break
    assert found is not None, "no input of the search routes as the regression needs"
    ids, expert = found
    copies = 2 * (len(others) // 2 - 1) + 2  # even, at most 1 + len(others)
    point = f"blocks.0.mlp.experts.{expert}.hook_pre"
    names = [others[0], point, *others[1 : copies - 1]]  # copy 1: a row of the second input, none of its tokens
    kwargs, valid = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.ones_like(ids, dtype=torch.bool)
    rows = torch.arange(copies) % 2
    seen: dict[str, torch.Tensor] = {}
    hm.run_with_hooks(input_ids=ids[rows], fwd_hooks=[(point, lambda t, hook: seen.setdefault("v", t))])
    assert seen["v"].shape[0] == copies  # the coincidence: as many routed tokens as copies
    check, solo = gradient_check(hm, kwargs, valid, names, seed=3)
    assert point in solo and point not in check.names, (solo, check.names)
    assert set(others[: copies - 1]) <= set(check.names) and not check.failures, check.failures
    alone, _ = gradient_check(hm, kwargs, valid, [point], batched=False, seed=3)
    assert alone.names == [point] and not alone.failures, alone.failures
    hm.unwrap()
