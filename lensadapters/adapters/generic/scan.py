"""The selective scan of a Mamba token mixer as points (issue #29 item 4), served on layers of the mixer form
(:mod:`.mixer`) whose token mixer is recognised by its parameters and verified by a probe forward pass.

* **Recognised**: a token mixer with parameters ``A_log`` ``[d_inner, d_state]`` and ``D`` ``[d_inner]`` of its own,
  linear children ``in_proj`` (``2 * d_inner`` outputs: the scan's input and the gate), ``x_proj`` (``dt_rank +
  2 * d_state``: the step's low-rank input, ``B`` and ``C``), ``dt_proj`` (``dt_rank -> d_inner``, with its bias),
  ``out_proj`` (``d_inner`` inputs) and an activation ``act``: Mamba's selective scan (the published equations:
  ``dt = softplus(dt_proj(dt_in))``, ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t`` with ``A = -exp(A_log)``,
  ``y_t = h_t . C_t``, output ``(y_t + D x_t) * act(gate_t)``). Mamba-2's per-head form: :mod:`.scan_heads`.
* **Points** (relative to the layer, ``<mixer>`` the mixer child's name): ``<mixer>.hook_dt`` ``[b, p, d_inner]``
  the step sizes, ``<mixer>.hook_ssm_state`` ``[b, p, d_inner, d_state]`` the state after every position,
  ``<mixer>.hook_ssm_out`` ``[b, p, d_inner]`` the scan's output before the ``D`` skip and the gate. Only while one
  of them is hooked, an explicit scan (a loop over positions, in float32) runs, from the values the model gave
  ``x_proj`` (its input ``x`` and its output) and ``in_proj`` (the gate); otherwise nothing runs.
* **Checked on every hooked call**: the unedited explicit scan must give the model's own input of ``out_proj`` (and,
  with a cache, the final state the cache holds), else the call raises naming the points. The wrap-time probe runs
  this check on every recognised layer (and an edit of ``hook_ssm_out``, against a plain hook on ``out_proj``); a
  layer that fails gets none of the three points, and the warning says why.
* **Edits**: an edited ``hook_dt`` is the step size of the whole scan (its state and output). An edited
  ``hook_ssm_state``: at every position ``t`` and state element where the returned value differs from the value the
  hook was shown, the state at ``t`` *is* the returned value: the output at ``t`` reads it and the state at ``t + 1``
  is carried on from it (``h_{t+1} = exp(dt A) h'_t + dt B x``); elsewhere the state is what the scan computes from
  the (edited) state before it. Replacing every position's state by another run's therefore gives exactly those
  states. An edited ``hook_ssm_out`` is the scan's output (the ``D`` skip and the gate are applied to it). With a
  cache, the cache then holds the last (edited) state, and the next call with that cache shows ``hook_ssm_state``
  the states carried on from the last one it showed (not from the edited one), so cached generation shows and
  edits what one full pass would.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import Site, first_input, replace_first_input

Tensor = torch.Tensor
SCAN_POINTS = ("hook_dt", "hook_ssm_state", "hook_ssm_out")


class ScanMismatch(RuntimeError):
    """The explicit scan does not reproduce the model's own value: the points are not served for this call."""


def recognise(mixer: nn.Module) -> Optional[str]:
    """``None`` where ``mixer`` is the selective scan the module docstring describes, else why not."""
    own = dict(mixer.named_parameters(recurse=False))
    a_log, d = own.get("A_log"), own.get("D")
    if a_log is None or d is None or a_log.dim() != 2 or d.dim() != 1 or d.shape[0] != a_log.shape[0]:
        return "no parameters A_log [d_inner, d_state] and D [d_inner] of its own"
    inner, state = a_log.shape
    units = {n: getattr(mixer, n, None) for n in ("in_proj", "x_proj", "dt_proj", "out_proj")}
    if not all(isinstance(u, nn.Linear) for u in units.values()) or not callable(getattr(mixer, "act", None)):
        return "no linear children in_proj, x_proj, dt_proj, out_proj and activation act"
    i, x, dt, o = (units[n] for n in ("in_proj", "x_proj", "dt_proj", "out_proj"))
    assert isinstance(i, nn.Linear) and isinstance(x, nn.Linear) and isinstance(dt, nn.Linear)
    assert isinstance(o, nn.Linear)
    shapes = (i.out_features == 2 * inner, x.in_features == inner, dt.out_features == inner, o.in_features == inner)
    if not all(shapes) or x.out_features != dt.in_features + 2 * state or dt.bias is None:
        return "the children's shapes are not those of Mamba's selective scan"
    return None


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
        self._clear()

    def _clear(self) -> None:
        self.cache: Any = None
        self.kwargs: dict = {}
        self.h0: Optional[Tensor] = None
        self.final: Optional[tuple[Tensor, Tensor, bool, Tensor]] = None  # (unedited, served, edited, shown)
        self.entered = self.reached = False  # a hooked call began; the scan's value was checked where it goes in

    def live(self) -> bool:
        return any(p.has_live_hooks() for p in self.points)

    def install(self) -> list[Any]:
        m = self.mixer
        return [
            m.register_forward_pre_hook(self._enter, with_kwargs=True),
            *self._readers(),
            m.get_submodule(self.inject).register_forward_pre_hook(self._on_inject, with_kwargs=True, prepend=True),
            m.register_forward_hook(self._exit, with_kwargs=True),
        ]

    def _readers(self) -> list[Any]:
        raise NotImplementedError

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._clear()
        if not self.live():
            return
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
        served, self.reached = first_input(args, kwargs), True
        if self.problem is not None:
            self.served = served
        self.wide = torch.promote_types(served.dtype, torch.float32)  # float32 as HF's slow path, or wider
        starts = self._starts(served)
        for start in starts:
            if isinstance(start, str):
                return self._fail(start)
            dt0, h0 = start
            states0 = self._scan(dt0, h0=h0)
            y0 = self._output(states0)[1].to(served.dtype)
            self.error = float((y0.double() - served.double()).abs().max())
            if _close(y0, served):
                break
        else:
            return self._fail(f"the explicit selective scan does not reproduce the model's input of {self.inject}")
        dt, edited, u0 = dt0, False, self._remembered(h0)
        if "hook_dt" in self.by:
            dt, edited = self.by["hook_dt"].apply(dt0)
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
        return replace_first_input(args, kwargs, y.to(served.dtype)) if edited else None

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        final, cache, unchecked = self.final, self.cache, self.entered and not self.reached
        self._clear()
        if unchecked:
            return self._fail(f"the mixer did not call {self.inject} on this forward pass (a fused kernel)")
        if final is None or cache is None:
            return
        held = cache_tensor(cache, getattr(module, "layer_idx", None))
        if held is None or held.shape != final[0].shape or not _close(final[0].to(held.dtype), held):
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


class MambaScan(ScanSite):
    """Mamba's selective scan (the module docstring): read from ``in_proj``'s output (the gate) and ``x_proj``'s
    input and output, put in as ``out_proj``'s input."""

    def _clear(self) -> None:
        super()._clear()
        self.gate: Optional[Tensor] = None
        self.x: Optional[Tensor] = None
        self.params: Optional[Tensor] = None

    def _readers(self) -> list[Any]:
        m = self.mixer
        return [
            m.get_submodule("in_proj").register_forward_hook(self._on_in_proj),
            m.get_submodule("x_proj").register_forward_hook(self._on_x_proj),
        ]

    def _on_in_proj(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self.live():
            self.gate = output[..., output.shape[-1] // 2 :]

    def _on_x_proj(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self.live():
            self.x, self.params = args[0], output

    def _starts(self, served: Tensor) -> Any:
        if self.x is None or self.params is None or self.gate is None or self.x.shape[:2] != served.shape[:2]:
            yield "the mixer did not call in_proj and x_proj on this forward pass (a fused kernel)"
            return
        m, w = self.mixer, self.wide
        rank = m.dt_proj.in_features
        dt = F.softplus(F.linear(self.params[..., :rank].to(w), m.dt_proj.weight.to(w), m.dt_proj.bias.to(w)))
        for h0 in (self.h0, None) if self.h0 is not None else (None,):
            if h0 is None or h0.shape == (served.shape[0], *m.A_log.shape):
                yield dt, h0

    def _steps(self, dt: Tensor) -> tuple[Tensor, Tensor]:
        m, x, params = self.mixer, self.x, self.params
        assert x is not None and params is not None
        n = m.A_log.shape[1]
        b = params[..., -2 * n : -n].to(self.wide)
        decay = torch.exp(-torch.exp(m.A_log.to(self.wide))[None, None] * dt[..., None])
        return decay, dt[..., None] * b[:, :, None, :] * x.to(self.wide)[..., None]

    def _readout(self, states: Tensor) -> Tensor:
        assert self.params is not None
        return (states * self.params[..., -self.mixer.A_log.shape[1] :].to(self.wide)[:, :, None, :]).sum(-1)

    def _combine(self, ys: Tensor) -> Tensor:
        x, gate = self.x, self.gate
        assert x is not None and gate is not None
        return (ys + x.to(self.wide) * self.mixer.D.to(self.wide)) * self.mixer.act(gate.to(self.wide))

    def edit_reaches(self, base: Tensor) -> Tensor:
        assert self.gate is not None
        return base.float() + self.mixer.act(self.gate.float())


def _probe(model: Any, sites: list[ScanSite], edit: bool) -> dict[ScanSite, str]:
    """One forward pass with every site's points hooked (``edit``: ``hook_ssm_out`` plus one, checked against a plain
    hook on the child the scan's value goes into): the sites whose check failed, with why."""
    from lensadapters.adapters.generic.probe import PROBE_LENGTH

    weight = getattr(model.get_input_embeddings(), "weight", None)
    device = weight.device if isinstance(weight, Tensor) else torch.device("cpu")
    vocab = weight.shape[0] if isinstance(weight, Tensor) else 2
    ids = (torch.arange(2 * PROBE_LENGTH, device=device).reshape(2, PROBE_LENGTH) * 7 + 3) % vocab
    handles: list[Any] = []
    entries: list[tuple[HookPoint, Any]] = []
    seen: dict[ScanSite, tuple[Tensor, Optional[Tensor]]] = {}  # the input there, and what the edit should give
    for site in sites:
        site.problem = []
        handles += site.install()
        for name, point in site.by.items():
            fn = (lambda v, hook: v + 1.0) if edit and name == "hook_ssm_out" else (lambda v, hook: None)
            entries.append((point, point.add(fn)))
        if edit and "hook_ssm_out" in site.by:

            def plain(module: nn.Module, args: tuple, site: ScanSite = site) -> None:
                base = site.served
                seen[site] = (args[0], None if base is None else site.edit_reaches(base))

            handles.append(site.mixer.get_submodule(site.inject).register_forward_pre_hook(plain))
    failed: dict[ScanSite, str] = {}
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception as e:  # the model does not run so: no site is verified
        failed = {s: f"the probe forward pass raised {type(e).__name__}: {e}" for s in sites}
    finally:
        for handle in handles:
            handle.remove()
        for point, entry in entries:
            point.remove(entry)
    for site in sites:
        if site not in failed and site.problem:
            failed[site] = site.problem[0]
        elif site not in failed and edit and site in seen:
            y, expected = seen[site]
            if expected is None or not _close(y.float(), expected):
                failed[site] = f"an edit of hook_ssm_out does not reach {site.inject}'s input as the scan's form says"
        site.problem = site.served = None
    return failed


def serve_scan(hooked: Any, found: Any, sites: list, verifying: Any) -> list:
    """``sites`` and the scan sites of the recognised mixers of ``hooked``'s mixer-form layers, those the probe
    verified (the others' reasons in ``found.missing``)."""
    if hooked.hf_model in verifying:
        return sites
    made: list[tuple[int, str, ScanSite]] = []
    why_not: dict[str, list[int]] = {}
    for i, (layer, block) in enumerate(zip(hooked.block_modules, found.blocks)):
        if block.mixer is None or block.attn is None or block.mixer.internals == ():
            continue
        mixer = layer.get_submodule(block.attn)
        a_log = dict(mixer.named_parameters(recurse=False)).get("A_log")
        if a_log is None:
            continue
        form = _form(a_log)
        why = form.recognise(mixer)
        if why is not None:
            why_not.setdefault(why, []).append(i)
            continue
        made.append((i, block.attn, form.site(mixer, {})))
    if made:
        checked = _verify([s for _, _, s in _with_points(hooked, made)], hooked.hf_model)
        for i, _, site in made:
            why = checked.get(site)
            if why is not None:
                for point in site.points:
                    hooked.remove_point(point.name)
                why_not.setdefault(why, []).append(i)
            else:
                sites.append(site)
    if why_not:
        found.missing["selective-scan points (hook_dt, hook_ssm_state, hook_ssm_out)"] = "; ".join(
            f"{why} (layers {', '.join(map(str, layers))})" for why, layers in why_not.items()
        )
    return sites


class _Form:
    """A scan form: its recogniser and its site class."""

    def __init__(self, recognise: Any, site: type[ScanSite]) -> None:
        self.recognise, self.site = recognise, site


def _form(a_log: Tensor) -> _Form:
    """Mamba's form (``A_log`` ``[d_inner, d_state]``) or Mamba-2's per-head one (``[n_heads]``, :mod:`.scan_heads`)."""
    if a_log.dim() == 1:
        from lensadapters.adapters.generic import scan_heads

        return _Form(scan_heads.recognise, scan_heads.HeadScan)
    return _Form(recognise, MambaScan)


def _with_points(hooked: Any, made: list[tuple[int, str, ScanSite]]) -> list[tuple[int, str, ScanSite]]:
    for i, prefix, site in made:
        before = next(
            (
                n
                for n in (f"blocks.{i}.{prefix}.hook_out_proj_input", f"blocks.{i}.hook_attn_out")
                if n in hooked.hook_dict
            ),
            None,
        )
        site.by = {name: hooked.new_point(f"blocks.{i}.{prefix}.{name}", before=before) for name in SCAN_POINTS}
        site.points = tuple(site.by.values())
    return made


def _verify(sites: list[ScanSite], model: Any) -> dict[ScanSite, str]:
    """The value check on every site, then the edit check on those that passed."""
    failed = _probe(model, sites, edit=False)
    rest = [s for s in sites if s not in failed]
    failed.update(_probe(model, rest, edit=True) if rest else {})
    return failed
