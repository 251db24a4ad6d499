"""Gemma 2 against TransformerLens 2.x on the same weights (TL's own weight conversion, no processing): every hook
point both have (post norms, softcapped scores, scaled embeddings), the logits (final softcap), and the effect of
the same edit at every shared point. Skipped without transformer_lens (it needs transformers 4.x)."""

from __future__ import annotations

from lensadapters_gemma2.testing import Gemma2Contract, gemma2_config

from lensadapters.testing.tl_compare import TransformerLensComparison


class TestGemma2TransformerLens(TransformerLensComparison):
    contract = Gemma2Contract()
    config = gemma2_config
    config_defaults = {"window": 3, "attn_cap": 3.0, "final_cap": 2.0, "scalar": 16}
    weights = ("W_E", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out", "W_U")
    edit_every_block = True
