"""The selective scan of a Mamba token mixer as points (issue #29 item 4), served on layers of the mixer form
(:mod:`.mixer`) whose token mixer is recognised by its parameters and verified by a probe forward pass, and on a token
mixer a layer runs beside its attention module (:mod:`.parallel`, ``hook_mixer_out``: described layers too).

* **Recognised**: a token mixer with parameters ``A_log`` ``[d_inner, d_state]`` and ``D`` ``[d_inner]`` of its own,
  linear children ``in_proj`` (``2 * d_inner`` outputs: the scan's input and the gate), ``x_proj`` (``dt_rank +
  2 * d_state``: the step's low-rank input, ``B`` and ``C``), ``dt_proj`` (``dt_rank -> d_inner``, with its bias),
  ``out_proj`` (``d_inner`` inputs) and an activation ``act``: Mamba's selective scan (the published equations:
  ``dt = softplus(dt_proj(dt_in))``, ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t`` with ``A = -exp(A_log)``,
  ``y_t = h_t . C_t``, output ``(y_t + D x_t) * act(gate_t)``). Mamba-2's per-head form: :mod:`.scan_heads`.
* **Normalized parts**: where ``x_proj``'s three parts (``dt_in``, ``B``, ``C``) are normalized before the scan, the
  mixer declares it by children ``dt_layernorm``, ``b_layernorm`` and ``c_layernorm`` (one per part, any module:
  the scan reads each one's output, what the model goes on with; Jamba, Falcon-Mamba on transformers 5), or by a
  float ``rms_eps`` of its own or ``mixer_rms_eps`` in its ``config`` without such children: a weightless RMS
  normalization ``v / sqrt(mean(v^2) + eps)`` of each part, computed in float32 and rounded to the part's dtype as
  transformers does (Falcon-Mamba on transformers 4). The probe verifies the declaration as it does the rest.
* **Points** (relative to the layer, ``<mixer>`` the mixer child's name): ``<mixer>.hook_dt`` ``[b, p, d_inner]``
  the step sizes, ``<mixer>.hook_ssm_state`` ``[b, p, d_inner, d_state]`` the state after every position,
  ``<mixer>.hook_ssm_out`` ``[b, p, d_inner]`` the scan's output before the ``D`` skip and the gate, and the scan's
  inputs: ``<mixer>.hook_gate`` ``[b, p, d_inner]`` the gate (in_proj's output's second half, as the model gates
  with it) and ``<mixer>.hook_conv`` ``[b, p, d_inner]`` the causal convolution's activated output (masked where the
  model masks it): x_proj's input, which the model's scan reads as its input ``x`` too (transformers 4.x calls
  ``conv1d`` and ``act``, 5.x a functional convolution: x_proj's input is it either way). Only while one of them is
  hooked, an explicit scan (a loop over positions, in float32) runs, from the values the model gave ``x_proj`` (its
  input ``x`` and its output) and ``in_proj`` (the gate); otherwise nothing runs.
* **Checked on every hooked call**: the unedited explicit scan must give the model's own input of ``out_proj`` (and,
  with a cache, the final state the cache holds), else the call raises naming the points. The wrap-time probe runs
  this check on every recognised layer (and an edit of ``hook_ssm_out``, against a plain hook on ``out_proj``, and
  one of ``hook_gate`` and ``hook_conv`` with the check made under it, x_proj seen given the edited value); a layer
  that fails gets none of the five points, and the warning says why.
* **Edits**: an edited ``hook_dt`` is the step size of the whole scan (its state and output). An edited
  ``hook_ssm_state``: at every position ``t`` and state element where the returned value differs from the value the
  hook was shown, the state at ``t`` *is* the returned value: the output at ``t`` reads it and the state at ``t + 1``
  is carried on from it (``h_{t+1} = exp(dt A) h'_t + dt B x``); elsewhere the state is what the scan computes from
  the (edited) state before it. Replacing every position's state by another run's therefore gives exactly those
  states. An edited ``hook_ssm_out`` is the scan's output (the ``D`` skip and the gate are applied to it). An edited
  ``hook_gate`` is the gate the scan's output is gated with. An edited ``hook_conv`` is x_proj's input (a pre-hook
  gives it: the model computes dt, B and C from it, through the parts' norms where it has them) and the scan's input
  (its ``D`` skip too): the model's own scan read the unedited value, so the check is made with that one and the
  edited scan goes into ``out_proj``; the cache's convolution state (the convolution's inputs) is not changed. With a
  cache, the cache then holds the last (edited) state, and the next call with that cache shows ``hook_ssm_state``
  the states carried on from the last one it showed (not from the edited one), so cached generation shows and
  edits what one full pass would.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lensadapters.adapters.generic import scan_heads
from lensadapters.adapters.generic.scan_site import INPUT_POINTS, SCAN_POINTS, ScanMismatch, ScanSite, _close
from lensadapters.hooks.hook_point import HookPoint

Tensor = torch.Tensor
PARTS = ("dt", "b", "c")  # x_proj's output: the step's low-rank input, B and C
__all__ = ["SCAN_POINTS", "MambaScan", "ScanMismatch", "recognise", "serve_scan"]


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
    found = [isinstance(getattr(mixer, f"{part}_layernorm", None), nn.Module) for part in PARTS]
    if any(found) and not all(found):
        return "some of x_proj's parts have a norm child (dt_layernorm, b_layernorm, c_layernorm) and others none"
    return None


def normalization(mixer: nn.Module) -> Optional[Any]:
    """How a recognised mixer normalizes x_proj's parts (the module docstring): ``"children"``, the weightless RMS's
    eps (a float), or ``None`` (not normalized)."""
    if all(isinstance(getattr(mixer, f"{part}_layernorm", None), nn.Module) for part in PARTS):
        return "children"
    for eps in (getattr(mixer, "rms_eps", None), getattr(getattr(mixer, "config", None), "mixer_rms_eps", None)):
        if isinstance(eps, float) and not isinstance(eps, bool):
            return eps
    return None


class MambaScan(ScanSite):
    """Mamba's selective scan (the module docstring): read from ``in_proj``'s output (the gate) and ``x_proj``'s
    input and output, put in as ``out_proj``'s input."""

    #: points that fire (and are edited) at ``x_proj``'s input, so before the mixer's own ``hook_x_proj`` point
    fire_before = {"hook_gate": "hook_x_proj", "hook_conv": "hook_x_proj"}

    def _clear(self) -> None:
        super()._clear()
        self.gate: Optional[Tensor] = None  # the gate the combine reads (the model's, until the check is done)
        self.x: Optional[Tensor] = None  # the scan's input the scan reads (the model's, until the check is done)
        self.edited: dict[str, Tensor] = {}  # hook_gate's and hook_conv's edits, made at x_proj's input
        self.params: Optional[Tensor] = None
        self.parts: dict[str, Tensor] = {}  # dt_in, B and C as the scan reads them (normalized where the mixer does)

    def _readers(self) -> list[Any]:
        m = self.mixer
        handles = [
            m.get_submodule("in_proj").register_forward_hook(self._on_in_proj),
            m.get_submodule("x_proj").register_forward_pre_hook(self._on_x_proj_input),
            m.get_submodule("x_proj").register_forward_hook(self._on_x_proj),
        ]
        if normalization(m) == "children":
            handles += [
                m.get_submodule(f"{part}_layernorm").register_forward_hook(
                    lambda module, args, output, part=part: self._on_norm(part, output)
                )
                for part in PARTS
            ]
        return handles

    def _on_norm(self, part: str, output: Tensor) -> None:
        if self.live():
            self.parts[part] = output

    def _on_in_proj(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self.live():
            self.gate = output[..., output.shape[-1] // 2 :]

    def _on_x_proj_input(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        """``hook_gate`` (the gate, known from in_proj's output) then ``hook_conv`` (x_proj's input: the activated
        convolution, masked, the scan's input too): an edited ``hook_conv`` is x_proj's input, so the model computes
        dt, B and C from it; the scan reads it as its input after the check (the model's scan read the unedited
        one)."""
        if not self.live() or not args or not isinstance(args[0], Tensor):
            return None
        self.x = args[0]
        if "hook_gate" in self.by and self.gate is not None:
            gate, changed = self.by["hook_gate"].apply(self.gate, protect=True)
            if changed:
                self.edited["gate"] = gate
        if "hook_conv" in self.by:
            x, changed = self.by["hook_conv"].apply(args[0], protect=True)
            if changed:
                self.edited["x"] = x
                return (x, *args[1:])
        return None

    def edit_targets(self) -> dict[str, tuple[str, int, str]]:
        return {"hook_conv": ("x_proj", 0, "input")}

    def _edit_inputs(self) -> bool:
        if "gate" in self.edited:
            self.gate = self.edited["gate"]
        if "x" in self.edited:
            self.x = self.edited["x"]
        return bool(self.edited)

    def _on_x_proj(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self.live():
            self.params = output
            if self.x is None:  # x_proj called with no positional input: the check fails on it
                self.x = args[0] if args else None
            norm, n = normalization(self.mixer), self.mixer.A_log.shape[1]
            if norm != "children":
                for part, v in zip(PARTS, (output[..., : -2 * n], output[..., -2 * n : -n], output[..., -n:])):
                    self.parts[part] = v if norm is None else _rms(v, float(norm))

    def _starts(self, served: Tensor) -> Any:
        x, gate, parts = self.x, self.gate, self.parts
        if x is None or gate is None or x.shape[:2] != served.shape[:2] or len(parts) != 3:
            yield "the mixer did not call in_proj, x_proj (and its parts' norms) on this forward pass (a fused kernel)"
            return
        if any(v.shape[:2] != x.shape[:2] for v in parts.values()):
            yield "the norms of x_proj's parts did not normalize this call's positions"
            return
        m, w = self.mixer, self.wide
        dt = F.softplus(F.linear(parts["dt"].to(w), m.dt_proj.weight.to(w), m.dt_proj.bias.to(w)))
        for h0 in (self.h0, None) if self.h0 is not None else (None,):
            if h0 is None or h0.shape == (served.shape[0], *m.A_log.shape):
                yield dt, h0

    def _steps(self, dt: Tensor) -> tuple[Tensor, Tensor]:
        m, x = self.mixer, self.x
        assert x is not None
        b = self.parts["b"].to(self.wide)
        decay = torch.exp(-torch.exp(m.A_log.to(self.wide))[None, None] * dt[..., None])
        return decay, dt[..., None] * b[:, :, None, :] * x.to(self.wide)[..., None]

    def _readout(self, states: Tensor) -> Tensor:
        return (states * self.parts["c"].to(self.wide)[:, :, None, :]).sum(-1)

    def _combine(self, ys: Tensor) -> Tensor:
        x, gate = self.x, self.gate
        assert x is not None and gate is not None
        return (ys + x.to(self.wide) * self.mixer.D.to(self.wide)) * self.mixer.act(gate.to(self.wide))

    def edit_reaches(self, base: Tensor) -> Tensor:
        assert self.gate is not None
        return base.float() + self.mixer.act(self.gate.float())


def _rms(v: Tensor, eps: float) -> Tensor:
    """The weightless RMS normalization of the last dimension, in float32 (as transformers does, whatever ``v``'s
    dtype) and rounded to ``v``'s dtype."""
    wide = v.to(torch.float32)
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(v.dtype)


def _probe(model: Any, sites: list[ScanSite], edit: Optional[str]) -> dict[ScanSite, str]:
    """One forward pass with every site's points hooked: the sites whose check failed, with why. ``edit``:
    ``"out"``, ``hook_ssm_out`` plus one, checked against a plain hook on the child the scan's value goes into;
    ``"inputs"``, ``hook_gate`` and ``hook_conv`` plus one, the check made on the model's own values while they are
    edited, each edit checked where it goes on as a child's input (:meth:`ScanSite.edit_targets`: a plain forward
    hook on that child sees what it was given)."""
    from lensadapters.adapters.generic.probe import PROBE_LENGTH

    weight = getattr(model.get_input_embeddings(), "weight", None)
    device = weight.device if isinstance(weight, Tensor) else torch.device("cpu")
    vocab = weight.shape[0] if isinstance(weight, Tensor) else 2
    ids = (torch.arange(2 * PROBE_LENGTH, device=device).reshape(2, PROBE_LENGTH) * 7 + 3) % vocab
    handles: list[Any] = []
    entries: list[tuple[HookPoint, Any]] = []
    seen: dict[ScanSite, tuple[Tensor, Optional[Tensor]]] = {}  # the input there, and what the edit should give
    shown: dict[tuple[ScanSite, str], Tensor] = {}  # an input point's value (before the probe's edit)
    given: dict[tuple[ScanSite, str], Tensor] = {}  # what the child its edit goes into was given there
    edited = {"out": ("hook_ssm_out",), "inputs": INPUT_POINTS}.get(edit or "", ())

    def plus_one(site: ScanSite, name: str) -> Any:
        def fn(v: Tensor, hook: Any) -> Tensor:
            shown.setdefault((site, name), v.detach().clone())
            return v + 1.0

        return fn

    for site in sites:
        site.problem = []
        handles += site.install()
        for name, point in site.by.items():
            fn = plus_one(site, name) if name in edited else (lambda v, hook: None)
            entries.append((point, point.add(fn)))
        if edit == "out" and "hook_ssm_out" in site.by:

            def plain(module: nn.Module, args: tuple, site: ScanSite = site) -> None:
                base = site.served
                seen[site] = (args[0], None if base is None else site.edit_reaches(base))

            handles.append(site.mixer.get_submodule(site.inject).register_forward_pre_hook(plain))
        for name, (child, index, key) in site.edit_targets().items() if edit == "inputs" else ():
            if name not in site.by:
                continue

            def got(module: nn.Module, args: tuple, kwargs: dict, output: Any, at: Any = (site, name, index, key)):
                value = args[at[2]] if len(args) > at[2] else kwargs.get(at[3])
                if isinstance(value, Tensor):
                    given.setdefault((at[0], at[1]), value.detach().clone())

            handles.append(site.mixer.get_submodule(child).register_forward_hook(got, with_kwargs=True))
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
        elif site not in failed and edit == "out" and site in seen:
            y, expected = seen[site]
            # to the rounding of the model's dtype (the model gates the edited value in it: bfloat16's, say)
            if expected is None or not _close(y.float(), expected.to(y.dtype)):
                failed[site] = f"an edit of hook_ssm_out does not reach {site.inject}'s input as the scan's form says"
        elif site not in failed and edit == "inputs":
            for name, (child, _, _) in site.edit_targets().items():
                if name not in site.by:
                    continue
                before, after = shown.get((site, name)), given.get((site, name))
                if before is None or after is None or after.shape != before.shape or not torch.equal(after, before + 1):
                    failed[site] = f"an edit of {name} does not reach {child}'s input as the scan's form says"
                    break
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
        for path in _token_mixers(block):
            mixer = layer.get_submodule(path)
            a_log = dict(mixer.named_parameters(recurse=False)).get("A_log")
            if a_log is None:
                continue
            form = _form(a_log)
            why = form.recognise(mixer)
            if why is not None:
                why_not.setdefault(why, []).append(i)
                continue
            made.append((i, path, form.site(mixer, {})))
    if made:
        checked = _verify([s for _, _, s in _with_points(hooked, made, found.blocks)], hooked.hf_model)
        for i, _, site in made:
            why = checked.get(site)
            if why is not None:
                for point in site.points:
                    hooked.remove_point(point.name)
                why_not.setdefault(why, []).append(i)
            else:
                sites.append(site)
    if why_not:
        key = "selective-scan points (hook_gate, hook_conv, hook_dt, hook_ssm_state, hook_ssm_out)"
        found.missing[key] = "; ".join(
            f"{why} (layers {', '.join(map(str, layers))})" for why, layers in why_not.items()
        )
    return sites


def _token_mixers(block: Any) -> list[str]:
    """The paths (relative to the layer) of a layer's token mixers whose scan may be served: the mixer form's token
    mixer, whose output is ``hook_attn_out`` (where its internals are served: not softmax attention), and the token
    mixer a layer runs beside its attention module (:mod:`.parallel`: ``hook_mixer_out``), described layer or not."""
    found = []
    if block.mixer is not None and block.attn is not None and block.mixer.internals != ():
        found.append(block.attn)
    if block.beside is not None and block.beside not in found:
        found.append(block.beside)
    return found


class _Form:
    """A scan form: its recogniser and its site's maker (``site(mixer, points)``)."""

    def __init__(self, recognise: Any, site: Callable[[nn.Module, dict], ScanSite]) -> None:
        self.recognise, self.site = recognise, site


def _form(a_log: Tensor) -> _Form:
    """Mamba's form (``A_log`` ``[d_inner, d_state]``) or Mamba-2's per-head one (``[n_heads]``, :mod:`.scan_heads`)."""
    if a_log.dim() == 1:
        return _Form(scan_heads.recognise, scan_heads.site)
    return _Form(recognise, MambaScan)


def _with_points(hooked: Any, made: list[tuple[int, str, ScanSite]], blocks: Any) -> list[tuple[int, str, ScanSite]]:
    for i, prefix, site in made:
        output = "hook_mixer_out" if prefix == blocks[i].beside else "hook_attn_out"  # the mixer's output's point
        before = next(
            (n for n in (f"blocks.{i}.{prefix}.hook_out_proj_input", f"blocks.{i}.{output}") if n in hooked.hook_dict),
            None,
        )
        early = getattr(site, "fire_before", {})  # a point firing before one of the mixer's module points
        site.by = {}
        for name in SCAN_POINTS:
            ahead = f"blocks.{i}.{prefix}.{early[name]}" if name in early else None
            at = ahead if ahead in hooked.hook_dict else before
            site.by[name] = hooked.new_point(f"blocks.{i}.{prefix}.{name}", before=at)
        site.points = tuple(site.by.values())
    return made


def _verify(sites: list[ScanSite], model: Any) -> dict[ScanSite, str]:
    """The value check on every site, then the edit checks (``hook_ssm_out``'s, then the inputs') on those that
    passed."""
    failed = _probe(model, sites, edit=None)
    for edit in ("out", "inputs"):
        rest = [s for s in sites if s not in failed]
        failed.update(_probe(model, rest, edit=edit) if rest else {})
    return failed
