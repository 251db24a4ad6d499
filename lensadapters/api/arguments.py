"""Checks on what users pass to ``HookedModel``, made before any forward runs, with errors naming the argument
and the fix (a mistake found mid-forward would leave a half-run model and a traceback deep inside transformers)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from lensadapters.errors import LensAdaptersError


class HookArgumentError(LensAdaptersError, TypeError):
    """A hook, a hook list or a name filter that cannot be used, named with the fix."""


def hook_pairs(hooks: Any, argument: str) -> list[tuple[Any, Callable[..., Any]]]:
    """``fwd_hooks``/``bwd_hooks`` as a list of ``(name or filter, hook)`` pairs (``None``: no hooks)."""
    if hooks is None:
        return []
    if isinstance(hooks, dict):
        raise HookArgumentError(
            f"{argument} must be a list of (name, hook) pairs, not a dict: pass {argument}=list(hooks.items())"
        )
    if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Iterable):
        raise HookArgumentError(f"{argument} must be a list of (name, hook) pairs, not a {type(hooks).__name__}")
    if isinstance(hooks, tuple) and len(hooks) == 2 and callable(hooks[1]) and not isinstance(hooks[1], tuple):
        raise HookArgumentError(
            f"{argument} was given a single (name, hook) pair; pass a list of pairs: {argument}=[(name, hook)]"
        )
    pairs = list(hooks)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise HookArgumentError(
                f"{argument}[{i}] is {pair!r:.80}; each entry must be a (name, hook) pair, such as "
                f"('blocks.0.hook_resid_pre', fn)"
            )
    return [tuple(pair) for pair in pairs]  # type: ignore[misc]


def selector(name: Any) -> Any:
    """``name`` as a selector that can be read more than once: an iterator (a generator of names) as a list."""
    if isinstance(name, Iterator) and not isinstance(name, str) and not callable(name):
        return list(name)
    return name


def check_selector(name: Any, argument: str = "name") -> None:
    """A hook name, a list of names, or a predicate on names."""
    if isinstance(name, str) or callable(name):
        return
    if hasattr(name, "pattern") and hasattr(name, "search"):  # a compiled regular expression
        raise HookArgumentError(f"{argument} is a regular expression; pass a predicate: {argument}=pattern.search")
    if isinstance(name, (bytes, dict)) or not isinstance(name, Iterable):
        raise HookArgumentError(
            f"{argument} must be a hook name, a list of hook names or a predicate "
            f"(lambda name: ...), not a {type(name).__name__} ({name!r:.60})"
        )
    for item in name:
        if not isinstance(item, str):
            raise HookArgumentError(
                f"{argument} contains {item!r:.60} (a {type(item).__name__}); a list given as "
                f"{argument} must hold hook names (strings)"
            )


def check_hook(fn: Any, where: str) -> None:
    """``fn`` can be called as TransformerLens calls hooks: ``fn(tensor, hook=hook_point)``."""
    if not callable(fn):
        raise HookArgumentError(
            f"the hook for {where} is a {type(fn).__name__} ({fn!r:.60}), not a function; "
            f"pass fn(tensor, hook) -> tensor | None"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and C callables without a signature: cannot tell
        return
    try:
        signature.bind(object(), hook=object())
    except TypeError:
        raise HookArgumentError(
            f"the hook for {where} cannot be called as fn(tensor, hook=hook_point) (its signature is "
            f"{getattr(fn, '__name__', type(fn).__name__)}{signature}): hooks take the activation and a keyword "
            f"argument named `hook`, as in TransformerLens — def fn(tensor, hook): ..."
        ) from None


def check_cache_device(device: Any) -> Optional[torch.device]:
    """``run_with_cache(device=...)``: a device that can hold values."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise HookArgumentError(f"run_with_cache(device={device!r}) is not a device: {exc}") from None
    if resolved.type == "meta":
        raise HookArgumentError(
            "run_with_cache(device='meta') would keep shapes without values; pass a device that "
            "holds data ('cpu', 'cuda'...) or None to keep each tensor where it was computed"
        )
    return resolved


def batch_of(args: tuple, kwargs: dict) -> Optional[int]:
    """The batch size of a forward's inputs, when it can be read from them."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0]
    return None
