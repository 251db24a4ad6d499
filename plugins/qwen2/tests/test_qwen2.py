"""Qwen2 / Qwen2.5: the contract suite over random tiny Qwen2 configs, plus Qwen2's own quirks (q/k/v biases only,
per-layer sliding windows, refusals)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from lensadapters_qwen2.testing import Qwen2Contract, qwen2_config

from lensadapters.testing import assert_close
from lensadapters.testing.families import RefusalChecks, left_padded_tokens
from lensadapters.testing.family_checks import assert_window_patterns, generate_with_hooks


class TestQwen2(Qwen2Contract, RefusalChecks):
    """The plugin's contract suite (``lensadapters_qwen2.testing``, also run by ``lensadapters check qwen2``)."""

    example_config = qwen2_config


CONTRACT = TestQwen2()
tokens = partial(left_padded_tokens, length=9, pads=(3, 0))


def test_biases_on_queries_keys_and_values_only():
    hm = CONTRACT.wrap(CONTRACT.make_model(qwen2_config(layers=2), 0))
    for name in ("b_Q", "_b_K", "_b_V"):
        assert getattr(hm, name).abs().sum() > 0, f"{name} is zero: the projection's bias was not read"
    for name in ("b_O", "b_in", "b_out", "b_gate"):
        assert torch.equal(getattr(hm, name), torch.zeros_like(getattr(hm, name))), name
    ids, mask = tokens()
    with torch.no_grad():
        _, cache = hm.run_with_cache(
            ids, attention_mask=mask, names_filter=["blocks.0.attn.hook_q", "blocks.0.ln1.hook_normalized"]
        )
    block = hm.block_modules[0]
    attn_in = cache["blocks.0.ln1.hook_normalized"] * block.input_layernorm.weight
    assert_close(cache["q", 0], torch.einsum("bpm,hmd->bphd", attn_in, hm.W_Q[0]) + hm.b_Q[0], "hook_q has b_Q")
    hm.unwrap()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_each_layer_shows_its_own_window(impl):
    """``max_window_layers=1``: layer 0 attends globally, layer 1 within a window of 3 (``config.layer_types``)."""
    model = CONTRACT.make_model(qwen2_config(layers=2, window=3, window_from=1), 0, impl)
    hm = CONTRACT.wrap(model)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert hm.cfg.attn_types == ("global", "local") and hm.cfg.window_size == 3
    for pads in ((0, 0), (3, 0)):
        assert_window_patterns(hm, *tokens(pads=pads), [None, 3])
    hm.unwrap()


@pytest.mark.parametrize("cache", [None, "static"])
def test_generation_with_mixed_layers(cache):
    model = CONTRACT.make_model(qwen2_config(layers=2, window=3, window_from=1), 1)
    hm = CONTRACT.wrap(model)
    generate_with_hooks(hm, *tokens(length=5, pads=(2, 0)), cache, steps=4)
    hm.unwrap()
