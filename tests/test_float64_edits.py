"""Edits that enter as the difference they make (a norm's scale and normalized value, a head's result) leave the
rest of a float64 model's value exact: an identity edit gives the unhooked logits bitwise, as in float32 (they were
added in float32, which rounded a float64 model's whole output there). The norms' edits themselves are computed in
float32, as Hugging Face's RMSNorm computes in a float64 model; a head's result in the model's dtype."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from lensadapters import HookedModel
from lensadapters.hf import size_fields
from lensadapters.testing import reinit

IDS = torch.tensor([[3, 7, 1, 9, 4, 2]])
CONFIGS = {
    "llama": lambda: LlamaConfig(
        **size_fields(hidden=16, d_mlp=24, layers=2, heads=4, kv_heads=2, vocab=32, positions=32)
    ),
    "gpt2": lambda: GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=32, n_positions=32),
}
#: the points whose edits enter as a difference: RMSNorm's scale and normalized value, LayerNorm's scale, a head's
#: result (LayerNorm's normalized value is its output itself: any dtype is exact there)
POINTS = ("blocks.1.ln1.hook_scale", "blocks.1.ln2.hook_normalized", "ln_final.hook_scale", "blocks.0.attn.hook_result")


def _model(name: str) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]())
    reinit(model, 0)
    return model.double().eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("point", POINTS)
def test_an_identity_edit_of_a_float64_model_is_bitwise(name: str, point: str) -> None:
    hm = HookedModel.wrap(_model(name))
    try:
        if point not in hm.hook_names:
            pytest.skip(f"{name} has no {point}")
        with torch.no_grad():
            clean = hm(IDS).logits
            with hm.hooks(fwd_hooks=[(point, lambda t, hook: t.clone())]):
                same = hm(IDS).logits
            with hm.hooks(fwd_hooks=[(point, lambda t, hook: t * (1 + 1e-9))]):
                nudged = hm(IDS).logits
        assert clean.dtype == torch.float64
        assert torch.equal(same, clean)
        if point.endswith("hook_result"):  # computed in the model's dtype: a change below float32's resolution stays
            assert not torch.equal(nudged, clean) and (nudged - clean).abs().max() < 1e-6
        else:  # a norm's edit is computed in float32, as Hugging Face's RMSNorm computes in a float64 model
            assert (nudged - clean).abs().max() < 1e-6
    finally:
        hm.unwrap()
