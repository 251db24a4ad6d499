"""Gemma 2 against TransformerLens 2.x on the same weights (TL's own weight conversion, no processing): every hook
point both have (post norms, softcapped scores, scaled embeddings), the logits (final softcap), and the effect of
the same edit at every shared point. Skipped without transformer_lens (it needs transformers 4.x)."""

from __future__ import annotations

import pytest
import torch
from lensadapters_gemma2.testing import Gemma2Contract, gemma2_config

from lensadapters.testing import perturb
from lensadapters.testing.tl_compare import comparable_names, compare_edit, compare_hooks, transformer_lens_available

pytestmark = pytest.mark.skipif(not transformer_lens_available(), reason="transformer_lens is not installed")

CONTRACT = Gemma2Contract()
ATOL = 2e-4


def pair(**overrides):
    from lensadapters_gemma2.reference import to_hooked_transformer

    config = gemma2_config(**{"layers": 2, "n_heads": 4, "n_kv": 2, "window": 3, "attn_cap": 3.0, "final_cap": 2.0,
                              "scalar": 16, **overrides})
    model = CONTRACT.make_model(config, 0, "eager")
    return CONTRACT.wrap(model), to_hooked_transformer(model)


def tokens(length: int = 9) -> torch.Tensor:
    return torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(0))


def test_hook_values_match_transformerlens():
    hm, tl = pair()
    result = compare_hooks(hm, tl, tokens())
    assert not result.mismatches(ATOL), result.mismatches(ATOL)
    assert result.logits < ATOL
    assert not result.only_ours, result.only_ours
    for name in ("W_E", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out", "W_U"):
        assert torch.allclose(getattr(hm, name), getattr(tl, name)), name
    hm.unwrap()


def test_edits_have_the_effect_they_have_in_transformerlens():
    hm, tl = pair()
    for name in comparable_names(hm):
        def edit(t, name=name):
            return perturb(t, type("H", (), {"name": name})())

        difference, effect = compare_edit(hm, tl, tokens(), name, edit)
        assert difference < ATOL * max(1.0, effect), f"{name}: edited logits differ from TL's by {difference:.3g}"
    hm.unwrap()
