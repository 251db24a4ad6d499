"""Per-call state: which forward pass is running, in which thread, at which nesting depth.

Every forward of a wrapped model (while any hook is attached) runs inside a *frame*, pushed when the Hugging
Face model's forward starts and popped when it ends, even if it raises. Frames are kept per thread, so

* values that sites share within one forward (``ForwardState``: rotary cos/sin, residual bookkeeping) belong to
  that forward: a hook that calls the model again (nested, depth 1) or another thread's forward never sees or
  clears them;
* hooks added by a ``hooks()`` block (``run_with_hooks``, ``run_with_cache``) apply to the forwards of the thread
  that opened the block, at the depth where it was opened: an outer ``run_with_cache`` does not record a nested
  call's activations, and a nested call does not get the outer call's edits. Permanent hooks (``add_hook``) apply
  to every forward.

Gradient checkpointing re-runs the forward of checkpointed layers during ``backward()``, possibly after the hooks
of that forward were removed and on another thread (CUDA's autograd threads). A forward that may be recomputed
(gradients enabled, a block training with gradient checkpointing) therefore gets a :class:`RecomputeToken`: a
snapshot of the hooks that applied to it, tied to its autograd graph by an identity node on each block's output.
When backward reaches a block, the node makes the token current, and the recomputation runs exactly the hooks of
the original forward, whatever is attached by then.
"""

from __future__ import annotations

import threading
from typing import Any, Hashable, Optional

import torch

_recompute = threading.local()  # .token: the RecomputeToken of the block backward is recomputing now


class FrameValues:
    """The values sites share within one forward pass.

    Sites keep anything of their own that lives for one forward in :meth:`site_values` (not on the site object,
    which all threads and nested calls share).
    """

    def __init__(self) -> None:
        self.rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.batch: Optional[int] = None
        self.resid_mid: dict[Hashable, Any] = {}
        self.mlp_out: dict[Hashable, torch.Tensor] = {}
        self.block_shape: dict[int, tuple[int, ...]] = {}
        self.token: Optional[RecomputeToken] = None
        self._site_values: dict[int, dict[str, Any]] = {}

    def site_values(self, site: object) -> dict[str, Any]:
        """A dict for ``site``'s own values in this forward."""
        return self._site_values.setdefault(id(site), {})


class ForwardState:
    """Values sites share within one forward pass, kept per call (see the module docstring).

    Attribute access (``state.rotary``, ``state.resid_mid``...) reads and writes the :class:`FrameValues` of the
    forward running in this thread; outside any forward (a submodule called directly, a checkpointed layer
    recomputed during backward) it is the thread's own default frame.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_local", threading.local())
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_threads", {})  # thread id -> number of frames open in it

    def _stack(self) -> list[FrameValues]:
        local = self._local
        stack = getattr(local, "stack", None)
        if stack is None:
            stack = local.stack = []
        return stack

    def _default(self) -> FrameValues:
        local = self._local
        default = getattr(local, "default", None)
        if default is None:
            default = local.default = FrameValues()
        return default

    @property
    def frame(self) -> FrameValues:
        """The values of the forward running in this thread (or the thread's default frame)."""
        stack = self._stack()
        return stack[-1] if stack else self._default()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.frame, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.frame, name, value)

    def site_values(self, site: object) -> dict[str, Any]:
        return self.frame.site_values(site)

    @property
    def depth(self) -> Optional[int]:
        """The nesting depth of the forward running in this thread (0: not inside another), ``None`` outside."""
        stack = self._stack()
        return len(stack) - 1 if stack else None

    @property
    def open_frames(self) -> int:
        """How many forwards are running in this thread (the depth a ``hooks()`` block opened now applies to)."""
        return len(self._stack())

    def push(self) -> FrameValues:
        values = FrameValues()
        self._stack().append(values)
        with self._lock:
            ident = threading.get_ident()
            self._threads[ident] = self._threads.get(ident, 0) + 1
        return values

    def pop(self) -> None:
        stack = self._stack()
        if stack:
            stack.pop()
            with self._lock:
                ident = threading.get_ident()
                left = self._threads.get(ident, 0) - 1
                if left > 0:
                    self._threads[ident] = left
                else:
                    self._threads.pop(ident, None)

    def unwind(self, open_frames: int) -> None:
        """Close this thread's frames above ``open_frames``: those of forwards that ended by a ``BaseException`` that
        is no ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``), for which PyTorch runs no
        ``always_call`` forward hook."""
        while len(self._stack()) > open_frames:
            self.pop()

    def clear(self) -> None:
        """Forget the values of this thread's default frame (those of running forwards are theirs)."""
        self._local.default = FrameValues()


class RecomputeToken:
    """The hooks that applied to one forward pass, for its recomputation under gradient checkpointing."""

    __slots__ = ("snapshot", "released", "checkpointed_region", "__weakref__")

    def __init__(self, snapshot: dict[Any, list[Any]], released: Optional[Any] = None) -> None:
        self.snapshot = snapshot  # HookPoint -> the forward hook entries that applied to it
        self.released = released  # called (weakly held by the caller) once a backward freed this token's graph
        self.checkpointed_region = False


def current_recompute_token() -> Optional[RecomputeToken]:
    """The token of the forward whose checkpointed block backward is recomputing now (this thread)."""
    return getattr(_recompute, "token", None)


class _TagGraph(torch.autograd.Function):
    """Identity on a block's output; in backward, makes the forward's token current for the block's recomputation."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, token: RecomputeToken) -> torch.Tensor:  # type: ignore[override]
        ctx.token = token  # the graph keeps the token (and the hooks it snapshots) alive, and no longer
        # a witness of whether a backward freed the graph (retain_graph=False): then no recomputation can follow
        # (only outside checkpointed regions: a recomputation must save the same tensors as the forward)
        ctx.witness = not token.checkpointed_region
        if ctx.witness:
            ctx.save_for_backward(hidden.new_empty(0))
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ran = getattr(_recompute, "ran", None)
        if ran is None:  # handled when this backward ends
            _recompute.ran = ran = []
            torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)
        ran.append(ctx)
        _recompute.token = ctx.token
        return grad, None


def _freed(ctx: Any) -> bool:
    try:
        _ = ctx._raw_saved_tensors
        return False
    except RuntimeError:
        return True


def _release(ctx: Any) -> Optional[Any]:
    """Drop the token of a tag node whose graph a backward freed; its ``released`` callback (``None``: kept)."""
    if not ctx.witness or not _freed(ctx):  # raises once a backward without retain_graph freed them
        return None
    token, ctx.token = ctx.token, None
    return None if token is None else token.released


def _end_of_backward() -> None:
    """Forget the current token; drop the tokens of graphs this backward freed.

    A caller that keeps the loss keeps the graph's nodes, and with them the tokens (the hooks stay pinned and their
    sites installed): once the backward has freed the graph's buffers nothing can recompute, so the token goes.
    """
    _recompute.token = None
    ran, _recompute.ran = getattr(_recompute, "ran", None) or [], None
    freed = {id(ctx.token) for ctx in ran if ctx.witness and ctx.token is not None and _freed(ctx)}
    for ctx in ran:  # the block tags of a freed forward go with its exit tag
        if ctx.token is not None and id(ctx.token) in freed and not ctx.witness:
            ctx.token = None
    released = [callback for callback in map(_release, ran) if callback is not None]
    del ran  # the tokens are gone (their finalizers unpinned the points) before the sites are synced
    for callback in released:
        target = callback()
        if target is not None:
            target()


def tag_for_recompute(hidden: torch.Tensor, token: RecomputeToken, exit: bool = False) -> torch.Tensor:
    """``hidden`` with its graph tagged by ``token`` (values and gradients unchanged)."""
    token.checkpointed_region = not exit
    try:
        return _TagGraph.apply(hidden, token)
    finally:
        token.checkpointed_region = False
