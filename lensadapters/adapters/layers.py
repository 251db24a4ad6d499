"""Wrapper layers: a plugin's layer around another plugin's (an adapter layer around a quantized base layer).

A plugin that owns wrapper layers says what each wraps (``lensadapters_wrapped_layer``); another plugin
that looks for its own layer type under any wrapper peels them with :func:`wrapped_layers`, without
knowing the wrapping plugin.
"""

from __future__ import annotations

from typing import Iterator, Optional

from torch import nn

from lensadapters.adapters.registry import Registry, get_registry

__all__ = ["wrapped_layers", "innermost_layer"]


def wrapped_layers(module: nn.Module, registry: Optional[Registry] = None) -> Iterator[nn.Module]:
    """``module``, then the layer it wraps, then the layer that one wraps... as the plugins of ``registry``
    (default: the process-wide one) peel them; ends at a layer no plugin peels (or at a cycle)."""
    peel = (registry or get_registry()).pm.hook.lensadapters_wrapped_layer
    seen: set[int] = set()
    layer: Optional[nn.Module] = module
    while layer is not None and id(layer) not in seen:
        yield layer
        seen.add(id(layer))
        layer = peel(module=layer)


def innermost_layer(module: nn.Module, registry: Optional[Registry] = None) -> nn.Module:
    """The layer at the bottom of ``module``'s wrappers (``module`` itself when it wraps nothing)."""
    *_, last = wrapped_layers(module, registry)
    return last
