"""OLMoE: the contract suite in its mixture-of-experts form over random tiny OLMoE configs (2-5 experts, top-1 to
top-all routing with and without renormalization, GQA/MQA, every experts implementation of transformers 5,
transformers 4.57's own attention classes), plus the plugin's own checks (full-width q/k norms, raw routing weights,
the 4.57 pattern backend, LoRA on the experts, refusals). TransformerLens 2.x has no OLMoE: there is nothing to
compare with."""

from __future__ import annotations

import copy

import lensadapters_olmoe
import pytest
import torch
from lensadapters_olmoe.testing import OlmoeContract, olmoe_config

from lensadapters import UnsupportedModelError
from lensadapters.registry import get_registry
from lensadapters.rotary import apply_rotate_half
from lensadapters.testing import assert_close
from lensadapters.testing.family_checks import (
    assert_custom_code_refused,
    assert_patterns_refused_under,
    assert_unknown_rope_refused,
)
from lensadapters.testing.moe_reference import mlp_input, moe_reference, wrap_adapted_experts
from lensadapters.testing.plugins import assert_entry_point, needs_plugin
from lensadapters.weights import mlp_weights


class TestOlmoe(OlmoeContract):
    """The plugin's contract suite (``lensadapters_olmoe.testing``, also run by ``lensadapters check olmoe``)."""


CONTRACT = TestOlmoe()


def test_entry_point() -> None:
    assert_entry_point("olmoe", lensadapters_olmoe)


def test_query_norm_over_the_projection_width() -> None:
    """``q_norm`` normalizes the whole projection (one scale per position, ``[b, p, 1]``), between ``hook_q`` and
    ``hook_rot_q``; ``hook_rot_q`` is RoPE of the weighted normed queries, per head."""
    hm = CONTRACT.wrap(CONTRACT.make_model(olmoe_config(n_heads=4, n_kv=2, hidden=32), 0))
    names = [n[len("blocks.0.") :] for n in hm.hook_names if n.startswith("blocks.0.attn.")]
    assert names[:4] == ["attn.hook_q", "attn.q_norm.hook_scale", "attn.q_norm.hook_normalized", "attn.hook_rot_q"]
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids)
        cos, sin = hm.hf_model.model.rotary_emb(cache["blocks.0.hook_resid_pre"], torch.arange(5)[None])
    q = cache["q", 0].flatten(-2)
    scale = cache["blocks.0.attn.q_norm.hook_scale"]
    assert scale.shape == (1, 5, 1)
    assert_close(scale, (q.pow(2).mean(-1, keepdim=True) + hm.cfg.eps).sqrt(), "q_norm scale over the width")
    normed = cache["blocks.0.attn.q_norm.hook_normalized"] * hm.block_modules[0].self_attn.q_norm.weight
    assert_close(cache["rot_q", 0], apply_rotate_half(normed.unflatten(-1, (4, 8)), cos, sin), "hook_rot_q")
    hm.unwrap()


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_routing_weights_follow_norm_topk_prob(norm_topk_prob: bool) -> None:
    """OLMoE-1B-7B weights the experts by the raw top-k probabilities; with ``norm_topk_prob`` they are
    renormalized. ``hook_mlp_out`` is the reference MoE with those weights either way."""
    hm = CONTRACT.wrap(CONTRACT.make_model(olmoe_config(experts=5, top_k=2, norm_topk_prob=norm_topk_prob), 1))
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    pre = "blocks.0.mlp."
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: ".mlp." in n or "mlp_out" in n or "ln2" in n)
    top = cache[pre + "hook_expert_weights"].topk(2, dim=-1).values
    weights = cache[pre + "hook_routing_weights"]
    assert_close(weights, top / top.sum(-1, keepdim=True) if norm_topk_prob else top, "routing weights")
    assert (weights.sum(-1) < 1 - 1e-4).all() != norm_topk_prob
    expected = moe_reference(hm, 0, mlp_input(hm, cache, 0), weights, cache[pre + "hook_expert_indices"])
    assert_close(cache["mlp_out", 0], expected, "hook_mlp_out == reference MoE", atol=1e-5)
    hm.unwrap()


def test_pattern_hooks_in_one_layer_keep_the_other_bitwise() -> None:
    """A pattern hook on one layer runs explicit attention there only (transformers 4.57: that instance's forward;
    5: the interface), leaves no instance attribute behind, and a copy of a hooked model computes the model's own
    attention."""
    model = CONTRACT.make_model(olmoe_config(layers=2), 0, "sdpa")
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    hm = CONTRACT.wrap(model)
    with torch.no_grad():
        reference = model(ids).logits
        with hm.hooks([("blocks.1.attn.hook_pattern", lambda t, hook: None)]):
            copied = copy.deepcopy(model)
            assert torch.equal(copied(ids).logits, reference)
            _, cache = hm.run_with_cache(ids, names_filter=["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"])
        assert "forward" not in vars(model.model.layers[1].self_attn)
        alone = hm.run_with_cache(ids, names_filter=["blocks.0.hook_resid_post"])[1]
    assert torch.equal(cache["resid_post", 0], alone["resid_post", 0])
    hm.unwrap()


@pytest.mark.parametrize("seed", [0, 1])
def test_lora_on_experts(seed: int) -> None:
    """LoRA on the experts (transformers 4.57: each expert's linear layers; 5: PEFT's parameter LoRA on the fused
    ``gate_up_proj``/``down_proj``): reading every MLP point keeps the output bitwise, ``hook_mlp_out`` is the
    reference MoE computed from the adapted expert weights, and disabling the adapters changes the weights."""
    needs_plugin("peft", "LoRA layers")
    peft = pytest.importorskip("peft")
    model = CONTRACT.make_model(olmoe_config(layers=2, experts=4, top_k=2), seed)
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"], init_lora_weights=False
    )
    peft_model = peft.get_peft_model(model, config)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(seed))
    hm, reference = wrap_adapted_experts(peft_model, ids, get_registry())
    with torch.no_grad():
        adapted = mlp_weights(hm.wiring, 0, "out")[0].clone()
        with peft_model.disable_adapter():
            assert not torch.allclose(mlp_weights(hm.wiring, 0, "out")[0], adapted), "LoRA delta missing"
    hm.unwrap()


def test_refusals() -> None:
    config = olmoe_config(layers=1)
    assert_custom_code_refused(CONTRACT, CONTRACT.make_model(config, 0))
    model = CONTRACT.make_model(config, 0)
    assert_unknown_rope_refused(CONTRACT, model, model.model.rotary_emb)
    assert_patterns_refused_under(CONTRACT, CONTRACT.make_model(config, 0), "flash_attention_2")
    with pytest.raises(UnsupportedModelError, match="clip_qkv=8.0.*clip_qkv=None"):
        CONTRACT.wrap(CONTRACT.make_model(olmoe_config(clip_qkv=8.0), 0))
