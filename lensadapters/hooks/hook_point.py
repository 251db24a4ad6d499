"""Hook points: named places where user functions read and edit activations."""

from __future__ import annotations

import itertools
import math
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lensadapters.errors import HookReturnError
from lensadapters.hooks.frames import current_recompute_token

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.hooks.frames import ForwardState

HookFn = Callable[..., Optional[torch.Tensor]]
_LAYER = re.compile(r"^blocks\.(\d+)\.")
_ids = itertools.count()
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def is_recomputing() -> bool:
    """Whether the forward now running is a recomputation inside a backward pass.

    Gradient checkpointing (``model.gradient_checkpointing_enable()``, reentrant or not) runs the forward
    of each checkpointed layer a second time during ``backward()``, so forward hooks inside it fire again.
    This is ``True`` in that second run: a forward with gradients enabled while autograd executes a
    backward pass. ``run_with_cache`` uses it to record each hook point once per forward; a read-only
    user hook can return early when it is ``True`` (an *editing* hook must not: the recomputed layer
    has to see the same edit, or the gradients are computed on unedited activations).
    """
    return _graph_task_id is not None and torch.is_grad_enabled() and _graph_task_id() != -1


@dataclass(eq=False)
class HookEntry:
    """One user function attached to a hook point."""

    fn: HookFn
    permanent: bool = False
    context: Optional[int] = None  # id of the ``hooks()`` block that added it
    order: int = 0
    readonly: bool = False  # the core's own readers (run_with_cache): never edit, never need a copy
    # a hooks() block's entries apply only to forwards of the thread that opened it, at the depth it was opened
    # (None: every forward, as permanent hooks and add_hook do)
    thread: Optional[int] = None
    depth: Optional[int] = None
    # added by ``register_forward_hook`` (PyTorch's module API): removed only by its handle, as in TransformerLens,
    # where reset_hooks and remove_hooks leave such hooks alone
    torch_hook: bool = False

    def applies(self, thread: int, depth: Optional[int]) -> bool:
        """Whether this hook runs in a forward of ``thread`` at nesting ``depth`` (``None``: outside a forward)."""
        if self.thread is None:
            return True
        return self.thread == thread and (depth is None or self.depth == depth)


def _version(t: torch.Tensor) -> Optional[int]:
    """The tensor's in-place version counter (``None`` for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


class HookPoint:
    """A named activation. Sites call :meth:`apply` with the value the model computed."""

    def __init__(
        self, name: str, on_change: Callable[["HookPoint"], None], state: Optional["ForwardState"] = None
    ) -> None:
        self.name = name
        self._state = state  # the wrapped model's per-call state: which forward is running here
        self.pins = 0  # forwards that may still be recomputed with this point's hooks (gradient checkpointing)
        self.fwd_hooks: list[HookEntry] = []
        self.bwd_hooks: list[HookEntry] = []
        self._on_change = on_change
        match = _LAYER.match(name)
        self._layer = int(match.group(1)) if match else None
        # Set by the core for points whose module may see tokens flattened to [b*p, ...] (a block with
        # BlockLayout.flat_mlp): returns the block's leading (b, p) for this forward, or None.
        self.token_shape: Optional[Callable[[], Optional[tuple[int, ...]]]] = None
        # Computed only while hooked (per-expert activations): left out of run_with_cache's default.
        self.costly = False
        #: TransformerLens' per-point scratch dict (``hook.ctx["activation"] = x``), emptied by ``clear_context``
        #: and by ``hm.reset_hooks(clear_contexts=True)``
        self.ctx: dict[Any, Any] = {}
        #: the module a client put in this point's place (``hm.blocks[3].hook_resid_pre = wrapper``); the site
        #: calls it with the value, and it reaches this point's hooks by calling this point
        self.replacement: Optional[Callable[[torch.Tensor], Any]] = None
        #: for a point that fires only in some forwards (a projector's points, in a forward with images), the
        #: condition in words: a ``with hm.hooks(...)`` block whose forwards never reached it warns, naming it
        self.fires_when: Optional[str] = None

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r}, fwd={len(self.fwd_hooks)}, bwd={len(self.bwd_hooks)})"

    def layer(self) -> Optional[int]:
        """The block index of this hook point (``None`` outside blocks), as in TransformerLens."""
        return self._layer

    @property
    def recomputing(self) -> bool:
        """:func:`is_recomputing`, for hooks: ``if hook.recomputing: return`` skips checkpoint recomputation."""
        return is_recomputing()

    @property
    def active(self) -> bool:
        """Whether the point's site must be installed: a hook is attached, or a forward that ran its hooks may
        still be recomputed by gradient checkpointing."""
        return bool(self.fwd_hooks or self.bwd_hooks or self.pins) or self.replacement is not None

    @property
    def may_edit(self) -> bool:
        """Whether a hook attached here may change the value (any but the core's own readers)."""
        return (
            bool(self.bwd_hooks or self.pins)
            or self.replacement is not None
            or any(not e.readonly for e in self.fwd_hooks)
        )

    # --- management -----------------------------------------------------------------------------

    def add(
        self,
        fn: HookFn,
        dir: str = "fwd",
        *,
        permanent: bool = False,
        context: Optional[int] = None,
        prepend: bool = False,
        readonly: bool = False,
        thread: Optional[int] = None,
        depth: Optional[int] = None,
    ) -> HookEntry:
        entry = HookEntry(fn, permanent, context, next(_ids), readonly, thread, depth)
        hooks = self._list(dir)
        hooks.insert(0, entry) if prepend else hooks.append(entry)
        self._on_change(self)
        return entry

    def remove(self, entry: HookEntry) -> None:
        for hooks in (self.fwd_hooks, self.bwd_hooks):
            if entry in hooks:
                hooks.remove(entry)
        self._on_change(self)

    def remove_where(self, predicate: Callable[[HookEntry], bool]) -> bool:
        """Remove the hooks ``predicate`` accepts (never those of ``register_forward_hook``: their handle does)."""
        before = len(self.fwd_hooks) + len(self.bwd_hooks)
        self.fwd_hooks = [e for e in self.fwd_hooks if e.torch_hook or not predicate(e)]
        self.bwd_hooks = [e for e in self.bwd_hooks if e.torch_hook or not predicate(e)]
        return before != len(self.fwd_hooks) + len(self.bwd_hooks)

    # --- TransformerLens' HookPoint methods (hm.hook_dict[name].add_hook(fn), hm.blocks[0].attn.hook_z...) ----

    def _owner(self) -> Any:
        """The HookedModel this point belongs to (its change callback is a bound method of its wiring)."""
        wiring = getattr(self._on_change, "__self__", None)
        return getattr(wiring, "owner", None) or wiring

    def add_hook(
        self,
        hook: HookFn,
        dir: str = "fwd",
        is_permanent: bool = False,
        level: Optional[int] = None,
        prepend: bool = False,
    ) -> None:
        """Attach ``hook`` here, as ``hm.add_hook(self.name, hook, ...)`` (TransformerLens' ``HookPoint.add_hook``;
        ``level`` is not supported)."""
        if level is not None:
            raise ValueError("level (TransformerLens' hook contexts) is not supported by lensadapters")
        owner = self._owner()
        if owner is not None and hasattr(owner, "add_hook"):
            owner.add_hook(self.name, hook, dir=dir, is_permanent=is_permanent, prepend=prepend)
        else:
            self.add(hook, dir, permanent=is_permanent, prepend=prepend)

    def remove_hooks(self, dir: str = "fwd", including_permanent: bool = False, level: Optional[int] = None) -> None:
        """Remove this point's hooks (``dir``: ``"fwd"``, ``"bwd"`` or ``"both"``), as TransformerLens."""
        if dir not in ("fwd", "bwd", "both"):
            raise ValueError(f"dir must be 'fwd', 'bwd' or 'both', not {dir!r}")
        if level is not None:
            raise ValueError("level (TransformerLens' hook contexts) is not supported by lensadapters")

        def keep(entry: Any) -> bool:
            return entry.torch_hook or (entry.permanent and not including_permanent)

        if dir in ("fwd", "both"):
            self.fwd_hooks = [e for e in self.fwd_hooks if keep(e)]
        if dir in ("bwd", "both"):
            self.bwd_hooks = [e for e in self.bwd_hooks if keep(e)]
        self._on_change(self)

    def add_perma_hook(self, hook: HookFn, dir: str = "fwd") -> None:
        """``add_hook(hook, dir, is_permanent=True)``, as TransformerLens."""
        self.add_hook(hook, dir=dir, is_permanent=True)

    def clear_context(self) -> None:
        """Empty :attr:`ctx` (a new dict, as TransformerLens)."""
        self.ctx = {}

    # --- PyTorch's module API, for clients that treat hook points as modules (TransformerLens' are nn.Modules) --

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """TransformerLens' ``HookPoint.forward`` with its hooks: run this point's hooks on ``x``, return the result.

        A module put in this point's place (:meth:`replace`) reaches the point's hooks this way, as a wrapper of a
        TransformerLens hook point calls the module it wraps.
        """
        return self._run(x, False, self.live_hooks("fwd"), True)[0]

    forward = __call__

    def register_forward_hook(self, hook: Callable[..., Any], *, prepend: bool = False) -> "TorchHandle":
        """``hook(module, (input,), output) -> output | None`` runs whenever this point runs, as a PyTorch forward
        hook on TransformerLens' HookPoint module; a returned tensor replaces the value. Stays until
        ``handle.remove()`` (``reset_hooks`` and ``remove_hooks`` leave it, as in TransformerLens)."""

        torch_hook = hook

        def fn(value: torch.Tensor, hook: "HookPoint") -> Any:
            return torch_hook(self, (value,), value)

        entry = self.add(fn, "fwd", permanent=True, prepend=prepend)
        entry.torch_hook = True
        return TorchHandle(self, entry)

    def replace(self, module: Optional[Callable[[torch.Tensor], Any]]) -> None:
        """Put ``module`` in this point's place: the model's value at this point becomes ``module(value)`` (it calls
        this point to run the point's hooks). ``None`` or the point itself puts the point back. This is what
        ``hm.blocks[3].hook_resid_pre = module`` does; nothing is inserted into the Hugging Face model."""
        if module is self:
            module = None
        if module is not None and not callable(module):
            raise TypeError(
                f"{self.name!r} can only be replaced by a module or callable taking the tensor, not "
                f"{type(module).__name__}"
            )
        self.replacement = module
        self._on_change(self)

    def _list(self, dir: str) -> list[HookEntry]:
        if dir == "fwd":
            return self.fwd_hooks
        if dir == "bwd":
            return self.bwd_hooks
        raise ValueError(f"dir must be 'fwd' or 'bwd', not {dir!r}")

    # --- which hooks run now ------------------------------------------------------------------------

    def live_hooks(self, dir: str = "fwd") -> list[HookEntry]:
        """The hooks that run in the forward executing now (see :mod:`lensadapters.frames`).

        A checkpointed layer recomputed during backward runs the hooks its original forward ran (when that
        forward was tagged), else every attached hook.
        """
        hooks = self._list(dir)
        if is_recomputing():
            token = current_recompute_token()
            if token is not None:
                fwd, bwd = token.snapshot.get(self, ((), ()))
                return list(fwd if dir == "fwd" else bwd)
            return list(hooks)
        if not hooks:
            return hooks
        if all(e.thread is None for e in hooks):
            return list(hooks)
        depth = self._state.depth if self._state is not None else None
        thread = threading.get_ident()
        return [e for e in hooks if e.applies(thread, depth)]

    def has_live_hooks(self) -> bool:
        """Whether any hook runs here in the forward executing now."""
        return self.replacement is not None or bool(self.live_hooks("fwd") or self.live_hooks("bwd"))

    # --- running ---------------------------------------------------------------------------------

    def apply(self, value: torch.Tensor, protect: bool = False) -> tuple[torch.Tensor, bool]:
        """Run the forward hooks on ``value``; return the (possibly replaced) value and whether it changed.

        A hook edits by returning a new tensor or by changing the one it was given in place (as in
        TransformerLens); returning ``None`` or the same tensor unchanged leaves the value untouched, so
        an identity hook costs no recomputation and keeps the model's numbers bit for bit. ``protect``:
        the caller still needs ``value`` as it is (it computes the edit's difference from it) or the
        model uses the same tensor elsewhere, so hooks that may edit are given a copy. A 2-D value at a
        point with ``token_shape`` (tokens flattened to ``[b*p, ...]`` by the model) is shown to hooks
        as ``[b, p, ...]``; an edit is flattened back.
        """
        lead = self.token_shape() if self.token_shape is not None and value.dim() == 2 else None
        if lead is not None and math.prod(lead) == value.shape[0]:
            shown, changed = self._apply(value.reshape(*lead, value.shape[-1]), protect)
            return (shown.reshape(value.shape) if changed else value), changed
        return self._apply(value, protect)

    def _apply(self, value: torch.Tensor, protect: bool = False) -> tuple[torch.Tensor, bool]:
        module = self.replacement
        if module is None:
            return self._run(value, protect, self.live_hooks("fwd"), True)
        # a client's module in this point's place: it gets the value (a copy where the model still needs it) and
        # calls this point, whose hooks (backward ones included) then run on what it passes
        return self._run(value, protect, [HookEntry(lambda v, hook: module(v))], False)

    def _run(
        self, value: torch.Tensor, protect: bool, entries: list[HookEntry], backward: bool
    ) -> tuple[torch.Tensor, bool]:
        original = value
        changed = False
        # autograd forbids in-place edits of some tensors (one of several views a split returned; a value a backward
        # formula needs, such as softmax's or relu's output): while it records, a hook that may edit gets a copy
        recording = value.requires_grad and torch.is_grad_enabled()
        for entry in entries:
            if entry.readonly:
                entry.fn(value, hook=self)
                continue
            if (protect or recording) and value is original:
                value = original.clone()
            version = _version(value)
            out = entry.fn(value, hook=self)
            if out is None or out is value:
                if version is None:  # inference mode: no version counter; compare with what the model computed
                    changed = changed or not (value is original or torch.equal(value, original))
                else:
                    changed = changed or _version(value) != version
                continue
            value = self._conform(out, value)
            changed = True
        if not changed and not (value is not original and _asks_for_its_gradient(value)):
            value = original  # a copy nobody edited: keep the model's own tensor
        elif not changed:  # the copy a hook asked the gradient of (register_hook, retain_grad): the model must use it
            changed = True
        if backward and self.bwd_hooks and torch.is_grad_enabled() and value.requires_grad:
            entries = self.live_hooks("bwd")  # the hooks of this forward, even if removed before backward
            if entries:
                value = value.view_as(value)
                value.register_hook(lambda grad: self._run_backward(grad, entries))
                changed = True
        return value, changed

    def _run_backward(self, grad: torch.Tensor, entries: list[HookEntry]) -> torch.Tensor:
        for entry in entries:
            out = entry.fn(grad, hook=self)
            if out is not None and out is not grad:
                grad = self._conform(out, grad)
        return grad

    def _conform(self, out: object, like: torch.Tensor) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise HookReturnError(
                f"hook on {self.name!r} returned {type(out).__name__}; return a tensor of shape "
                f"{tuple(like.shape)} or None to keep the value"
            )
        if out.shape != like.shape:
            raise HookReturnError(
                f"hook on {self.name!r} returned shape {tuple(out.shape)}, but the hook point has shape "
                f"{tuple(like.shape)}; return a tensor of the same shape (or None to keep the value)"
            )
        if out.is_meta and not like.is_meta:
            raise HookReturnError(
                f"hook on {self.name!r} returned a meta tensor (shape and dtype, no values); return a tensor with "
                f"values on {like.device} (or None to keep the value)"
            )
        if out.dtype != like.dtype:
            if out.is_floating_point() != like.is_floating_point() and not like.is_floating_point():
                raise HookReturnError(
                    f"hook on {self.name!r} returned dtype {out.dtype}, which cannot stand for {like.dtype}"
                )
            out = out.to(like.dtype)
        if out.device != like.device:
            out = out.to(like.device)
        return out


def _asks_for_its_gradient(value: torch.Tensor) -> bool:
    """Whether a hook registered a tensor hook on ``value`` or asked it to retain its gradient: then ``value``, not
    the model's tensor it copies, must be what the model goes on with, or that gradient never comes."""
    return value.requires_grad and (bool(getattr(value, "_backward_hooks", None)) or value.retains_grad)


class TorchHandle:
    """What :meth:`HookPoint.register_forward_hook` returns: ``remove()`` takes the hook off (as PyTorch's handle)."""

    def __init__(self, point: HookPoint, entry: HookEntry) -> None:
        self.point, self.entry = point, entry

    def remove(self) -> None:
        if self.entry in self.point.fwd_hooks:
            self.point.remove(self.entry)

    def __enter__(self) -> "TorchHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
