"""A bfloat16 model described automatically gets the points its float32 copy gets: every claim the probe checks
allows the rounding of the dtype the model computes in, not the one a value was widened to afterwards (a norm's
output read in float32 to measure its eps, logits upcast to float32 after a bfloat16 network)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lensadapters import HookedModel
from lensadapters.testing.census import CANONICAL
from lensadapters.testing.every_model_type import build, input_ids


def _served(model: torch.nn.Module) -> tuple[set[str], HookedModel]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookedModel.wrap(model)
    return {p for p in CANONICAL if p in hm.hook_dict}, hm


# OLMo: a LayerNorm without weights or an eps attribute (the eps is measured on the module); Mamba and Falcon-Mamba:
# an RMSNorm before the mixer whose edit reaches logits transformers upcasts to float32; StableLM: a plain decoder
@pytest.mark.parametrize("model_type", ["olmo", "mamba", "falcon_mamba", "stablelm"])
def test_a_bfloat16_model_gets_the_points_its_float32_copy_gets(model_type: str) -> None:
    model = build(model_type)
    full, hm = _served(model)
    hm.unwrap()
    low, hm = _served(model.to(torch.bfloat16))
    assert low == full, sorted(full - low)
    # reading them changes nothing (but the scores and patterns: hooking them computes the layer's attention
    # explicitly, which rounds unlike sdpa in bfloat16)
    read = {p for p in low if not p.endswith(("hook_attn_scores", "hook_pattern"))}
    with torch.no_grad():
        plain = model(input_ids()).logits
        logits, cache = hm.run_with_cache(input_ids(), names_filter=lambda name: name in read)
    assert torch.equal(logits, plain) and set(cache.keys()) == read
    hm.unwrap()
