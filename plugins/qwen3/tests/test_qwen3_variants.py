"""The Qwen3 contract on LoRA-adapted (lensadapters-peft) and 8-bit (lensadapters-bnb) models, each defined only when
its extra is installed. Sizes are narrowed (every example builds two models, or saves and reloads one); the
config strata run in the float suite, and each property runs on a quarter of the profile's examples (at least 3:
the float suite explores the configs with the full count)."""

from __future__ import annotations

import importlib.util

from hypothesis import settings
from hypothesis import strategies as st

from lensadapters.testing.family_checks import with_examples

from lensadapters_qwen3.testing import Qwen3Contract


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in names)


VARIANT_EXAMPLES = max(3, settings.default.max_examples // 4)
VARIANT_CONFIGS = dict(n_kv=1, ratio=2, head_dim=8, hidden_per_head=8, n_layers=1, d_mlp=24, vocab=64, window=None)

if _installed("peft", "lensadapters_peft"):
    from lensadapters_peft.testing import LoraContract

    @with_examples(VARIANT_EXAMPLES)
    class TestQwen3Lora(LoraContract, Qwen3Contract):
        """Every property, plus LoRA's own, on PeftModels with LoRA on seed-chosen Qwen3 projections."""

        config_overrides = VARIANT_CONFIGS
        config_strata = {}

if _installed("bitsandbytes", "lensadapters_bnb"):
    from lensadapters_bnb.testing import Int8Contract

    @with_examples(VARIANT_EXAMPLES)
    class TestQwen3Int8(Int8Contract, Qwen3Contract):
        """Every property on Qwen3 loaded in 8-bit (LLM.int8) on the CPU."""

        config_overrides = VARIANT_CONFIGS
        config_strata = {}
