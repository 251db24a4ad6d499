"""The built-in plugin modules the tests use, each ``None`` where its distribution is not installed
(a test environment may hold only some plugins: the tests that need a missing one skip)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional


def optional(name: str) -> Optional[ModuleType]:
    try:
        return importlib.import_module(name)
    except ImportError:  # pragma: no cover
        return None


lensadapters_gpt2 = optional("lensadapters_gpt2")
lensadapters_gpt_neox = optional("lensadapters_gpt_neox")
lensadapters_opt = optional("lensadapters_opt")
lensadapters_llama = optional("lensadapters_llama")
lensadapters_peft = optional("lensadapters_peft")
