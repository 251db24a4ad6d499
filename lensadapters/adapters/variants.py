"""Contract variants: the contract suite run on models a cross-cutting plugin transforms (LoRA-adapted,
quantized...), declared by that plugin through ``lensadapters_contract_variants``.

The core names no such plugin: ``lensadapters check PLUGIN --NAME`` and the test matrices find the
variants installed plugins declare.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Optional

from lensadapters.adapters.hookspecs import ContractVariant
from lensadapters.adapters.registry import PluginLoadWarning, Registry, get_registry

__all__ = ["ContractVariant", "contract_variants"]


def contract_variants(registry: Optional[Registry] = None) -> dict[str, ContractVariant]:
    """``{name: variant}`` for the variants the plugins of ``registry`` (default: the process-wide one) declare,
    in registration order. A name declared twice keeps the first declaration and warns."""
    registry = registry or get_registry()
    found: dict[str, ContractVariant] = {}
    owners: dict[str, str] = {}
    for impl in registry.pm.hook.lensadapters_contract_variants.get_hookimpls():  # in registration order
        plugin_name = registry.pm.get_name(impl.plugin) or repr(impl.plugin)
        info = registry.infos.get(plugin_name)
        for variant in impl.function() or ():
            if variant.distribution is None and info is not None and info.distribution:
                variant = replace(variant, distribution=info.distribution)
            if variant.name in found:
                warnings.warn(
                    f"contract variant {variant.name!r} is declared by both {owners[variant.name]} and "
                    f"{plugin_name}; keeping {owners[variant.name]}'s",
                    PluginLoadWarning,
                    stacklevel=2,
                )
                continue
            found[variant.name], owners[variant.name] = variant, plugin_name
    return found
