"""Gemma 3 (text) against TransformerLens 2.x on the same weights (TL's own weight conversion, no processing): every
hook point both have (q/k norms, which TL flattens to [b*p*h, ...] where lensadapters keeps [b, p, h, ...]; sandwich
norms; local and global RoPE bases), the logits, and the effect of the same edit at every shared point. TL has no
RoPE scaling for Gemma 3: a documented difference, checked below. Skipped without transformer_lens (it needs
transformers 4.x)."""

from __future__ import annotations

import torch
from lensadapters_gemma3.testing import Gemma3Contract, gemma3_config

from lensadapters.testing.tl_compare import TransformerLensComparison, compare_hooks, comparison_tokens


class TestGemma3TransformerLens(TransformerLensComparison):
    contract = Gemma3Contract()
    config = gemma3_config
    config_defaults = {
        "global_every": 2,
        "window": 3,
        "scalar": 16,
        "theta": 1000.0,
        "local_theta": 10.0,
        "final_cap": 2.0,
    }
    compared_points = ("blocks.0.attn.q_norm.hook_scale",)
    edit_every_block = True

    def test_transformerlens_does_not_scale_global_rope(self):
        """A documented difference: with linear RoPE scaling on global layers (Gemma-3-4B and larger: factor 8) TL's
        global-layer hook_rot_q differs from the HF model's; lensadapters' logits are the HF model's."""
        model, hm, tl = self.pair(global_scaling=8.0)
        ids = comparison_tokens()
        result = compare_hooks(hm, tl, ids, names=["blocks.0.attn.hook_rot_q", "blocks.1.attn.hook_rot_q"])
        assert result.compared["blocks.0.attn.hook_rot_q"] < self.atol  # local layer: unscaled in both
        assert result.compared["blocks.1.attn.hook_rot_q"] > 1e-3  # global layer: TL ignores the scaling
        with torch.no_grad():
            assert torch.equal(hm(ids).logits, model(ids).logits)
        hm.unwrap()
