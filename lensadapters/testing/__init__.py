"""Test kit for adapter plugins (``pip install lensadapters[testing]``): the contract suite, Hypothesis strategies
and profiles, seeded tiny models, independent references, and the installed plugins found without naming them.

Names are imported on first use, so ``from lensadapters.testing.profiles import load_profile`` in a
``conftest.py`` loads a Hypothesis profile before the contract suite is defined (Hypothesis fixes a test's
settings at definition time), and the core's demo can use :func:`reinit` without Hypothesis installed.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AdapterContract": "contract",
    "Capabilities": "contract",
    "assert_close": "contract",
    "attention_layers": "contract_support",
    "assert_refuses_causal_operations": "contract_support",
    "assert_wraps_transparently": "contract_support",
    "is_causal": "contract_support",
    "perturb": "contract",
    "perturbed_logits": "contract",
    "property_settings": "contract",
    "Inputs": "strategies",
    "as_strategy": "strategies",
    "token_inputs": "strategies",
    "reinit": "models",
    "seeded_model": "models",
    "BlockInputs": "reference",
    "apply_norm": "reference",
    "block_inputs": "reference",
    "norm_out": "reference",
    "reference_rope": "reference",
    "rope_inv_freq": "reference",
    "load_profile": "profiles",
    "register_profiles": "profiles",
    "served_weights": "contract_support",
    "installed_plugins": "plugins",
    "architecture_plugins": "plugins",
    "architecture_plugin": "plugins",
    "model_openers": "plugins",
    "registry_with": "plugins",
    "registry_for": "plugins",
    "declared_contracts": "plugins",
    "matrix_class": "plugins",
    "contract_matrix": "plugins",
    "variant_matrix": "plugins",
    "PluginProject": "plugins",
    "plugin_projects": "plugins",
    "run_at_a_barrier": "threads",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
