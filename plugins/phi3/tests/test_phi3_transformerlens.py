"""Phi-3 against TransformerLens 2.x on the same weights (TL's own conversion, no processing): every hook point
both have (fused qkv_proj and gate_up_proj split as TL splits them), the logits, and the effect of the same edit at
every shared point, on full-rotary Phi-3 without a window. TL 2.18's Phi-3 ignores partial rotary (Phi-4-mini),
LongRoPE and the sliding window: documented differences, checked below. Skipped without transformer_lens (it needs
transformers 4.x)."""

from __future__ import annotations

import torch
from lensadapters_phi3.testing import Phi3Contract, phi3_config

from lensadapters.testing.tl_compare import TransformerLensComparison, comparison_tokens


class TestPhi3TransformerLens(TransformerLensComparison):
    contract = Phi3Contract()
    config = phi3_config
    config_defaults = {"hidden": 32}
    weights = ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out", "W_E", "W_U")

    def test_transformerlens_rotates_the_whole_head_where_phi4_mini_rotates_part(self):
        """A documented difference: TL 2.18 sets rotary_dim = d_head for every Phi-3 (ignoring
        ``partial_rotary_factor``), so its logits differ from the HF model's; lensadapters' are the HF model's, and
        its hook_rot_q passes the last quarter of each head through unrotated."""
        model, hm, tl = self.pair(partial=0.75)
        ids = comparison_tokens()
        with torch.no_grad():
            reference = model(ids).logits
            logits, cache = hm.run_with_cache(ids, names_filter=["blocks.0.attn.hook_q", "blocks.0.attn.hook_rot_q"])
            tl_logits = tl(ids)
        assert torch.equal(logits, reference)
        assert (tl_logits - reference).abs().max() > 1e-3
        assert torch.equal(cache["rot_q", 0][..., 6:], cache["q", 0][..., 6:])
        hm.unwrap()
