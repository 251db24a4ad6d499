"""Contract variants: the contract suite run on models a cross-cutting plugin transforms (LoRA-adapted,
quantized...), declared by that plugin through ``lensadapters_contract_variants``.

The core names no such plugin: ``lensadapters check PLUGIN --NAME`` and the test matrices find the
variants installed plugins declare.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Optional

from lensadapters.adapters.registry import PluginLoadWarning, Registry, get_registry

__all__ = ["ContractVariant", "contract_variants"]


@dataclass(frozen=True)
class ContractVariant:
    """One variant of the contract suite, as a cross-cutting plugin declares it.

    * ``name``: a short identifier, also the command-line flag (``"lora"``: ``lensadapters check PLUGIN --lora``).
    * ``contract``: ``"package.module:ClassName"`` of the variant's mixin, an ``AdapterContract`` subclass that is
      put in front of an architecture's contract (``class T(Mixin, MyArchContract)``).
    * ``runs_on``: what the variant's models are, for messages (``"LoRA-adapted (PEFT) models"``).
    * ``distribution``: the distribution that ships the mixin (``pip install`` hints); ``None``: the declaring
      plugin's own distribution.
    """

    name: str
    contract: str
    runs_on: str
    distribution: Optional[str] = None


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
