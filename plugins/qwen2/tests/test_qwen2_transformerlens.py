"""Qwen2 against TransformerLens 2.x on the same weights (TL's own conversion, no processing): every hook point
both have, the logits, and the effect of the same edit at every shared point. Skipped without transformer_lens
(it needs transformers 4.x: the 4.57 environment runs these)."""

from __future__ import annotations

import pytest
import torch
from lensadapters_qwen2.testing import Qwen2Contract, qwen2_config

from lensadapters.testing import perturb
from lensadapters.testing.tl_compare import comparable_names, compare_edit, compare_hooks, transformer_lens_available

pytestmark = pytest.mark.skipif(not transformer_lens_available(), reason="transformer_lens is not installed")

CONTRACT = Qwen2Contract()
ATOL = 2e-4


def pair(**overrides):
    from lensadapters_qwen2.reference import to_hooked_transformer

    model = CONTRACT.make_model(qwen2_config(**{"layers": 2, "n_heads": 4, "n_kv": 2, **overrides}), 0, "eager")
    return CONTRACT.wrap(model), to_hooked_transformer(model)


def tokens(length: int = 9) -> torch.Tensor:
    return torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(0))


def test_hook_values_match_transformerlens():
    """Qwen2 without sliding windows (TL 2.18's Qwen2 has none; the Qwen2/2.5 checkpoints use none)."""
    hm, tl = pair()
    result = compare_hooks(hm, tl, tokens())
    assert not result.mismatches(ATOL), result.mismatches(ATOL)
    assert result.logits < ATOL
    assert not result.only_ours, result.only_ours
    hm.unwrap()


def test_edits_have_the_effect_they_have_in_transformerlens():
    hm, tl = pair()
    # every kind of point once: the last block's (its layers share one layout) and the model's own
    for name in [n for n in comparable_names(hm) if not n.startswith("blocks.0.")]:
        def edit(t, name=name):
            return perturb(t, type("H", (), {"name": name})())

        difference, effect = compare_edit(hm, tl, tokens(), name, edit)
        assert difference < ATOL * max(1.0, effect), f"{name}: edited logits differ from TL's by {difference:.3g}"
    hm.unwrap()


def test_transformerlens_has_no_sliding_window():
    """A documented difference: with ``use_sliding_window`` TL 2.18's Qwen2 attends globally where the HF model (and
    lensadapters) masks outside the window."""
    hm, tl = pair(window=3, window_from=0)
    result = compare_hooks(hm, tl, tokens(), names=["blocks.0.attn.hook_pattern"])
    assert result.compared["blocks.0.attn.hook_pattern"] > 0.1  # TL spreads attention outside the window
    hm.unwrap()
