"""Gemma 3 (text) against TransformerLens 2.x on the same weights (TL's own weight conversion, no processing): every
hook point both have (q/k norms, sandwich norms, local and global RoPE bases), the logits, and the effect of the same
edit at every shared point. TL has no RoPE scaling for Gemma 3: a documented difference, checked below. Skipped
without transformer_lens (it needs transformers 4.x)."""

from __future__ import annotations

import pytest
import torch
from lensadapters_gemma3.testing import Gemma3Contract, gemma3_config

from lensadapters.testing import perturb
from lensadapters.testing.tl_compare import comparable_names, compare_edit, compare_hooks, transformer_lens_available

pytestmark = pytest.mark.skipif(not transformer_lens_available(), reason="transformer_lens is not installed")

CONTRACT = Gemma3Contract()
ATOL = 2e-4


def pair(**overrides):
    from lensadapters_gemma3.reference import to_hooked_transformer

    config = gemma3_config(**{"layers": 2, "global_every": 2, "n_heads": 4, "n_kv": 2, "window": 3, "scalar": 16,
                              "theta": 1000.0, "local_theta": 10.0, "final_cap": 2.0, **overrides})
    model = CONTRACT.make_model(config, 0, "eager")
    return model, CONTRACT.wrap(model), to_hooked_transformer(model)


def tokens(length: int = 9) -> torch.Tensor:
    return torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(0))


def test_hook_values_match_transformerlens():
    """TL flattens q_norm/k_norm points to [b*p*h, ...]; the same values in lensadapters' [b, p, h, ...]."""
    _, hm, tl = pair()
    result = compare_hooks(hm, tl, tokens())
    assert not result.mismatches(ATOL), result.mismatches(ATOL)
    assert result.logits < ATOL
    assert not result.only_ours, result.only_ours
    assert "blocks.0.attn.q_norm.hook_scale" in result.compared
    hm.unwrap()


def test_edits_have_the_effect_they_have_in_transformerlens():
    _, hm, tl = pair()
    for name in comparable_names(hm):
        def edit(t, name=name):
            return perturb(t, type("H", (), {"name": name})())

        difference, effect = compare_edit(hm, tl, tokens(), name, edit)
        assert difference < ATOL * max(1.0, effect), f"{name}: edited logits differ from TL's by {difference:.3g}"
    hm.unwrap()


def test_transformerlens_does_not_scale_global_rope():
    """A documented difference: with linear RoPE scaling on global layers (Gemma-3-4B and larger: factor 8) TL's
    global-layer hook_rot_q differs from the HF model's; lensadapters' logits are the HF model's."""
    model, hm, tl = pair(global_scaling=8.0)
    ids = tokens()
    result = compare_hooks(hm, tl, ids, names=["blocks.0.attn.hook_rot_q", "blocks.1.attn.hook_rot_q"])
    assert result.compared["blocks.0.attn.hook_rot_q"] < ATOL  # local layer: unscaled in both
    assert result.compared["blocks.1.attn.hook_rot_q"] > 1e-3  # global layer: TL ignores the scaling
    with torch.no_grad():
        assert torch.equal(hm(ids).logits, model(ids).logits)
    hm.unwrap()
