"""What the selective-scan points of every scan form share (:mod:`.scan`: Mamba's form, :mod:`.scan_heads`:
Mamba-2's per-head one): a site that, only while one of its points is hooked, runs an explicit scan from what the
mixer's children gave, checks it against the model's own value where the scan's value goes in, applies the edits
(their semantics in :mod:`.scan`'s docstring) and keeps the model's cache consistent with them."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from lensadapters.hooks.copying import detachable
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import Site, first_input, replace_first_input

Tensor = torch.Tensor
SCAN_POINTS = ("hook_gate", "hook_conv", "hook_dt", "hook_ssm_state", "hook_ssm_out")
INPUT_POINTS = ("hook_gate", "hook_conv")  # the scan's inputs (the probe edits them in a pass of their own)


class ScanMismatch(RuntimeError):
    """The explicit scan does not reproduce the model's own value: the points are not served for this call."""


def cache_tensor(
    cache: Any, index: Any, getter: str = "get_recurrent_state", attr: str = "ssm_states"
) -> Optional[Tensor]:
    """The state transformers' cache holds for layer ``index`` (``getter``/``attr``: the recurrent state's by
    default, ``"get_conv_state"``/``"conv_states"`` the convolution's; ``None`` where there is none)."""
    if cache is None or not isinstance(index, int):
        return None
    get = getattr(cache, getter, None)
    if callable(get):
        try:
            found = get(index, state_idx=0)
        except Exception:  # another cache's signature
            found = None
        if isinstance(found, Tensor):
            return found
    states = getattr(cache, attr, None)
    try:
        found = states[index] if states is not None else None
    except Exception:  # not indexable so
        return None
    return found if isinstance(found, Tensor) else None


def _close(a: Tensor, b: Tensor) -> bool:
    from lensadapters.adapters.generic.probe import _close as close

    return close(a, b)


class ScanSite(Site):
    """The scan points of one recognised mixer (``points``: by name in :data:`SCAN_POINTS`, those served): what every
    form shares. A form (a subclass) says which children it reads (:meth:`_readers`), where its scan's value goes in
    (:attr:`inject`, a child whose first input it is), how the scan runs from what was read (:meth:`_starts`,
    :meth:`_steps`, :meth:`_readout`, :meth:`_combine`) and what the probe's edit of ``hook_ssm_out`` gives there."""

    inject = "out_proj"

    def __init__(self, mixer: nn.Module, points: dict[str, HookPoint]) -> None:
        self.mixer: Any = mixer  # a recognised mixer: its parameters and children are those recognise() read
        self.by = points
        self.points = tuple(points.values())
        self.problem: Optional[list[str]] = None  # the wrap-time probe: a mismatch is recorded here, not raised
        self.served: Optional[Tensor] = None  # the wrap-time probe: the model's own value where the scan goes in
        self.wide = torch.float32
        self.error: Optional[float] = None  # the last hooked call's largest difference from the model's value
        self.memory: Optional[tuple[Any, Tensor, Tensor]] = None  # (the cache, the state left in it, the shown one)
        self.readers: list[Any] = []  # the handles of this call's readers (:meth:`_readers`)
        self._clear()

    def _clear(self) -> None:
        self.cache: Any = None
        self.kwargs: dict = {}
        self.given: tuple[tuple, dict] = ((), {})  # what inject's pre-hook was given on this call
        self.h0: Optional[Tensor] = None
        self.final: Optional[tuple[Tensor, Tensor, bool, Tensor]] = None  # (unedited, served, edited, shown)
        self.entered = self.reached = False  # a hooked call began; the scan's value was checked where it goes in
        self.rounding = torch.float32  # the dtype whose rounding the check allows (the model's, where it is coarser)

    def live(self) -> bool:
        return any(p.has_live_hooks() for p in self.points)

    def install(self) -> list[Any]:
        m = self.mixer
        return [
            m.register_forward_pre_hook(self._enter, with_kwargs=True),
            m.get_submodule(self.inject).register_forward_pre_hook(self._on_inject, with_kwargs=True, prepend=True),
            m.register_forward_hook(self._exit, with_kwargs=True),
            _Readers(self),
        ]

    def _readers(self) -> list[Any]:
        """Forward hooks on the children whose outputs the scan reads. They are registered as each hooked call
        enters the mixer, so they run after every other hook on those children (a point's edit there included:
        the scan reads what the model goes on with), and removed as it leaves."""
        raise NotImplementedError

    def _drop_readers(self) -> None:
        readers, self.readers = self.readers, []
        for handle in readers:
            handle.remove()

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._drop_readers()  # a call that raised before its end left them
        self._clear()
        if not self.live():
            return
        self.readers = [detachable(handle) for handle in self._readers()]
        self.kwargs, self.entered = kwargs, True
        self.cache = next((kwargs[k] for k in ("cache", "cache_params") if kwargs.get(k) is not None), None)
        before = cache_tensor(self.cache, getattr(module, "layer_idx", None))
        self.h0 = None if before is None else before.detach().clone()

    def _fail(self, why: str) -> None:
        names = ", ".join(p.name for p in self.points)
        if self.problem is not None:
            self.problem.append(why)
            return
        raise ScanMismatch(
            f"{names}: {why}, so these points would serve a wrong value. Remove their hooks for this call (the "
            f"model itself runs as it is)"
        )

    def _rounding(self, served: Tensor) -> torch.dtype:
        """The dtype whose rounding the comparison with the model's value allows: the value's own."""
        return served.dtype

    def _starts(self, served: Tensor) -> Any:
        """The ways this call may have begun (from the cache, from nothing): for each, the form prepares what the
        scan reads and yields the step sizes and the state before the first position (``None``: zeros); a string
        yielded first says why the scan cannot run on this call."""
        raise NotImplementedError

    def _steps(self, dt: Tensor) -> tuple[Tensor, Tensor]:
        """``(decay, drive)`` of ``h_t = decay_t * h_{t-1} + drive_t``, position second (``drive``: the states')."""
        raise NotImplementedError

    def _readout(self, states: Tensor) -> Tensor:
        """The scan's output ``y_t = h_t . C_t`` (``hook_ssm_out``)."""
        raise NotImplementedError

    def _combine(self, ys: Tensor) -> Tensor:
        """The value that goes into :attr:`inject` from the scan's output (the ``D`` skip, a gate)."""
        raise NotImplementedError

    def edit_targets(self) -> dict[str, tuple[str, int, str]]:
        """The input points whose edit goes on as a child's input, not through the scan alone: by point, the child,
        the input's position and its keyword (the probe checks the child is given the edited value)."""
        return {}

    def edit_reaches(self, base: Tensor) -> Tensor:
        """What :attr:`inject`'s input is after the probe adds 1 to ``hook_ssm_out`` (``base``: its own value)."""
        raise NotImplementedError

    def _scan(self, dt: Tensor, edit: Optional[tuple[Tensor, Tensor]] = None, h0: Optional[Tensor] = None) -> Tensor:
        """The states after every position, position second (``edit``: states and where they replace)."""
        decay, drive = self._steps(dt)
        h = torch.zeros_like(drive[:, 0]) if h0 is None else h0.to(self.wide)
        states = []
        for t in range(drive.shape[1]):
            h = decay[:, t] * h + drive[:, t]
            if edit is not None:
                h = torch.where(edit[1][:, t], edit[0][:, t].to(self.wide), h)
            states.append(h)
        return torch.stack(states, 1)

    def _output(self, states: Tensor, ys: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        ys = self._readout(states) if ys is None else ys
        return ys, self._combine(ys)

    def _on_inject(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not self.live():
            return None
        served, self.reached, self.given = first_input(args, kwargs), True, (args, kwargs)
        if self.problem is not None:
            self.served = served
        self.wide = torch.promote_types(served.dtype, torch.float32)  # float32 as HF's slow path, or wider
        self.rounding = self._rounding(served)
        starts = self._starts(served)
        for start in starts:
            if isinstance(start, str):
                return self._fail(start)
            dt0, h0 = start
            states0 = self._scan(dt0, h0=h0)
            y0 = self._output(states0)[1].to(served.dtype)
            self.error = float((y0.double() - served.double()).abs().max().detach())
            if _close(y0, served.to(self.rounding)):
                break
        else:
            return self._fail(f"the explicit selective scan does not reproduce the model's input of {self.inject}")
        dt, edited, u0 = dt0, self._edit_inputs(), self._remembered(h0)
        if "hook_dt" in self.by:
            dt, changed = self.by["hook_dt"].apply(dt0)
            edited = edited or changed
        states = self._scan(dt, h0=h0) if edited else states0
        base = states if u0 is None else self._scan(dt, h0=u0)  # what one pass would show hook_ssm_state
        if "hook_ssm_state" in self.by:
            shown, changed = self.by["hook_ssm_state"].apply(base, protect=True)
            if changed:
                states, edited = self._scan(dt, (shown, shown != base), h0), True
        ys, y = self._output(states)
        if "hook_ssm_out" in self.by:
            ys_e, changed = self.by["hook_ssm_out"].apply(ys)
            if changed:
                y, edited = self._output(states, ys_e)[1], True
        self.final = (states0[:, -1], states[:, -1], edited, base[:, -1])
        return self._finish(args, kwargs, y.to(served.dtype) if edited else None)

    def _edit_inputs(self) -> bool:
        """After the check: the edits of ``hook_gate`` and ``hook_conv`` (where the form applies them here, or made
        them before and reads them now), the scan's readings then the edited ones; whether any changed."""
        return False

    def _finish(self, args: tuple, kwargs: dict, y: Optional[Tensor]) -> Any:
        """What :attr:`inject`'s pre-hook gives: the inputs with ``y`` (an edited value) as the first, or ``None``."""
        return None if y is None else replace_first_input(args, kwargs, y)

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        final, cache, unchecked, rounding = self.final, self.cache, self.entered and not self.reached, self.rounding
        self._drop_readers()
        self._clear()
        if unchecked:
            return self._fail(f"the mixer did not call {self.inject} on this forward pass (a fused kernel)")
        if final is None or cache is None:
            return
        held = cache_tensor(cache, getattr(module, "layer_idx", None))
        if held is None or held.shape != final[0].shape or not _close(final[0].to(held.dtype), held.to(rounding)):
            if final[2]:
                self._fail("the model's cache does not hold the scan's last state where it can be replaced")
            return
        if final[2]:
            with torch.no_grad():
                held.copy_(final[1].detach().to(held.dtype))
        try:
            self.memory = (weakref.ref(cache), held.detach().clone(), final[3].detach())
        except TypeError:  # a cache that cannot be referred to weakly: each call shows the chain from its state
            self.memory = None

    def _remembered(self, h0: Optional[Tensor]) -> Optional[Tensor]:
        """The last state of the chain ``hook_ssm_state`` was shown on the call before, where the cache still holds
        what that call left in it: the hook is then shown what one pass over the whole sequence would show it (its
        edits replace states; they do not compound over cached steps)."""
        memory, self.memory = self.memory, None
        if h0 is None or memory is None or memory[0]() is not self.cache:
            return None
        left, shown = memory[1], memory[2]
        return shown if left.shape == h0.shape and torch.equal(left, h0.to(left.dtype)) else None

    def keep(self, failed: set[str]) -> bool:
        self.by = {k: p for k, p in self.by.items() if p.name not in failed}
        self.points = tuple(self.by.values())
        return bool(self.points)


class _Readers:
    """What :meth:`ScanSite.install` gives for the readers a call registers: removing it removes those a call left."""

    def __init__(self, site: ScanSite) -> None:
        self.site = site

    def remove(self) -> None:
        self.site._drop_readers()
