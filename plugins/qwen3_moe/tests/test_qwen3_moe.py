"""Qwen3-MoE: the contract suite in its mixture-of-experts form over random tiny Qwen3-MoE configs (2-5 experts,
top-1 to top-all routing with and without renormalization, dense layers among sparse ones, GQA/MQA, every experts
implementation of transformers 5), plus the plugin's own checks (dense layers, raw routing weights, sliding
windows, LoRA on the experts, refusals). TransformerLens 2.x has no Qwen3-MoE: there is nothing to compare with."""

from __future__ import annotations

import lensadapters_qwen3_moe
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lensadapters_qwen3_moe import sparse_layers
from lensadapters_qwen3_moe.testing import Qwen3MoeContract, qwen3_moe_config, qwen3_moe_configs

from lensadapters import HookedModel
from lensadapters.moe import MoELayout, router_weight
from lensadapters.registry import get_registry
from lensadapters.testing import assert_close
from lensadapters.testing.family_checks import (
    QK_NORMED_ATTENTION,
    assert_custom_code_refused,
    assert_patterns_refused_under,
    assert_unknown_rope_refused,
    assert_window_patterns_match_eager,
)
from lensadapters.testing.moe import mlp_input, moe_reference
from lensadapters.testing.plugins import assert_entry_point, needs_plugin
from lensadapters.weights import mlp_weights


class TestQwen3Moe(Qwen3MoeContract):
    """The plugin's contract suite (``lensadapters_qwen3_moe.testing``, also run by ``lensadapters check
    qwen3_moe``)."""


CONTRACT = TestQwen3Moe()
FEW = settings(deadline=None, max_examples=max(2, settings.default.max_examples // 4))


def test_entry_point() -> None:
    assert_entry_point("qwen3_moe", lensadapters_qwen3_moe)


@pytest.mark.parametrize(
    "layers, only, step, expected",
    [
        (3, [], 1, [True, True, True]),
        (3, [1], 1, [True, False, True]),
        (4, [], 2, [False, True, False, True]),
        (4, [3], 2, [False, True, False, False]),
    ],
)
def test_dense_layers_are_ordinary_mlps(layers: int, only: list, step: int, expected: list) -> None:
    """The layers ``mlp_only_layers``/``decoder_sparse_step`` make dense are described as SwiGLU MLPs of width
    ``intermediate_size`` (with the dense ``mlp.hook_pre``/``hook_pre_linear``/``hook_post``, the identities of a
    dense MLP and edits that change the output), the others as MoE blocks; whole-model ``W_in`` and ``W_router``
    refuse to stack the mixed shapes and name the per-layer reader."""
    config = qwen3_moe_config(layers=layers, mlp_only_layers=only, decoder_sparse_step=step, d_mlp=8, dense_d_mlp=24)
    assert sparse_layers(config) == expected
    model = CONTRACT.make_model(config, 0)
    hm = CONTRACT.wrap(model)
    assert [isinstance(layout, MoELayout) for layout in hm.mlp_layouts] == expected
    assert hm.cfg.extra["moe_layers"] == [i for i, s in enumerate(expected) if s]
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: ".mlp." in n or "mlp_out" in n or "ln2" in n)
        for i, sparse in enumerate(expected):
            pre = f"blocks.{i}.mlp."
            assert (pre + "hook_router_logits" in hm.hook_names) == sparse
            assert (pre + "hook_pre_linear" in hm.hook_names) == (not sparse)
            if sparse:
                assert mlp_weights(hm.wiring, i, "in")[0].shape == (4, 32, 8)
                assert router_weight(hm.wiring, i).shape == (32, 4)
                continue
            W_gate, W_in, W_out = (mlp_weights(hm.wiring, i, r)[0] for r in ("gate", "in", "out"))
            assert W_in.shape == (32, 24)
            x = mlp_input(hm, cache, i)
            assert_close(cache[pre + "hook_pre"], x @ W_gate, f"layer {i}: dense gate")
            assert_close(cache[pre + "hook_pre_linear"], x @ W_in, f"layer {i}: dense up")
            assert_close(cache["mlp_out", i], cache[pre + "hook_post"] @ W_out, f"layer {i}: dense out")
            edited = hm.run_with_hooks(ids, fwd_hooks=[(pre + "hook_post", lambda t, hook: t * 0)])
            assert not torch.allclose(edited, reference)
    if not all(expected):
        with pytest.raises(AttributeError, match="mlp_weights"):
            _ = hm.W_in
        with pytest.raises(AttributeError, match="router_weight"):
            _ = hm.W_router
    hm.unwrap()


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_routing_weights_follow_norm_topk_prob(norm_topk_prob: bool) -> None:
    """Without ``norm_topk_prob`` the experts are weighted by the raw top-k probabilities (summing to less than
    one); with it they are renormalized. Either way ``hook_mlp_out`` is the reference MoE with those weights, and an
    edit of the probabilities is re-selected and weighted by the same rule."""
    config = qwen3_moe_config(layers=1, experts=5, top_k=2, norm_topk_prob=norm_topk_prob)
    hm = CONTRACT.wrap(CONTRACT.make_model(config, 1))
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    pre = "blocks.0.mlp."
    names = lambda n: ".mlp." in n or "mlp_out" in n or "ln2" in n  # noqa: E731
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=names)
        weights, probs = cache[pre + "hook_routing_weights"], cache[pre + "hook_expert_weights"]
        top = probs.topk(2, dim=-1).values
        assert_close(weights, top / top.sum(-1, keepdim=True) if norm_topk_prob else top, "routing weights")
        assert (weights.sum(-1) < 1 - 1e-4).all() != norm_topk_prob
        new = torch.rand(probs.shape, generator=torch.Generator().manual_seed(2))
        with hm.hooks([(pre + "hook_expert_weights", lambda t, hook: new)]):
            _, edited = hm.run_with_cache(ids, names_filter=names)
        top, index = new.topk(2, dim=-1)
        assert torch.equal(edited[pre + "hook_expert_indices"], index)
        assert_close(
            edited[pre + "hook_routing_weights"],
            top / top.sum(-1, keepdim=True) if norm_topk_prob else top,
            "edited probabilities, weighted as the family does",
        )
        expected = moe_reference(hm, 0, mlp_input(hm, edited, 0), edited[pre + "hook_routing_weights"], index)
        assert_close(edited["mlp_out", 0], expected, "hook_mlp_out with the edited routing", atol=1e-5)
    hm.unwrap()


@FEW
@given(data=st.data())
def test_sliding_window_patterns_match_hf_eager(data: st.DataObject) -> None:
    """With a sliding window (every layer, as Qwen3-MoE applies it) patterns are HF eager's, nothing beyond the
    window is attended and the model stays bitwise."""
    config = data.draw(qwen3_moe_configs(window=st.integers(2, 4)), label="config")
    hm = assert_window_patterns_match_eager(CONTRACT, config, data.draw(st.integers(0, 99), label="seed"))
    assert hm.cfg.window_size == config.sliding_window
    hm.unwrap()


def test_query_norm_points_sit_between_projection_and_rotary() -> None:
    """The per-head q/k norms' points fire between the projection and the rotary points, in Qwen3's order."""
    hm = CONTRACT.wrap(CONTRACT.make_model(qwen3_moe_config(), 0))
    names = [n[len("blocks.0.") :] for n in hm.hook_names if n.startswith("blocks.0.attn.")]
    assert names[:11] == QK_NORMED_ATTENTION
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = hm.run_with_cache(ids, names_filter=lambda n: ".attn.hook_q" in n or ".q_norm." in n)
    q, scale = cache["q", 0], cache["blocks.0.attn.q_norm.hook_scale"]
    assert scale.shape == q.shape[:-1] + (1,)
    assert_close(scale, (q.pow(2).mean(-1, keepdim=True) + hm.cfg.eps).sqrt(), "q_norm scale per head")
    hm.unwrap()


def _lora_model(seed: int) -> torch.nn.Module:
    """LoRA on ``gate_proj``/``up_proj``/``down_proj``: transformers 4.57's per-expert and dense linear layers; under
    transformers 5 PEFT turns these targets into its parameter LoRA on the fused ``gate_up_proj``/``down_proj``."""
    peft = pytest.importorskip("peft")
    model = CONTRACT.make_model(qwen3_moe_config(layers=2, experts=4, top_k=2, mlp_only_layers=[0]), seed)
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"], init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("seed", [0, 1])
def test_lora_on_experts_and_dense_layers(seed: int) -> None:
    """LoRA on the experts (fused parameters or expert modules) and on the dense layer: reading every MLP point
    keeps the output bitwise, the sparse layer's ``hook_mlp_out`` is the reference MoE computed from the adapted
    expert weights, the dense layer's from its adapted projections, and the adapters change the expert weights."""
    needs_plugin("peft", "LoRA layers")
    peft_model = _lora_model(seed)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(seed))
    names = lambda n: ".mlp." in n or n.endswith(("ln2.hook_normalized", "hook_mlp_out"))  # noqa: E731
    with torch.no_grad():
        reference = peft_model(ids).logits
        hm = HookedModel.wrap(peft_model, registry=get_registry())
        logits, cache = hm.run_with_cache(ids, names_filter=names)
        assert torch.equal(logits, reference), "reading the adapted experts changed the output"
        pre = "blocks.1.mlp."
        expected = moe_reference(
            hm, 1, mlp_input(hm, cache, 1), cache[pre + "hook_routing_weights"], cache[pre + "hook_expert_indices"]
        )
        assert_close(cache["mlp_out", 1], expected, "adapted experts", atol=1e-4)
        W_out = mlp_weights(hm.wiring, 0, "out")[0]
        assert_close(cache["mlp_out", 0], cache["blocks.0.mlp.hook_post"] @ W_out, "adapted dense layer", atol=1e-5)
        adapted = mlp_weights(hm.wiring, 1, "gate")[0].clone()
        with peft_model.disable_adapter():
            assert not torch.allclose(mlp_weights(hm.wiring, 1, "gate")[0], adapted), "LoRA delta missing"
        edited = hm.run_with_hooks(ids, fwd_hooks=[(pre + "experts.1.hook_gate", lambda t, hook: t * 2)])
        assert not torch.allclose(edited, reference)
    hm.unwrap()


def test_refusals() -> None:
    config = qwen3_moe_config(layers=2, mlp_only_layers=[1])
    assert_custom_code_refused(CONTRACT, CONTRACT.make_model(config, 0))
    model = CONTRACT.make_model(config, 0)
    assert_unknown_rope_refused(CONTRACT, model, model.model.rotary_emb)
    assert_patterns_refused_under(CONTRACT, CONTRACT.make_model(config, 0), "flash_attention_2")
