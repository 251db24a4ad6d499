"""Qwen3 against TransformerLens 2.x on the same weights (TL's own conversion, no processing): every hook point
both have, the logits, and the effect of the same edit at every shared point, without sliding windows (TL 2.18's
Qwen3 has none; the Qwen3 checkpoints use none). Skipped without transformer_lens (it needs transformers 4.x: the
4.57 environment runs these)."""

from __future__ import annotations

from lensadapters_qwen3.testing import Qwen3Contract, qwen3_config

from lensadapters.testing.families import TransformerLensWithoutWindows
from lensadapters.testing.tl_compare import TransformerLensComparison


class TestQwen3TransformerLens(TransformerLensWithoutWindows, TransformerLensComparison):
    contract = Qwen3Contract()
    config = qwen3_config
