"""Phi-3 / Phi-3.5 / Phi-4-mini: the contract suite over random tiny Phi-3 configs, plus Phi-3's own quirks (fused
``qkv_proj`` and ``gate_up_proj`` through weights and LoRA, partial rotary, LongRoPE, refusals)."""

from __future__ import annotations

import pytest
import torch
from lensadapters_phi3.testing import Phi3Contract, phi3_config

from lensadapters.testing.families import GenerationChecks, RefusalChecks
from lensadapters.testing.families import left_padded_tokens as tokens
from lensadapters.testing.family_checks import assert_window_patterns


class TestPhi3(Phi3Contract, RefusalChecks, GenerationChecks):
    """The plugin's contract suite (``lensadapters_phi3.testing``, also run by ``lensadapters check phi3``)."""

    example_config = phi3_config
    generation_config = dict(layers=2, window=3, partial=0.5)


CONTRACT = TestPhi3()


def test_fused_weights_are_the_rows_of_the_fused_projections():
    """GQA 3:1 (unequal q and kv widths): W_Q, _W_K, _W_V are the [q | k | v] rows of qkv_proj, W_gate and W_in the
    [gate | up] rows of gate_up_proj, independently sliced here."""
    model = CONTRACT.make_model(phi3_config(n_heads=6, n_kv=2, hidden=48, d_mlp=20), 0)
    hm = CONTRACT.wrap(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    d = 8
    rows = attn.qkv_proj.weight  # [(6 + 2 + 2) * 8, 48]
    assert torch.equal(hm.W_Q[0], rows[: 6 * d].reshape(6, d, 48).transpose(1, 2))
    assert torch.equal(hm._W_K[0], rows[6 * d : 8 * d].reshape(2, d, 48).transpose(1, 2))
    assert torch.equal(hm._W_V[0], rows[8 * d :].reshape(2, d, 48).transpose(1, 2))
    assert torch.equal(hm.W_gate[0], mlp.gate_up_proj.weight[:20].T)
    assert torch.equal(hm.W_in[0], mlp.gate_up_proj.weight[20:].T)
    hm.unwrap()


def test_partial_rotary_leaves_the_tail_of_each_head_alone():
    model = CONTRACT.make_model(phi3_config(n_heads=4, n_kv=2, hidden=64, partial=0.75, rope="longrope"), 0)
    hm = CONTRACT.wrap(model)
    assert hm.cfg.rotary_dim == 12 and hm.cfg.d_head == 16
    with torch.no_grad():
        _, cache = hm.run_with_cache(
            *tokens(pads=(0, 0)), names_filter=lambda n: "hook_rot" in n or "attn.hook_q" in n or "attn.hook_k" in n
        )
    assert torch.equal(cache["rot_q", 0][..., 12:], cache["q", 0][..., 12:])
    assert torch.equal(cache["rot_k", 0][..., 12:], cache["k", 0][..., 12:])
    assert not torch.allclose(cache["rot_q", 0][:, 1:, :, :12], cache["q", 0][:, 1:, :, :12])
    hm.unwrap()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_window(impl):
    hm = CONTRACT.wrap(CONTRACT.make_model(phi3_config(layers=2, window=3), 0, impl))
    assert hm.cfg.attn_types == ("local", "local")
    assert_window_patterns(hm, *tokens(length=9), [3, 3])
    hm.unwrap()
