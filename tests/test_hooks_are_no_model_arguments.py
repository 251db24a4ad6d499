"""Hooks given as a forward's keyword are refused by name: a Hugging Face model hands unknown keywords down to its
layers, which ignore them, so ``hm(ids, fwd_hooks=...)`` and ``hm.run_with_cache(ids, fwd_hooks=...)`` ran without
the edit, silently (TransformerLens' forward raises a TypeError there)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lensadapters import HookedModel
from lensadapters.hf import size_fields

ZERO = [("blocks.0.hook_resid_post", lambda t, hook: t * 0)]


@pytest.fixture(scope="module")
def hm() -> HookedModel:
    torch.manual_seed(0)
    config = LlamaConfig(**size_fields(hidden=16, d_mlp=24, layers=2, heads=4, kv_heads=2, vocab=32, positions=32))
    return HookedModel.wrap(AutoModelForCausalLM.from_config(config).eval())


@pytest.mark.parametrize("argument", ["fwd_hooks", "bwd_hooks"])
@pytest.mark.parametrize("call", ["forward", "run_with_cache"])
def test_hooks_given_to_a_forward_are_refused_by_name(hm, argument: str, call: str) -> None:
    ids = torch.randint(0, 32, (1, 5))
    run = hm if call == "forward" else hm.run_with_cache
    with pytest.raises(TypeError, match=f"{argument} given to a forward pass.*hm.hooks"):
        run(ids, **{argument: ZERO})
    assert not hm.has_hooks, "a refused call left a hook behind"


def test_the_ways_that_take_hooks_make_the_edit(hm) -> None:
    ids = torch.randint(0, 32, (1, 5))
    with torch.no_grad():
        plain = hm(ids).logits
        with hm.hooks(fwd_hooks=ZERO):
            around = hm.run_with_cache(ids, names_filter="blocks.1.hook_resid_post")[0]
        given = hm.run_with_hooks(ids, fwd_hooks=ZERO)
    assert not torch.equal(around, plain)
    assert torch.equal(around, given)
