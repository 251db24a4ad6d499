"""Mistral against TransformerLens 2.x on the same weights (TL's own conversion, no processing): every hook point
both have, the logits, and the effect of the same edit at every shared point. Skipped without transformer_lens
(it needs transformers 4.x: the 4.57 environment runs these)."""

from __future__ import annotations

from lensadapters_mistral.testing import MistralContract, mistral_config

from lensadapters.testing.tl_compare import TransformerLensComparison


class TestMistralTransformerLens(TransformerLensComparison):
    contract = MistralContract()
    config = mistral_config
    cases = ({"window": 3}, {"window": None})
    inert_points = ("hook_scale", "hook_attn_scores")
