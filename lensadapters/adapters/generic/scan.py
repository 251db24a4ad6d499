"""The selective scan of a Mamba token mixer as points (issue #29 item 4), served on layers of the mixer form
(:mod:`.mixer`) whose token mixer is recognised by its parameters and verified by a probe forward pass.

* **Recognised**: a token mixer with parameters ``A_log`` ``[d_inner, d_state]`` and ``D`` ``[d_inner]`` of its own,
  linear children ``in_proj`` (``2 * d_inner`` outputs: the scan's input and the gate), ``x_proj`` (``dt_rank +
  2 * d_state``: the step's low-rank input, ``B`` and ``C``), ``dt_proj`` (``dt_rank -> d_inner``, with its bias),
  ``out_proj`` (``d_inner`` inputs) and an activation ``act``: Mamba's selective scan (the published equations:
  ``dt = softplus(dt_proj(dt_in))``, ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t`` with ``A = -exp(A_log)``,
  ``y_t = h_t . C_t``, output ``(y_t + D x_t) * act(gate_t)``). Mamba-2's per-head form is not recognised (yet).
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
  cache, the cache then holds the last (edited) state, so cached generation continues from it as one full pass would.
"""

from __future__ import annotations

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
        return "no parameters A_log [d_inner, d_state] and D [d_inner] of its own (Mamba-2's per-head form is not read)"
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


def _cache_state(cache: Any, index: Any) -> Optional[Tensor]:
    """The recurrent state transformers' cache holds for layer ``index`` (``None`` where there is none)."""
    if cache is None or not isinstance(index, int):
        return None
    get = getattr(cache, "get_recurrent_state", None)
    if callable(get):
        try:
            found = get(index, state_idx=0)
        except Exception:  # another cache's signature
            found = None
        if isinstance(found, Tensor):
            return found
    states = getattr(cache, "ssm_states", None)
    try:
        found = states[index] if states is not None else None
    except Exception:  # not indexable so
        return None
    return found if isinstance(found, Tensor) else None


def _close(a: Tensor, b: Tensor) -> bool:
    from lensadapters.adapters.generic.probe import _close as close

    return close(a, b)


class ScanSite(Site):
    """The three scan points of one recognised mixer (``points``: by name in :data:`SCAN_POINTS`, those served)."""

    def __init__(self, mixer: nn.Module, points: dict[str, HookPoint]) -> None:
        self.mixer: Any = mixer  # a recognised mixer: its parameters and children are those recognise() read
        self.by = points
        self.points = tuple(points.values())
        self.problem: Optional[list[str]] = None  # the wrap-time probe: a mismatch is recorded here, not raised
        self.served: Optional[Tensor] = None  # the wrap-time probe: the model's own input of out_proj
        self.wide = torch.float32
        self.error: Optional[float] = None  # the last hooked call's largest difference from the model's value
        self._clear()

    def _clear(self) -> None:
        self.gate: Optional[Tensor] = None
        self.x: Optional[Tensor] = None
        self.params: Optional[Tensor] = None
        self.cache: Any = None
        self.h0: Optional[Tensor] = None
        self.final: Optional[tuple[Tensor, Tensor, bool]] = None  # (unedited, served, edited)

    def live(self) -> bool:
        return any(p.has_live_hooks() for p in self.points)

    def install(self) -> list[Any]:
        m = self.mixer
        return [
            m.register_forward_pre_hook(self._enter, with_kwargs=True),
            m.get_submodule("in_proj").register_forward_hook(self._on_in_proj),
            m.get_submodule("x_proj").register_forward_hook(self._on_x_proj),
            m.get_submodule("out_proj").register_forward_pre_hook(self._on_out_proj, with_kwargs=True, prepend=True),
            m.register_forward_hook(self._exit, with_kwargs=True),
        ]

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._clear()
        if not self.live():
            return
        self.cache = next((kwargs[k] for k in ("cache", "cache_params") if kwargs.get(k) is not None), None)
        before = _cache_state(self.cache, getattr(module, "layer_idx", None))
        self.h0 = None if before is None else before.detach().clone()

    def _on_in_proj(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self.live():
            self.gate = output[..., output.shape[-1] // 2 :]

    def _on_x_proj(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self.live():
            self.x, self.params = args[0], output

    def _fail(self, why: str) -> None:
        names = ", ".join(p.name for p in self.points)
        if self.problem is not None:
            self.problem.append(why)
            return
        raise ScanMismatch(
            f"{names}: {why}, so these points would serve a wrong value. Remove their hooks for this call (the "
            f"model itself runs as it is)"
        )

    def _scan(self, dt: Tensor, edit: Optional[tuple[Tensor, Tensor]] = None, h0: Optional[Tensor] = None) -> Tensor:
        """The states after every position ``[b, p, d_inner, d_state]`` (``edit``: states and where they replace)."""
        m, x, params = self.mixer, self.x, self.params
        assert x is not None and params is not None
        n = m.A_log.shape[1]
        b = params[..., -2 * n : -n].to(self.wide)
        a = -torch.exp(m.A_log.to(self.wide))
        decay = torch.exp(a[None, None] * dt[..., None])
        drive = dt[..., None] * b[:, :, None, :] * x.to(self.wide)[..., None]
        h = torch.zeros_like(decay[:, 0]) if h0 is None else h0.to(self.wide)
        states = []
        for t in range(x.shape[1]):
            h = decay[:, t] * h + drive[:, t]
            if edit is not None:
                h = torch.where(edit[1][:, t], edit[0][:, t].to(self.wide), h)
            states.append(h)
        return torch.stack(states, 1)

    def _output(self, states: Tensor, ys: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        m, x, gate, params = self.mixer, self.x, self.gate, self.params
        assert x is not None and gate is not None and params is not None
        c = params[..., -m.A_log.shape[1] :].to(self.wide)
        if ys is None:
            ys = (states * c[:, :, None, :]).sum(-1)
        return ys, (ys + x.to(self.wide) * m.D.to(self.wide)) * m.act(gate.to(self.wide))

    def _on_out_proj(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not self.live():
            return None
        served = first_input(args, kwargs)
        if self.problem is not None:
            self.served = served
        if self.x is None or self.params is None or self.gate is None or self.x.shape[:2] != served.shape[:2]:
            return self._fail("the mixer did not call in_proj and x_proj on this forward pass (a fused kernel)")
        m = self.mixer
        self.wide = torch.promote_types(served.dtype, torch.float32)  # float32 as HF's slow path, or wider
        rank = m.dt_proj.in_features
        dt0 = F.softplus(
            F.linear(
                self.params[..., :rank].to(self.wide), m.dt_proj.weight.to(self.wide), m.dt_proj.bias.to(self.wide)
            )
        )
        h0s = [h for h in (self.h0, None) if h is None or h.shape == (served.shape[0], *m.A_log.shape)]
        for h0 in h0s:
            states0 = self._scan(dt0, h0=h0)
            y0 = self._output(states0)[1].to(served.dtype)
            self.error = float((y0.double() - served.double()).abs().max())
            if _close(y0, served):
                break
        else:
            return self._fail("the explicit selective scan does not reproduce the model's input of out_proj")
        dt, edited = dt0, False
        if "hook_dt" in self.by:
            dt, edited = self.by["hook_dt"].apply(dt0)
        states = self._scan(dt, h0=h0) if edited else states0
        if "hook_ssm_state" in self.by:
            shown, changed = self.by["hook_ssm_state"].apply(states, protect=True)
            if changed:
                states, edited = self._scan(dt, (shown, shown != states), h0), True
        ys, y = self._output(states)
        if "hook_ssm_out" in self.by:
            ys_e, changed = self.by["hook_ssm_out"].apply(ys)
            if changed:
                y, edited = self._output(states, ys_e)[1], True
        self.final = (states0[:, -1], states[:, -1], edited)
        return replace_first_input(args, kwargs, y.to(served.dtype)) if edited else None

    def _exit(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        final, cache = self.final, self.cache
        self._clear()
        if final is None or cache is None:
            return
        held = _cache_state(cache, getattr(module, "layer_idx", None))
        if held is None or held.shape != final[0].shape or not _close(final[0].to(held.dtype), held):
            if final[2]:
                self._fail("the model's cache does not hold the scan's last state where it can be replaced")
            return
        if final[2]:
            with torch.no_grad():
                held.copy_(final[1].detach().to(held.dtype))

    def keep(self, failed: set[str]) -> bool:
        self.by = {k: p for k, p in self.by.items() if p.name not in failed}
        self.points = tuple(self.by.values())
        return bool(self.points)


def _probe(model: Any, sites: list[ScanSite], edit: bool) -> dict[ScanSite, str]:
    """One forward pass with every site's points hooked (``edit``: ``hook_ssm_out`` plus one, checked against a plain
    hook on ``out_proj``): the sites whose check failed, with why."""
    from lensadapters.adapters.generic.probe import PROBE_LENGTH

    weight = getattr(model.get_input_embeddings(), "weight", None)
    device = weight.device if isinstance(weight, Tensor) else torch.device("cpu")
    vocab = weight.shape[0] if isinstance(weight, Tensor) else 2
    ids = (torch.arange(2 * PROBE_LENGTH, device=device).reshape(2, PROBE_LENGTH) * 7 + 3) % vocab
    handles: list[Any] = []
    entries: list[tuple[HookPoint, Any]] = []
    seen: dict[ScanSite, tuple[Tensor, Optional[Tensor]]] = {}
    for site in sites:
        site.problem = []
        handles += site.install()
        for name, point in site.by.items():
            fn = (lambda v, hook: v + 1.0) if edit and name == "hook_ssm_out" else (lambda v, hook: None)
            entries.append((point, point.add(fn)))
        if edit and "hook_ssm_out" in site.by:

            def plain(module: nn.Module, args: tuple, site: ScanSite = site) -> None:
                seen[site] = (args[0], site.gate)

            handles.append(site.mixer.get_submodule("out_proj").register_forward_pre_hook(plain))
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
            y, gate = seen[site]
            base = site.served
            if gate is None or base is None or not _close(y.float(), base.float() + site.mixer.act(gate.float())):
                failed[site] = "an edit of hook_ssm_out does not reach out_proj's input as the gate scales it"
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
        if not any(n == "A_log" for n, _ in mixer.named_parameters(recurse=False)):
            continue
        why = recognise(mixer)
        if why is not None:
            why_not.setdefault(why, []).append(i)
            continue
        made.append((i, block.attn, ScanSite(mixer, {})))
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
