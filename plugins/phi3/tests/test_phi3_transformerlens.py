"""Phi-3 against TransformerLens 2.x on the same weights (TL's own conversion, no processing): every hook point
both have, the logits, and the effect of the same edit at every shared point, on full-rotary Phi-3 without a
window. TL 2.18's Phi-3 ignores partial rotary (Phi-4-mini), LongRoPE and the sliding window: documented
differences, checked below. Skipped without transformer_lens (it needs transformers 4.x)."""

from __future__ import annotations

import pytest
import torch
from lensadapters_phi3.testing import Phi3Contract, phi3_config

from lensadapters.testing import perturb
from lensadapters.testing.tl_compare import comparable_names, compare_edit, compare_hooks, transformer_lens_available

pytestmark = pytest.mark.skipif(not transformer_lens_available(), reason="transformer_lens is not installed")

CONTRACT = Phi3Contract()
ATOL = 2e-4


def pair(**overrides):
    from lensadapters_phi3.reference import to_hooked_transformer

    config = phi3_config(**{"layers": 2, "n_heads": 4, "n_kv": 2, "hidden": 32, **overrides})
    model = CONTRACT.make_model(config, 0, "eager")
    return model, CONTRACT.wrap(model), to_hooked_transformer(model)


def tokens(length: int = 9) -> torch.Tensor:
    return torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(0))


def test_hook_values_match_transformerlens():
    """Fused qkv_proj and gate_up_proj split as TL splits them: hook_q/k/v, mlp.hook_pre (gate) and
    mlp.hook_pre_linear (up) equal TL's."""
    _, hm, tl = pair()
    result = compare_hooks(hm, tl, tokens())
    assert not result.mismatches(ATOL), result.mismatches(ATOL)
    assert result.logits < ATOL
    assert not result.only_ours, result.only_ours
    for name in ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out", "W_E", "W_U"):
        assert torch.allclose(getattr(hm, name), getattr(tl, name)), name
    hm.unwrap()


def test_edits_have_the_effect_they_have_in_transformerlens():
    _, hm, tl = pair()
    # every kind of point once: the last block's (its layers share one layout) and the model's own
    for name in [n for n in comparable_names(hm) if not n.startswith("blocks.0.")]:
        def edit(t, name=name):
            return perturb(t, type("H", (), {"name": name})())

        difference, effect = compare_edit(hm, tl, tokens(), name, edit)
        assert difference < ATOL * max(1.0, effect), f"{name}: edited logits differ from TL's by {difference:.3g}"
    hm.unwrap()


def test_transformerlens_rotates_the_whole_head_where_phi4_mini_rotates_part():
    """A documented difference: TL 2.18 sets rotary_dim = d_head for every Phi-3 (ignoring ``partial_rotary_factor``),
    so its logits differ from the HF model's; lensadapters' are the HF model's, and its hook_rot_q passes the last
    quarter of each head through unrotated."""
    model, hm, tl = pair(partial=0.75)
    ids = tokens()
    with torch.no_grad():
        reference = model(ids).logits
        logits, cache = hm.run_with_cache(ids, names_filter=["blocks.0.attn.hook_q", "blocks.0.attn.hook_rot_q"])
        tl_logits = tl(ids)
    assert torch.equal(logits, reference)
    assert (tl_logits - reference).abs().max() > 1e-3
    assert torch.equal(cache["rot_q", 0][..., 6:], cache["q", 0][..., 6:])
    hm.unwrap()
