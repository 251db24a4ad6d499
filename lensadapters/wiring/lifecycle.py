"""Installing and removing the sites' PyTorch hooks as hooks come and go (mixed into ``Wiring``).

A site's PyTorch hooks exist only while one of its points has a hook attached (``_sync``), so a model with no hooks
runs exactly Hugging Face's forward; ``batched`` defers the work over many ``add_hook`` calls; compilation is
turned off while hooks are installed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from lensadapters.hooks.copying import Setting, detachable
from lensadapters.hooks.distributed import FsdpHookOrder
from lensadapters.hooks.frames import ForwardState, RecomputeToken
from lensadapters.hooks.guard import ModuleGuard
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import Site
from lensadapters.wiring.forward import _installed

Tensor = torch.Tensor
_UNSET = object()


class Installation:
    """The lazy installation of the sites' PyTorch hooks (mixed into ``Wiring``)."""

    # the wiring's state these methods keep (set in ``Wiring.__init__``)
    hf_model: nn.Module
    block_modules: list[nn.Module]
    forward_state: ForwardState
    guard: ModuleGuard
    _fsdp_order: FsdpHookOrder
    _points: dict[str, HookPoint]
    _point_sites: dict[HookPoint, list[Site]]
    _installed: dict[Site, tuple[tuple[bool, ...], list[Any]]]
    _dirty: set[Site]
    _site_order: dict[Site, int]
    _hooked_points: set[HookPoint]
    _defer: int
    _compile_setting: Any

    def _point_changed(self, point: HookPoint) -> None:
        if point.active:
            self._hooked_points.add(point)
        else:
            self._hooked_points.discard(point)
        self._dirty.update(self._point_sites.get(point, ()))
        if not self._defer:
            self._sync()

    def remove_hooks(self, predicate: Callable[[Any], bool], points: Optional[Iterable[HookPoint]] = None) -> None:
        """Remove the hooks ``predicate`` accepts (a ``HookEntry`` predicate) from ``points`` (default: all)."""
        with self.batched():
            for point in self._points.values() if points is None else dict.fromkeys(points):
                if point.remove_where(predicate):
                    if not point.active:
                        self._hooked_points.discard(point)
                    self._dirty.update(self._point_sites.get(point, ()))
        self.forward_state.clear()

    @property
    def installed(self) -> bool:
        """Whether any site has PyTorch hooks on the model now."""
        return bool(self._installed)

    def unpin(self, points: Sequence[HookPoint]) -> None:
        """A forward that may have been recomputed with these points' hooks is gone (its graph was freed).

        Called from a finalizer, at any time: the sites are re-installed at the next safe moment (``sync``).
        """
        for point in points:
            point.pins -= 1
            if not point.active:
                self._hooked_points.discard(point)
            self._dirty.update(self._point_sites.get(point, ()))

    def sync(self) -> None:
        """Install and remove PyTorch hooks as the attached hooks require (when no forward of this thread runs)."""
        if self._dirty and not self._defer and self.forward_state.open_frames == 0:
            self._sync()

    def _sync(self) -> None:
        dirty, self._dirty = self._dirty, set()
        # in registration order, not the set's (which follows the sites' ids): sites hooking one module the same way
        # register their PyTorch hooks in one order on every run
        for site in sorted(dirty, key=lambda site: self._site_order.get(site, len(self._site_order))):
            signature = site.signature()
            current = self._installed.get(site)
            if current is not None and current[0] == signature:
                continue
            if site is getattr(self, "_frame_site", None) and not any(signature) and self.forward_state.open_frames:
                self._dirty.add(site)  # a forward of this thread still needs its frame closed: remove it later
                continue
            if current is not None:
                for handle in current[1]:
                    handle.remove()
                del self._installed[site]
            if any(signature):
                self._installed[site] = (signature, [detachable(handle) for handle in site.install()])
        self._fsdp_order.outermost()
        self.guard.watch(self._installed)
        self._guard_compile(bool(self._installed))

    def uninstall(self) -> None:
        """Remove every PyTorch hook of every site (``unwrap``)."""
        for _, handles in list(self._installed.values()):
            for handle in handles:
                handle.remove()
        self._installed.clear()
        self._fsdp_order.restore()
        self.guard.watch(())
        self._guard_compile(False)
        self.forward_state.clear()

    def _guard_compile(self, hooked: bool) -> None:
        """While any hook is installed, ``generate`` must not compile the forward.

        transformers compiles the decoding forward on its own for static caches on accelerators; a
        compiled graph does not see PyTorch hooks added after it was traced (dynamo skips hook guards),
        so hooks would run on the first step and silently not on the others. The model's
        ``generation_config.disable_compile`` holds a :class:`lensadapters.copying.Setting` while hooks exist
        (truthy for ``generate``; the user's own value for ``save_pretrained``, copies and pickles) and gets the
        user's value back when they go.
        """
        config = getattr(self.hf_model, "generation_config", None)
        if config is None:
            return
        if hooked and self._compile_setting is _UNSET:
            current = getattr(config, "disable_compile", None)
            if current:  # the user's own setting disables compilation already
                return
            self._compile_setting = current
            ref = weakref.ref(self)
            config.disable_compile = Setting(current, lambda: _installed(ref), self.hf_model)
        elif not hooked and self._compile_setting is not _UNSET:
            if isinstance(getattr(config, "disable_compile", None), Setting):  # not set by the user meanwhile
                config.disable_compile = self._compile_setting
            self._compile_setting = _UNSET

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Add or remove many hooks, installing PyTorch hooks once at the end."""
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1
            if not self._defer:
                self._sync()

    def _recompute_token(self) -> Optional[RecomputeToken]:
        """A snapshot of the hooks of the forward starting now, when gradient checkpointing may recompute it."""
        if not torch.is_grad_enabled() or not any(
            b.training and getattr(b, "gradient_checkpointing", False) for b in self.block_modules
        ):
            return None
        thread, depth = threading.get_ident(), self.forward_state.depth
        snapshot: dict[HookPoint, tuple[list[Any], list[Any]]] = {}
        for point in list(self._hooked_points):
            fwd = [e for e in point.fwd_hooks if not e.readonly and e.applies(thread, depth)]
            bwd = [e for e in point.bwd_hooks if e.applies(thread, depth)]
            if fwd or bwd:
                snapshot[point] = (fwd, bwd)
        if not snapshot:
            return None
        token = RecomputeToken(snapshot, weakref.WeakMethod(self.sync))  # sites removed once the graph is freed
        points = list(snapshot)
        for point in points:
            point.pins += 1
        weakref.finalize(token, self.unpin, points)
        return token
