"""Attribute access to hook points, as on a TransformerLens model: ``hm.blocks[0].attn.hook_pattern``,
``hm.hook_embed``, ``hm.ln_final.hook_scale``.

The namespace is derived from ``hm.hook_names`` (plugin-added points included); each leaf is the
:class:`~lensadapters.HookPoint` itself (``.add_hook(fn)``, ``.remove_hooks()``, ``.name``, ``.layer()``).
``hm.blocks`` used to be the list of Hugging Face decoder layers (now ``hm.block_modules``): an attribute that
is not a hook point but exists on the decoder layer still reaches it, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Iterator, Union

from lensadapters.api import tl_components
from lensadapters.hooks.hook_point import HookPoint

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.analysis.model import HookedModelLike


def _children(names: list[str], prefix: str) -> list[str]:
    start = prefix + "." if prefix else ""
    seen: dict[str, None] = {}
    for name in names:
        if name.startswith(start):
            seen[name[len(start) :].split(".", 1)[0]] = None
    return list(seen)


def lookup(hm: "HookedModelLike", prefix: str, attr: str) -> Union[HookPoint, "HookNamespace", "BlockList", None]:
    """The hook point ``prefix.attr``, the namespace under it, or ``None``."""
    full = f"{prefix}.{attr}" if prefix else attr
    points = hm.wiring.hook_dict
    if full in points:
        point = points[full]
        return point if point.replacement is None else point.replacement  # type: ignore[return-value]
    if full == "blocks":
        return BlockList(hm)
    if any(name.startswith(full + ".") for name in points):
        return HookNamespace(hm, full)
    return None


def attribute(hm: "HookedModelLike", prefix: str, attr: str) -> Union[HookPoint, "HookNamespace", "BlockList"]:
    """The hook point or namespace ``prefix.attr``, or the ``AttributeError`` naming what there is under ``prefix``
    (what TransformerLens' components ``hm.embed``... answer for attributes that are hook points)."""
    found = lookup(hm, prefix, attr)
    if found is None:
        raise missing(hm, prefix, attr)
    return found


def replace(hm: "HookedModelLike", prefix: str, attr: str, module: Any) -> bool:
    """Put ``module`` in the place of the hook point ``prefix.attr`` (``False`` if there is no such point).

    As on TransformerLens, where a hook point is a submodule a client may swap (auto-circuit's
    ``set_module_by_name``): the model's value there becomes ``module(value)``, and ``module`` reaches the point's
    hooks by calling the original point (``hm.hook_dict[name]``, which stays the original, as TransformerLens'
    ``hook_dict``). Setting the original point back restores it. The Hugging Face model is not touched.
    """
    full = f"{prefix}.{attr}" if prefix else attr
    point = hm.wiring.hook_dict.get(full)
    if point is None:
        return False
    point.replace(module)
    return True


def missing(hm: "HookedModelLike", prefix: str, attr: str) -> AttributeError:
    options = _children(list(hm.wiring.hook_dict), prefix)
    close = difflib.get_close_matches(attr, options, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    where = f"{prefix!r}" if prefix else "this HookedModel"
    return AttributeError(f"{where} has no hook point or namespace {attr!r}.{hint} Available: {', '.join(options)}")


class HookNamespace:
    """The hook points under one dotted prefix (``blocks.0``, ``blocks.0.attn``, ``ln_final``...)."""

    def __init__(self, hm: "HookedModelLike", prefix: str) -> None:
        object.__setattr__(self, "_hm", hm)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        found = lookup(self._hm, self._prefix, attr)
        if found is not None:
            return found
        weight = tl_components.weight_of(self._hm, self._prefix, attr)  # hm.blocks[0].attn.W_Q, .ln1.w...
        if weight is not None:
            return weight
        block = self._block_module()
        if block is not None and hasattr(block, attr):
            warnings.warn(
                f"hm.blocks[i] is now TransformerLens' namespace of hook points; reach the Hugging Face "
                f"decoder layer's {attr!r} through hm.block_modules[i].{attr}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(block, attr)
        raise missing(self._hm, self._prefix, attr)

    def __getitem__(self, index: int) -> Any:
        """A numbered child (a mixture of experts' ``mlp.experts[e]``), as ``nn.ModuleList`` indexing reads."""
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"hook namespace {self._prefix!r} is indexed by an int, not {type(index).__name__}")
        found = lookup(self._hm, self._prefix, str(index))
        if found is None:
            raise IndexError(f"{self._prefix!r} has no child {index}")
        return found

    def __setattr__(self, attr: str, value: Any) -> None:
        if not replace(self._hm, self._prefix, attr, value):
            raise AttributeError(
                f"{self._prefix!r} has no hook point {attr!r}: only hook points can be replaced by a module "
                "(attach hooks with .add_hook(fn))"
            )

    def __call__(self, x: Any) -> Any:
        """A norm's namespace (``hm.ln_final``, ``hm.blocks[0].ln1``) runs that norm module on ``x``, firing its
        hook points, as TransformerLens' ``model.ln_final(resid)``."""
        if self._prefix not in self._hm.wiring._norm_modules:
            raise TypeError(f"{self._prefix!r} is a namespace of hook points, not a callable component")
        return tl_components.call_norm(self._hm, self._prefix, x)

    def _block_module(self) -> Any:
        parts = self._prefix.split(".")
        if len(parts) == 2 and parts[0] == "blocks" and parts[1].isdigit():
            return self._hm.block_modules[int(parts[1])]
        return None

    def __dir__(self) -> list[str]:
        return _children(list(self._hm.wiring.hook_dict), self._prefix)

    def hook_points(self) -> list[HookPoint]:
        """Every hook point under this namespace, in execution order."""
        start = self._prefix + "."
        return [point for name, point in self._hm.wiring.hook_dict.items() if name.startswith(start)]

    def __repr__(self) -> str:
        return f"HookNamespace({self._prefix!r}: {', '.join(dir(self))})"


class BlockList(Sequence):
    """``hm.blocks``: one :class:`HookNamespace` per block (``len``, indexing, slicing, iteration)."""

    def __init__(self, hm: "HookedModelLike") -> None:
        self._hm = hm

    def __len__(self) -> int:
        return self._hm.cfg.n_layers

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"block {index} out of range: the model has {n} blocks")
        return HookNamespace(self._hm, f"blocks.{index % n}")

    def __getattr__(self, attr: str) -> Any:
        # getattr(hm.blocks, "3"), as nn.ModuleList answers (clients walk dotted names with getattr)
        if attr.isdigit():
            try:
                return self[int(attr)]
            except IndexError:
                pass
        raise AttributeError(f"'BlockList' object has no attribute {attr!r}")

    def __iter__(self) -> Iterator[HookNamespace]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"BlockList({len(self)} blocks)"
