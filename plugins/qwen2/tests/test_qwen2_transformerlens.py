"""Qwen2 against TransformerLens 2.x on the same weights (TL's own conversion, no processing): every hook point
both have, the logits, and the effect of the same edit at every shared point, without sliding windows (TL 2.18's
Qwen2 has none; the Qwen2/2.5 checkpoints use none). Skipped without transformer_lens (it needs transformers 4.x:
the 4.57 environment runs these)."""

from __future__ import annotations

import pytest
from lensadapters_qwen2.testing import Qwen2Contract, qwen2_config

from lensadapters.testing.tl_compare import (
    TransformerLensComparison,
    compare_hooks,
    comparison_tokens,
    transformer_lens_available,
)

pytestmark = pytest.mark.skipif(not transformer_lens_available(), reason="transformer_lens is not installed")


class TestQwen2TransformerLens(TransformerLensComparison):
    contract = Qwen2Contract()
    config = qwen2_config
    reference = "lensadapters_qwen2.reference:to_hooked_transformer"
    config_defaults = {"layers": 2, "n_heads": 4, "n_kv": 2}

    def test_transformerlens_has_no_sliding_window(self):
        """A documented difference: with ``use_sliding_window`` TL 2.18's Qwen2 attends globally where the HF model
        (and lensadapters) masks outside the window."""
        _, hm, tl = self.pair(window=3, window_from=0)
        result = compare_hooks(hm, tl, comparison_tokens(), names=["blocks.0.attn.hook_pattern"])
        assert result.compared["blocks.0.attn.hook_pattern"] > 0.1  # TL spreads attention outside the window
        hm.unwrap()
