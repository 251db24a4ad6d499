"""Attention scores and patterns through transformers' attention interface.

While a score or pattern hook exists on some layer, the wrapped model's config selects a
lensadapters attention function (registered under ``lensadapters:<original>``, with the original
implementation's mask function under the same key). That function computes attention explicitly
— and runs the hooks — only for the modules of hooked layers; every other layer is handed to the
original implementation (sdpa, eager, flash...) with the same arguments. When the last pattern
hook goes, the config gets its original implementation back. The explicit attention itself, and the masks it
reads, are :mod:`lensadapters.hooks.explicit_attention`'s (its public names are re-exported here, their old home).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.errors import LensAdaptersError, UnsupportedModelError
from lensadapters.hooks.copying import RoutedImplementation, detachable, original_value
from lensadapters.hooks.explicit_attention import IRRELEVANT_ARGUMENTS, default_scores, explicit_attention
from lensadapters.hooks.hook_point import HookPoint

__all__ = [
    "IRRELEVANT_ARGUMENTS",
    "KEY_PREFIX",
    "InterfacePatternBackend",
    "attention_key",
    "default_scores",
    "explicit_attention",
    "original_function",
]

Tensor = torch.Tensor
KEY_PREFIX = "lensadapters:"

# attention module -> weak reference to (backend, layer, site) for the layers whose patterns are hooked right now
# (weak: the backend holds the entry, so nothing here keeps a model alive)
_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[_Route]]" = weakref.WeakKeyDictionary()
_REGISTERED: set[str] = set()
# attention module -> weak reference to its backend while the backend routes the model (the function transformers
# would run for an unhooked layer when that is not the interface's: see the hookspec lensadapters_attn_original)
_ROUTED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[InterfacePatternBackend]]" = weakref.WeakKeyDictionary()


class _Route:
    """One hooked layer: the backend serving it and its site."""

    __slots__ = ("backend", "layer", "site", "__weakref__")

    def __init__(self, backend: "InterfacePatternBackend", layer: int, site: Any) -> None:
        self.backend, self.layer, self.site = backend, layer, site


def _route(module: nn.Module) -> Optional[_Route]:
    ref = _ACTIVE.get(module)
    return ref() if ref is not None else None


def _delegate(module: nn.Module) -> Optional[Callable[..., Any]]:
    ref = _ROUTED.get(module)
    backend = ref() if ref is not None else None
    return backend.delegates.get(module) if backend is not None else None


def _interfaces() -> tuple[Any, Any]:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface, AttentionMaskInterface


def original_function(original: str, module: nn.Module) -> Callable[..., Any]:
    """The attention function transformers would run for ``module`` under implementation ``original``: the
    module's own file's ``eager_attention_forward`` for ``"eager"`` (each model file defines its own), the
    interface's registered function otherwise."""
    if original == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise UnsupportedModelError(f"{type(module).__name__} has no eager_attention_forward to delegate to")
        return cast(Callable[..., Any], fn)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return cast(Callable[..., Any], ALL_ATTENTION_FUNCTIONS[original])


def _key_editor(module: nn.Module) -> Optional[Callable[[Tensor], Tensor]]:
    ref = _ROUTED.get(module)
    backend = ref() if ref is not None else None
    return backend.key_editors.get(module) if backend is not None else None


def attention_key(original: str) -> str:
    """Register (once per process) the lensadapters attention and mask functions for ``original``."""
    key = KEY_PREFIX + original
    if key in _REGISTERED:
        return key
    attn_interface, mask_interface = _interfaces()

    def lensadapters_attention(
        module: nn.Module,
        query: Tensor,
        key_: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        editor = _key_editor(module)
        if editor is not None:  # a site's edit of the keys this function gets (multi-head latent attention's)
            key_ = editor(key_)
        entry = _route(module)
        # a layer whose pattern points have no hook for this forward (another thread's, or an outer call's while
        # this is a nested one) keeps the original implementation's exact numbers
        if entry is None or not _site_is_live(entry.site):
            fn = _delegate(module) or original_function(original, module)
            return fn(module, query, key_, value, attention_mask, *args, **kwargs)
        return entry.backend.attend(entry.layer, entry.site, module, query, key_, value, attention_mask, **kwargs)

    attn_interface.register(key, lensadapters_attention)
    mask_fn = mask_interface._global_mapping.get(original)
    if mask_fn is not None:
        mask_interface.register(key, mask_fn)
    _REGISTERED.add(key)
    return key


def _site_is_live(site: Any) -> bool:
    """Whether a hooked layer's site has a hook that runs in the forward executing now: its own ``is_live()`` when
    it has one (a site serving more than scores and patterns through the attention function), else its score or
    pattern point's."""
    is_live = getattr(site, "is_live", None)
    if is_live is not None:
        return bool(is_live())
    return site.scores.has_live_hooks() or site.pattern.has_live_hooks()


class InterfacePatternBackend:
    """The core's pattern backend for models that call transformers' attention interface."""

    def __init__(
        self,
        config: Any,
        attention_modules: list[nn.Module],
        scores_fn: Callable[[nn.Module, Tensor, Tensor, Optional[float], str], Optional[Tensor]],
        original_fn: Optional[Callable[[nn.Module, str], Optional[Callable[..., Any]]]] = None,
    ) -> None:
        self.config = config
        self.modules = attention_modules
        self.scores_fn = scores_fn
        self.original_fn = original_fn
        self.active: set[int] = set()
        self.original: Optional[str] = None
        self.routes: dict[int, _Route] = {}  # the hooked layers (_ACTIVE refers to these weakly)
        self.delegates: dict[nn.Module, Callable[..., Any]] = {}
        # attention module -> the edit of the keys it hands the attention function (route_keys)
        self.key_editors: dict[nn.Module, Callable[[Tensor], Tensor]] = {}

    def _scores(self, module: nn.Module, query: Tensor, key: Tensor, scaling: Optional[float]) -> Tensor:
        scores = self.scores_fn(module, query, key, scaling, self.original or "sdpa")
        return scores if scores is not None else default_scores(module, query, key, scaling)

    def activate(self, layer: int, site: Any) -> RemovableHandle:
        if not self._engaged():
            self._engage()
        self.active.add(layer)
        module = self.modules[layer]
        route = self.routes[layer] = _Route(self, layer, site)
        _ACTIVE[module] = weakref.ref(route)
        guard = detachable(module.register_forward_pre_hook(self._still_selected(layer)))
        return _Deactivate(self, layer, guard)  # type: ignore[return-value]

    def route_keys(self, layer: int, editor: Callable[[Tensor], Tensor]) -> RemovableHandle:
        """Route layer ``layer`` through the lensadapters attention function with ``editor`` applied to the keys
        it gets (``[b, h, k, d]``; the patterns of the layer, when hooked, see the edited keys). ``remove()`` on
        the handle ends it."""
        if not self._engaged():
            self._engage()
        module = self.modules[layer]
        self.key_editors[module] = editor
        guard = detachable(module.register_forward_pre_hook(self._still_selected(layer)))
        return _KeysRouted(self, module, guard)  # type: ignore[return-value]

    def unroute_keys(self, module: nn.Module) -> None:
        if self.key_editors.pop(module, None) is not None:
            self._release_if_idle()

    def _engaged(self) -> bool:
        return bool(self.active or self.key_editors)

    def _engage(self) -> None:
        self.original = str(original_value(self.config._attn_implementation))
        if self.original.startswith(KEY_PREFIX):  # another wrapper of the same config is active
            self.original = self.original[len(KEY_PREFIX) :]
        # copies and pickles of the config see the user's implementation (lensadapters.copying)
        self.config._attn_implementation = RoutedImplementation(attention_key(self.original), self.original)
        self.delegates = {}
        present = [m for m in self.modules if m is not None]  # a hybrid's layers without attention have none
        for module in present if self.original_fn is not None else ():
            fn = self.original_fn(module, self.original)
            if fn is not None:
                self.delegates[module] = fn
        for module in present:
            _ROUTED[module] = weakref.ref(self)

    def _still_selected(self, layer: int) -> Callable[..., None]:
        def check(module: nn.Module, args: tuple) -> None:
            impl = self.config._attn_implementation
            if not (isinstance(impl, str) and impl.startswith(KEY_PREFIX)):
                raise LensAdaptersError(
                    f"layer {layer}: the model's attention implementation was set to {impl!r} while a "
                    f"hook_attn_scores/hook_pattern hook was attached (or a hook on the keys it gets), so transformers "
                    f"would no longer call the function that runs it. Remove those hooks before switching "
                    f"(set_attn_implementation), or switch first and add them after"
                )

        return check

    def deactivate(self, layer: int) -> None:
        if layer not in self.active:
            return
        self.active.discard(layer)
        self.routes.pop(layer, None)
        _ACTIVE.pop(self.modules[layer], None)
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if not self._engaged() and self.original is not None:
            if self.config._attn_implementation == KEY_PREFIX + self.original:  # not switched by the user meanwhile
                self.config._attn_implementation = self.original
            self.original = None
            self.delegates = {}
            for module in self.modules:
                if module is not None:
                    _ROUTED.pop(module, None)

    def attend(
        self,
        layer: int,
        site: Any,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        return self.explicit(module, (query, key, value, attention_mask), site.scores, site.pattern, **kwargs)

    def explicit(
        self, module: nn.Module, qkv_mask: tuple, scores: HookPoint, pattern: HookPoint, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """:func:`explicit_attention` of ``(query, key, value, attention_mask)`` with the backend's scores and the
        implementation the model was configured with (its softcap refusal reads it), through ``scores``/``pattern``."""
        return explicit_attention(
            module,
            *qkv_mask,
            scores_fn=self._scores,
            scores_point=scores,
            pattern_point=pattern,
            implementation=self.original or "sdpa",
            **kwargs,
        )


class _KeysRouted:
    """A handle (``.remove()``) that ends one layer's edit of its keys (:meth:`InterfacePatternBackend.route_keys`)."""

    def __init__(self, backend: InterfacePatternBackend, module: nn.Module, guard: RemovableHandle) -> None:
        self.backend, self.module, self.guard = backend, module, guard

    def remove(self) -> None:
        self.guard.remove()
        self.backend.unroute_keys(self.module)


class _Deactivate:
    """A handle (``.remove()``) that switches one layer back to the original attention."""

    def __init__(self, backend: InterfacePatternBackend, layer: int, guard: RemovableHandle) -> None:
        self.backend, self.layer, self.guard = backend, layer, guard

    def remove(self) -> None:
        self.guard.remove()
        self.backend.deactivate(self.layer)
