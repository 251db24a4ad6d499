"""Mistral: the contract suite over random tiny Mistral configs, plus Mistral's own quirks (the sliding window in
both attention implementations, generation across the window with dynamic and static caches, refusals)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from lensadapters_mistral.testing import MistralContract, mistral_config

from lensadapters.testing.families import RefusalChecks, left_padded_tokens
from lensadapters.testing.family_checks import assert_window_patterns, generate_with_hooks


class TestMistral(MistralContract, RefusalChecks):
    """The plugin's contract suite (``lensadapters_mistral.testing``, also run by ``lensadapters check mistral``)."""

    example_config = mistral_config


CONTRACT = TestMistral()
tokens = partial(left_padded_tokens, length=9, pads=(3, 0))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("pads", [(0, 0), (3, 0)])
def test_patterns_show_the_window_the_model_applies(impl, pads):
    """A window of 3 on 9 tokens: under sdpa transformers materializes the mask (the window binds) and the pattern
    is the band; the logits with pattern hooks equal the model's own."""
    model = CONTRACT.make_model(mistral_config(layers=2, window=3), 0, impl)
    ids, mask = tokens(pads=pads)
    hm = CONTRACT.wrap(model)
    assert hm.cfg.window_size == 3 and hm.cfg.attn_types == ("local", "local")
    assert_window_patterns(hm, ids, mask, [3, 3])
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        hooked = hm.run_with_hooks(
            ids, attention_mask=mask, fwd_hooks=[(lambda n: n.endswith("pattern"), lambda t, hook: None)]
        )
    valid = mask.bool()
    assert torch.allclose(hooked[valid], reference[valid], atol=1e-5)
    hm.unwrap()


def test_window_longer_than_the_input_is_plain_causal():
    model = CONTRACT.make_model(mistral_config(window=16), 0, "sdpa")
    ids, mask = tokens(pads=(0, 0))
    hm = CONTRACT.wrap(model)
    assert_window_patterns(hm, ids, mask, [None])
    hm.unwrap()


@pytest.mark.parametrize("cache", [None, "static"])
def test_generation_across_the_window_with_hooks(cache):
    model = CONTRACT.make_model(mistral_config(layers=2, window=3), 1, "sdpa")
    ids, mask = tokens(length=5, pads=(2, 0))
    hm = CONTRACT.wrap(model)
    generate_with_hooks(hm, ids, mask, cache, steps=4)
    hm.unwrap()
