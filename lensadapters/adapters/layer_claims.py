"""Which layers a cross-cutting plugin supplies weights for: its ``LENSADAPTERS_LAYERS`` declaration.

``lensadapters_linear_weight`` and ``lensadapters_weight`` are first-answer-wins hooks called over every installed
cross-cutting plugin, before the core's own readers: a plugin answering for a plain ``nn.Linear`` would silently
replace the core's reading for every architecture. So a cross-cutting plugin declares, as a module attribute, the
layers it reads::

    LENSADAPTERS_LAYERS = ("bitsandbytes.",)                      # every class defined in a package (prefix + ".")
    LENSADAPTERS_LAYERS = ("mylib.layers.QuantLinear",)           # a class and its subclasses (qualified name)

An entry ending in ``"."`` matches every class whose module is in that package; any other entry names a class
(``module.QualName``), matched against the layer's whole class hierarchy. Names are compared, nothing is imported.
The core uses a cross-cutting plugin's answer for a layer only when the layer's class matches; otherwise it warns
(``UndeclaredLayerWarning``, naming the plugin and the layer) and uses the next answer (in the end the core's own).
``lensadapters_weight`` answers (whole tensors such as ``W_E``) are used when one of the layers the accessor reads
(the embedding for ``W_E``, the unembedding for ``W_U``, the blocks' layers otherwise) is declared. The architecture
plugin of the wrapped model needs no declaration: it describes that model.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from torch import nn

from lensadapters.errors import PluginValidationError

LAYERS_ATTRIBUTE = "LENSADAPTERS_LAYERS"


class UndeclaredLayerWarning(UserWarning):
    """A cross-cutting plugin answered for a layer it does not declare in ``LENSADAPTERS_LAYERS``; its answer is not
    used."""


def declared_layers(plugin: Any, name: str = "") -> tuple[str, ...]:
    """``plugin``'s ``LENSADAPTERS_LAYERS`` (checked: strings naming classes or packages), ``()`` when it has none."""
    value = getattr(plugin, LAYERS_ATTRIBUTE, ())
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(v, str) and v for v in value):
        raise PluginValidationError(
            f"plugin {name or plugin!r}: {LAYERS_ATTRIBUTE} must be a tuple of class names ('package.module.Class') "
            f"or package prefixes ending in '.' ('bitsandbytes.'), not {value!r:.80}"
        )
    return tuple(value)


def declares(plugin: Any, module: nn.Module) -> bool:
    """Whether ``plugin`` declares the class of ``module`` (or a base class) in ``LENSADAPTERS_LAYERS``."""
    entries = declared_layers(plugin)
    if not entries:
        return False
    for cls in type(module).__mro__:
        qualified = f"{cls.__module__}.{cls.__qualname__}"
        for entry in entries:
            if (entry.endswith(".") and (cls.__module__ + ".").startswith(entry)) or qualified == entry:
                return True
    return False


def permitted(hm: Any, impl: Any, modules: Iterable[nn.Module]) -> bool:
    """Whether the answer of hook implementation ``impl`` may be used for ``modules``: it is the core's, or the wrapped
    model's architecture plugin's, or its plugin declares one of ``modules``."""
    from lensadapters.adapters.plugin_calls import CORE_PLUGIN

    if impl.plugin_name in (CORE_PLUGIN, hm.plugin.name) or impl.plugin is getattr(hm.plugin, "plugin", None):
        return True  # (the generic adapter is registered under another name than its info's)
    return any(declares(impl.plugin, m) for m in modules)


def warn_undeclared(hm: Any, impl: Any, hook: str, what: str, layer: nn.Module) -> None:
    """Warn (once per plugin, hook and layer class in this wrap) that ``impl``'s answer for ``what`` is not used."""
    seen = hm.__dict__.setdefault("_undeclared_layer_warned", set())
    key = (impl.plugin_name, hook, type(layer))
    if key in seen:
        return
    seen.add(key)
    warnings.warn(
        f"plugin {impl.plugin_name!r} answered {hook} for {what} "
        f"({type(layer).__module__}.{type(layer).__qualname__}), "
        f"a layer it does not declare in {LAYERS_ATTRIBUTE}: its answer is not used (the core's reading is). A "
        f"plugin supplies weights only for the layer types it declares (see docs/writing-a-plugin.md)",
        UndeclaredLayerWarning,
        stacklevel=5,
    )
