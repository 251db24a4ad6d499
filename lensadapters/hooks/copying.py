"""Copies and saves of a hooked model hold the user's model, not lensadapters.

While hooks are attached, the model carries lensadapters' PyTorch hooks (entries in its modules' hook dicts) and,
for as long as they are installed, two settings: the attention implementation that routes hooked layers through
explicit attention, and ``generation_config.disable_compile`` (see ``Wiring._guard_compile``). ``copy.deepcopy``,
``pickle`` and ``torch.save(model)`` copy all of that, and ``save_pretrained`` writes the settings out. So:

* every PyTorch hook lensadapters registers is a :class:`ModelHook`, which a deep copy or a pickle turns into
  :func:`inert_hook` (a hook that does nothing): a copy of a hooked model runs exactly the unwrapped model's
  forward and is not wrapped (wrap it to hook it);
* every setting lensadapters changes holds a :class:`Setting` value (or :class:`RoutedImplementation`, a string)
  that compares equal to the user's own value where transformers decides what to save, and that copies and
  pickles as the user's own value.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

from torch import nn


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a lensadapters hook becomes in a copy of the model: nothing."""
    return None


def _inert() -> Callable[..., None]:
    return inert_hook


class ModelHook(functools.partial):
    """A hook function registered on the model; copies and pickles as :func:`inert_hook`."""

    def __reduce__(self) -> tuple[Any, tuple]:
        return _inert, ()

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return inert_hook

    def __copy__(self) -> Callable[..., None]:
        return inert_hook


def detachable(handle: Any) -> Any:
    """Make the hook behind a PyTorch ``RemovableHandle`` a :class:`ModelHook`; returns the handle."""
    ref = getattr(handle, "hooks_dict_ref", None)
    hooks = ref() if ref is not None else None
    if hooks is not None:
        fn = hooks.get(handle.id)
        if fn is not None and not isinstance(fn, ModelHook):
            hooks[handle.id] = ModelHook(fn)
    return handle


class Setting(int):
    """A temporary value of a model setting: truthy while lensadapters needs it, the user's value otherwise.

    It stands for ``True`` in ``if config.disable_compile:`` while ``needed()`` holds, compares equal to the user's
    ``original`` value (so ``GenerationConfig.to_diff_dict``, which ``save_pretrained`` writes, leaves it out exactly
    when it would leave the user's value out), pickles as ``original``, and deep-copies as ``original`` when the
    model itself is being copied (a copy of the generation config alone, as ``generate`` makes, keeps it).
    """

    original: Any
    _needed: Callable[[], bool]
    _model: "weakref.ref[nn.Module]"

    def __new__(cls, original: Any, needed: Callable[[], bool], model: nn.Module) -> "Setting":
        self = super().__new__(cls, 1 if original else 0)
        self.original, self._needed, self._model = original, needed, weakref.ref(model)
        return self

    def __bool__(self) -> bool:
        return self._needed() or bool(self.original)

    def __eq__(self, other: object) -> bool:
        return other is self or self.original == other

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.original)

    def __repr__(self) -> str:
        return repr(self.original)

    def __reduce__(self) -> tuple[Any, tuple]:
        return _identity, (self.original,)

    def __copy__(self) -> "Setting":
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        model = self._model()
        if model is not None and id(model) in memo:  # the model is being copied: the copy gets the user's value
            return self.original
        return self


class RoutedImplementation(str):
    """``config._attn_implementation`` while hooked layers are routed through lensadapters' attention function;
    copies and pickles as the user's ``original`` implementation."""

    original: str

    def __new__(cls, value: str, original: str) -> "RoutedImplementation":
        self = super().__new__(cls, value)
        self.original = original
        return self

    def __reduce__(self) -> tuple[Any, tuple]:
        return _identity, (str(self.original),)

    def __copy__(self) -> str:
        return str(self.original)

    def __deepcopy__(self, memo: dict) -> str:
        return str(self.original)


def _identity(value: Any) -> Any:
    return value


class InstanceOverride:
    """A function stored in one module instance's ``__dict__`` under a method's name (a pattern backend's override
    of ``module.<name>``, see ``examples/gptj``), which a copy or pickle of the model turns into the class's own
    method bound to the copied module: the copy computes what the unwrapped model does."""

    def __init__(self, fn: Callable[..., Any], module: nn.Module, name: str) -> None:
        self.fn, self.module, self.name = fn, module, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple]:
        return _class_method, (self.module, self.name)

    def __deepcopy__(self, memo: dict) -> Any:
        copied = memo.get(id(self.module))
        return _class_method(copied, self.name) if copied is not None else self


def override_instance_method(module: nn.Module, name: str, fn: Callable[..., Any]) -> "InstanceOverrideHandle":
    """Store ``fn`` as ``module.<name>`` for this instance only (an :class:`InstanceOverride`: Python finds instance
    attributes before the class's methods; the class and other instances are untouched), for a pattern backend; the
    returned handle's ``remove()`` deletes it again. Refuses a module that already has such an instance attribute
    (another tool's override), naming it."""
    if name in vars(module):
        from lensadapters.errors import LensAdaptersError

        raise LensAdaptersError(
            f"{type(module).__name__} already has an instance attribute {name!r} (another tool replaced its "
            f"{name} for this instance); lensadapters will not override it"
        )
    override = InstanceOverride(fn, module, name)
    module.__dict__[name] = override
    return InstanceOverrideHandle(module, name, override)


class InstanceOverrideHandle:
    """Handle (``remove()``) deleting the instance attribute :func:`override_instance_method` stored."""

    def __init__(self, module: nn.Module, name: str, override: InstanceOverride) -> None:
        self.module, self.name, self.override = module, name, override

    def remove(self) -> None:
        if self.module.__dict__.get(self.name) is self.override:
            del self.module.__dict__[self.name]


def _class_method(module: nn.Module, name: str) -> Callable[..., Any]:
    return functools.partial(getattr(type(module), name), module)


def original_value(value: Any) -> Optional[Any]:
    """The user's value behind a :class:`Setting` or :class:`RoutedImplementation` (else ``value`` itself)."""
    return value.original if isinstance(value, (Setting, RoutedImplementation)) else value
