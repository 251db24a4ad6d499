"""The site protocol, the forward state sites share, and helpers on module inputs and outputs.

A *site* watches one place of the model (a module's input or output) and serves one or more hook points
there. The core installs a site's PyTorch hooks only while one of its points has a hook (``wanted()``), and
re-installs them when ``signature()`` changes; ``install()`` returns handles whose ``remove()`` undoes exactly
what it did. Every site follows one rule: if no hook changed anything, the model's own tensor is passed on
untouched (``HookPoint.apply`` says whether anything changed). Sites sharing a module follow the order rule of
:func:`completes_output` and :func:`reads_output`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks.frames import ForwardState, FrameValues  # noqa: F401  (re-exported: sites share per-call values through it)
from lensadapters.hooks.hook_point import HookPoint

Tensor = torch.Tensor
_INPUT_KEYS = ("hidden_states", "input", "x", "inputs_embeds")


class Handle(Protocol):
    """What ``Site.install`` returns: PyTorch's ``RemovableHandle`` or anything with ``remove()``."""

    def remove(self) -> None: ...


class Handles:
    """Several handles as one: ``remove()`` removes each, in order."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def first_input(args: tuple, kwargs: dict) -> Tensor:
    if args:
        return args[0]
    for key in _INPUT_KEYS:
        if key in kwargs:
            return kwargs[key]
    raise RuntimeError("lensadapters could not find the hidden states among the module's inputs")


def replace_first_input(args: tuple, kwargs: dict, value: Tensor) -> tuple[tuple, dict]:
    if args:
        return (value, *args[1:]), kwargs
    for key in _INPUT_KEYS:
        if key in kwargs:
            return args, {**kwargs, key: value}
    raise RuntimeError("lensadapters could not find the hidden states among the module's inputs")


def first_output(output: Any) -> Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def replace_first_output(output: Any, value: Tensor) -> Any:
    if isinstance(output, tuple):
        return (value, *output[1:])
    if isinstance(output, list):
        return [value, *output[1:]]
    return value


def plus_delta(out: Tensor, delta: Tensor) -> Tensor:
    """``out + delta`` in float32 or ``out``'s own dtype where it is wider, cast back to ``out``'s dtype: an edit
    entering as the difference it makes leaves the rest of a float64 model's value exactly as it was."""
    wide = torch.promote_types(out.dtype, torch.float32)
    return (out.to(wide) + delta.to(wide)).to(out.dtype)


def split_heads(t: Tensor, n_heads: int) -> Tensor:
    """``[..., n_heads * d_head]`` → ``[..., n_heads, d_head]`` (a view)."""
    return t.unflatten(-1, (n_heads, -1))


def merge_heads(t: Tensor) -> Tensor:
    return t.flatten(-2)


def completes_output(module: nn.Module, hook: Callable[..., Any], with_kwargs: bool = False) -> RemovableHandle:
    """Register a forward hook that *completes* ``module``'s output: writes into it what the model computes with an
    edit (a norm's edited output, a per-head edit folded into a projection, a recomputed MoE output).

    The order rule of shared modules: such a hook runs before every hook registered with :func:`reads_output` and
    before any other forward hook of ``module``, whichever was registered first, so everything that reads the
    output sees the edits in it. (At most one site completes a given module's output.)"""
    return module.register_forward_hook(hook, with_kwargs=with_kwargs, prepend=True)


def reads_output(module: nn.Module, hook: Callable[..., Any], with_kwargs: bool = False) -> RemovableHandle:
    """Register a forward hook that *reads* ``module``'s output (shows it to a point, perhaps replacing it with the
    point's edit): it runs after the hooks that complete the output (:func:`completes_output`)."""
    return module.register_forward_hook(hook, with_kwargs=with_kwargs)


class Site:
    """A group of hook points realized by PyTorch hooks at one place of the model."""

    points: tuple[HookPoint, ...] = ()

    def wanted(self) -> bool:
        return any(p.active for p in self.points)

    def signature(self) -> tuple[bool, ...]:
        """What decides the PyTorch hooks this site installs; the site is re-installed when it changes."""
        return (self.wanted(),)

    def install(self) -> Sequence[Handle]:  # pragma: no cover - abstract
        """Register the PyTorch hooks this site needs now; return handles that remove them."""
        raise NotImplementedError
