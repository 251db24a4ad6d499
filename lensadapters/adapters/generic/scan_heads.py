"""Mamba-2's per-head selective scan as points (issue #29), the second form :mod:`.scan` serves (its edits, checks,
probe and cache handling are those of :class:`.scan_site.ScanSite`; this module says how the form is read and run).

* **Recognised**: a token mixer with parameters ``A_log``, ``D`` and ``dt_bias`` ``[n_heads]`` of its own (one
  scalar per head), integer attributes ``n_groups`` and ``ssm_state_size``, a linear child ``in_proj`` whose
  outputs are ``[2 d_mlp parts | gate z (d_inner) | xBC (conv_dim) | dt (n_heads)]``, a depthwise ``conv1d`` over
  the ``conv_dim = d_inner + 2 n_groups d_state`` channels of xBC, an activation ``act``, a gated norm child
  ``norm`` (or none, below) and a linear ``out_proj`` (``d_inner`` inputs): transformers' ``Mamba2Mixer`` and the
  mixers written as it (Zamba2, NemotronH, Bamba, GraniteMoeHybrid, Falcon-H1's). Its equations, with ``x``
  ``[b, p, heads, head_dim]`` and ``B``,
  ``C`` ``[b, p, n_groups, d_state]`` (the causal convolution's activated output, zero at masked positions; head
  ``h`` reads group ``h // (heads / n_groups)``): ``dt = clamp(softplus(dt + dt_bias), time_step_limit)`` (or
  ``time_step_min`` as the lower bound alone: Zamba2 in transformers 4.x; the check finds which),
  ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t (x) B_t`` with ``A = -exp(A_log)`` per head, ``y_t = h_t . C_t``, and
  ``norm(y_t + D x_t, z_t)`` goes on to ``out_proj``.
* **A per-channel factor** of in_proj's output: where the mixer has one tensor of its own (a parameter or buffer,
  not ``A_log``, ``D``, ``dt_bias``) of one element per output of ``in_proj`` (``[1, ..., 1, out_features]``), the
  scan reads in_proj's output times it (read live on every call, multiplied as the model multiplies it: Falcon-H1's
  ``mup_vector``, its config's ``ssm_multipliers``); two such tensors: not recognised (which one is unknown). A
  mixer that has one and does not multiply by it fails the probe's check.
* **No gated norm** (no child ``norm``, or one with no parameters of its own: an identity the mixer does not call):
  the mixer gates the scan itself, ``(y_t + D x_t) * act(z_t)`` goes into ``out_proj`` (:class:`GatedHeadScan`:
  Falcon-H1 without ``mamba_rms_norm``); the checks and edits are the same, at out_proj's input.
* **Points**: ``<mixer>.hook_dt`` ``[b, p, n_heads]``, ``<mixer>.hook_ssm_state`` ``[b, p, n_heads, head_dim,
  d_state]`` the state after every position, ``<mixer>.hook_ssm_out`` ``[b, p, n_heads, head_dim]`` the scan's
  output before the ``D`` skip and the gated norm (per head, as the state; flattened it is the norm's input
  layout), and the scan's inputs: ``<mixer>.hook_conv`` ``[b, p, conv_dim]`` the causal convolution's activated
  output, x, B and C as the scan reads them (zero at masked positions where the model masks them), in the model's
  dtype, and ``<mixer>.hook_gate`` ``[b, p, d_inner]`` the gate z as the gated norm is given it (its second input,
  checked to be in_proj's scaled gate part on every hooked call) or as the mixer gates with it (no gated norm). An
  edited ``hook_conv`` is the scan's x, B and C (nothing else reads them; the cache's convolution state, the
  convolution's inputs, is not changed); an edited ``hook_gate`` is the gated norm's second input (the norm computes
  with it; the scan's value goes on as the model's own), or the gate of ``(y + D x) * act(z)``. They read only module
  outputs of the unmodified model: ``in_proj``'s output (the gate, xBC, dt), the
  output of ``act`` where the mixer calls it on the convolution (transformers 4.x), else the convolution recomputed
  from ``conv1d``'s live weights (with the cache's convolution state before a cached step), and the cache's
  states; the scan's value goes in as ``norm``'s first input. Edits work as :mod:`.scan` says.
* **Checked on every hooked call**: the unedited explicit scan (float32, or wider; the convolution and the step
  sizes in the model's dtype, as the model computes them) must give the model's own input of ``norm`` and, with
  a cache, the final state the cache holds (to the rounding of the model's dtype where it is coarser), else the
  call raises naming the points; the probe checks this, an edit of ``hook_ssm_out`` and one of ``hook_gate`` and
  ``hook_conv`` (the gated norm seen given the edited gate) on every recognised layer at wrap time. A mixer that
  computes otherwise (a fused training kernel, a per-channel tensor it does not multiply by) fails it or is not
  recognised, and gets none of the points. Served on the mixer form's token mixer (``hook_attn_out``) and on a token
  mixer a layer runs beside its attention (``hook_mixer_out``, :mod:`.parallel`; a described layer's too).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lensadapters.adapters.generic.scan_site import ScanSite, _close, cache_tensor
from lensadapters.hooks.sites import replace_first_input

Tensor = torch.Tensor


def _sizes(mixer: Any) -> Optional[tuple[int, int, int, int, int]]:
    """``(d_mlp, d_inner, conv_dim, n_groups, d_state)`` read from the children and attributes, or ``None``."""
    groups, state = getattr(mixer, "n_groups", None), getattr(mixer, "ssm_state_size", None)
    i, c, o = (getattr(mixer, n, None) for n in ("in_proj", "conv1d", "out_proj"))
    if not (isinstance(groups, int) and isinstance(state, int) and groups > 0 and state > 0):
        return None
    if not (isinstance(i, nn.Linear) and isinstance(c, nn.Conv1d) and isinstance(o, nn.Linear)):
        return None
    heads, inner, conv = mixer.A_log.shape[0], o.in_features, c.in_channels
    rest = i.out_features - inner - conv - heads
    depthwise = c.groups == conv == c.out_channels and c.weight.shape[1] == 1
    if rest < 0 or rest % 2 or not depthwise or conv != inner + 2 * groups * state:
        return None
    if inner % heads or heads % groups:
        return None
    return rest // 2, inner, conv, groups, state


HEAD_PARAMETERS = ("A_log", "D", "dt_bias")


def recognise(mixer: nn.Module) -> Optional[str]:
    """``None`` where ``mixer`` is the per-head selective scan the module docstring describes, else why not."""
    own = dict(mixer.named_parameters(recurse=False))
    heads = [own.get(n) for n in HEAD_PARAMETERS]
    if any(p is None or p.dim() != 1 for p in heads) or len({p.shape[0] for p in heads if p is not None}) != 1:
        return "no parameters A_log, D and dt_bias [n_heads] of its own"
    if not callable(getattr(mixer, "act", None)):
        return "no activation act"
    if _sizes(mixer) is None:
        return "the children's shapes are not those of Mamba-2's per-head selective scan"
    if len(_factors(mixer)) > 1:
        return "several tensors of its own have one element per output of in_proj: which one scales it is unknown"
    return None


def _factors(mixer: nn.Module) -> list[Tensor]:
    """The mixer's own parameters and buffers (not ``A_log``, ``D``, ``dt_bias``) with one element per output of
    ``in_proj``, shaped ``[1, ..., 1, out_features]``: a per-channel factor of in_proj's output."""
    proj = getattr(mixer, "in_proj", None)
    if not isinstance(proj, nn.Linear):
        return []
    own = [*mixer.named_parameters(recurse=False), *mixer.named_buffers(recurse=False)]
    return [
        t
        for name, t in own
        if name not in HEAD_PARAMETERS
        and isinstance(t, Tensor)
        and t.dim() >= 1
        and t.shape[-1] == proj.out_features
        and t.numel() == proj.out_features
    ]


def factor(mixer: nn.Module) -> Optional[Tensor]:
    """The per-channel factor the mixer multiplies in_proj's output by before the scan (:func:`_factors`, read live
    on every call), ``None`` where it has none."""
    found = _factors(mixer)
    return found[0] if len(found) == 1 else None


def gated_at_norm(mixer: nn.Module) -> bool:
    """Whether the scan's value goes into a gated norm child ``norm`` (one with parameters of its own), else the
    mixer gates it, ``value * act(gate)``, and gives it to ``out_proj`` (no norm child, or one without parameters:
    an identity it does not call)."""
    norm = getattr(mixer, "norm", None)
    return isinstance(norm, nn.Module) and any(True for _ in norm.parameters())


def site(mixer: nn.Module, points: dict) -> "HeadScan":
    """The scan site of a recognised mixer: :class:`HeadScan` (into the gated norm) or :class:`GatedHeadScan`."""
    return HeadScan(mixer, points) if gated_at_norm(mixer) else GatedHeadScan(mixer, points)


def _positions(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` with a position axis (a cached step's projections may have none: ``[b, features]``)."""
    return t[:, None] if t is not None and t.dim() == 2 else t


def _limits(mixer: Any) -> list[tuple[float, float]]:
    """The step sizes' bounds the mixer may clamp to, the likeliest first: ``time_step_limit``, ``time_step_min``
    as a lower bound alone (Zamba2 in transformers 4.x), none."""
    found: list[tuple[float, float]] = []
    limit, low = getattr(mixer, "time_step_limit", None), getattr(mixer, "time_step_min", None)
    if isinstance(limit, (tuple, list)) and len(limit) == 2:
        found.append((float(limit[0]), float(limit[1])))
    if isinstance(low, (int, float)):
        found.append((float(low), float("inf")))
    return [b for i, b in enumerate(found + [(0.0, float("inf"))]) if b not in found[:i]]


class HeadScan(ScanSite):
    """Mamba-2's scan (the module docstring): read from ``in_proj``'s output, put in as ``norm``'s input."""

    inject = "norm"
    gated_here = False  # the gated norm gates the scan's value: an edited gate is the norm's second input

    def _clear(self) -> None:
        super()._clear()
        self.proj: Optional[Tensor] = None
        self.activated: Optional[Tensor] = None
        self.conv0: Optional[Tensor] = None
        self.x: Optional[Tensor] = None
        self.b: Optional[Tensor] = None
        self.c: Optional[Tensor] = None
        self.conv: Optional[Tensor] = None  # the activated convolution's output as the scan reads it (hook_conv)
        self.z: Optional[Tensor] = None  # an edited gate (hook_gate)

    def _readers(self) -> list[Any]:
        m = self.mixer
        readers = [m.get_submodule("in_proj").register_forward_hook(self._on_in_proj)]
        if isinstance(m.act, nn.Module):  # transformers 4.x calls it on the convolution's output: edits upstream stay
            readers.append(m.act.register_forward_hook(self._on_act))
        return readers

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._enter(module, args, kwargs)
        before = cache_tensor(self.cache, getattr(module, "layer_idx", None), "get_conv_state", "conv_states")
        self.conv0 = None if before is None else before.detach().clone()

    def _on_in_proj(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self.live():
            scale = factor(self.mixer)  # as the model computes it (its dtypes' promotion): in_proj's output times it
            self.proj = output if scale is None else output * scale

    def _rounding(self, served: Tensor) -> torch.dtype:
        """The model's dtype where it is coarser than the norm's input (transformers scans in float32 from it)."""
        proj = self.proj
        return proj.dtype if proj is not None and proj.dtype.itemsize < served.dtype.itemsize else served.dtype

    def _on_act(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        sizes = _sizes(self.mixer)
        ours = self.reached  # the scan's own recomputation (below) calls it too
        if (
            self.live()
            and not ours
            and sizes is not None
            and isinstance(output, Tensor)
            and output.shape[-1] == sizes[2]
        ):
            self.activated = output

    def _starts(self, served: Tensor) -> Any:
        m, proj, sizes = self.mixer, _positions(self.proj), _sizes(self.mixer)
        if proj is None or sizes is None or proj.shape[:2] != served.shape[:2]:
            yield "the mixer did not call in_proj on this forward pass (a fused kernel)"
            return
        mlp, inner, conv, _, _ = sizes
        heads, w = m.A_log.shape[0], self.wide
        xbc = proj[..., 2 * mlp + inner : 2 * mlp + inner + conv]
        low_dt = proj[..., -heads:]  # computed in the model's dtype, as the model does (then widened)
        raw = F.softplus(low_dt + m.dt_bias.to(low_dt.dtype)).to(w)
        state = (served.shape[0], heads, inner // heads, sizes[4])
        activated = _positions(self.activated)
        for low, high in _limits(m):
            dt = torch.clamp(raw, low, high)
            if activated is not None and activated.shape[:2] == proj.shape[:2]:  # the model's own convolution output
                for h0 in (self.h0, None) if self.h0 is not None else (None,):
                    if h0 is None or h0.shape == state:
                        for _ in self._split(activated.to(w)):
                            yield dt, h0
            for conv0, h0 in ((self.conv0, self.h0), (None, None)) if self.h0 is not None else ((None, None),):
                if h0 is not None and (h0.shape != state or conv0 is None or conv0.shape[:2] != (state[0], conv)):
                    continue
                for _ in self._split(self._convolve(xbc, conv0)):
                    yield dt, h0

    def _edit_inputs(self) -> bool:
        """``hook_gate`` (the gate as the gated norm, or the mixer's gating, reads it) then ``hook_conv`` (x, B and C
        as the model has them, in its dtype: an edit is the scan's x, B and C, nothing else reads them)."""
        edited, sizes, proj = False, _sizes(self.mixer), self.proj
        assert sizes is not None and proj is not None and self.conv is not None
        if "hook_gate" in self.by:
            gate, changed = self.by["hook_gate"].apply(self._read_gate(), protect=True)
            if changed:  # the scan's value changes only where the mixer gates it itself (GatedHeadScan)
                self.z, edited = gate, self.gated_here
        if "hook_conv" in self.by:
            conv, changed = self.by["hook_conv"].apply(self.conv.to(proj.dtype), protect=True)
            if changed:
                self._read(conv.to(self.wide), sizes)
                edited = True
        return edited

    def edit_targets(self) -> dict[str, tuple[str, int, str]]:
        return {"hook_gate": ("norm", 1, "gate")}

    def _read_gate(self) -> Tensor:
        """The gate the gated norm is given (its second input), which must be in_proj's (scaled) gate part."""
        args, kwargs = self.given
        given = args[1] if len(args) > 1 else kwargs.get("gate")
        gate = self._gate()
        if not isinstance(given, Tensor) or given.shape != gate.shape or not _close(given, gate.to(given.dtype)):
            self._fail(f"{self.inject} was not given in_proj's gate part as its second input (gate)")
            return gate
        return given

    def _finish(self, args: tuple, kwargs: dict, y: Optional[Tensor]) -> Any:
        args, kwargs = (args, kwargs) if y is None else replace_first_input(args, kwargs, y)
        if self.z is not None:  # the edited gate is what the gated norm reads
            if len(args) > 1:
                args = (args[0], self.z, *args[2:])
            else:
                kwargs = {**kwargs, "gate": self.z}
        return (args, kwargs) if y is not None or self.z is not None else None

    def _convolve(self, xbc: Tensor, before: Optional[Tensor]) -> Tensor:
        """The causal convolution of xBC, activated (``before``: the cache's convolution state)."""
        m = self.mixer
        conv, k = m.conv1d, m.conv1d.kernel_size[0]
        w = conv.weight.dtype  # in the convolution's dtype, as the model computes it
        seq = xbc.transpose(1, 2).to(w)
        past = F.pad(seq, (k - 1, 0)) if before is None else torch.cat([before[..., -(k - 1) :].to(w), seq], -1)
        out = m.act(F.conv1d(past, conv.weight, conv.bias, groups=conv.groups)).transpose(1, 2)
        return out.to(xbc.dtype).to(self.wide)

    def _split(self, out: Tensor) -> Any:
        """x, B and C from the activated convolution's output: zero at the masked positions, then (where the mask has
        a zero) as they are (transformers 4.x masks no single sequence)."""
        w, sizes = self.wide, _sizes(self.mixer)
        assert sizes is not None
        mask = self.kwargs.get("attention_mask")
        if isinstance(mask, Tensor) and mask.shape == out.shape[:2] and not bool(mask.all()):
            ways = [out * mask[:, :, None].to(w), out]
        else:
            ways = [out]
        for scaled in ways:
            self.conv = scaled
            self._read(scaled, sizes)
            yield

    def _read(self, out: Tensor, sizes: tuple[int, int, int, int, int]) -> None:
        _, inner, _, groups, state = sizes
        heads = self.mixer.A_log.shape[0]
        x, b, c = out.split([inner, groups * state, groups * state], -1)
        self.x = x.reshape(*x.shape[:2], heads, inner // heads)
        self.b, self.c = (t.reshape(*t.shape[:2], groups, state).repeat_interleave(heads // groups, 2) for t in (b, c))

    def _steps(self, dt: Tensor) -> tuple[Tensor, Tensor]:
        x, b = self.x, self.b
        assert x is not None and b is not None
        decay = torch.exp(dt * -torch.exp(self.mixer.A_log.to(self.wide)))[..., None, None]
        return decay, dt[..., None, None] * x[..., None] * b[:, :, :, None, :]

    def _readout(self, states: Tensor) -> Tensor:
        assert self.c is not None
        return (states * self.c[:, :, :, None, :]).sum(-1)

    def _combine(self, ys: Tensor) -> Tensor:
        assert self.x is not None
        return (ys + self.x * self.mixer.D.to(self.wide)[:, None]).flatten(2)

    def edit_reaches(self, base: Tensor) -> Tensor:
        return base.float() + 1.0

    def _gate(self) -> Tensor:
        """The gate ``z``, in_proj's (scaled) output's part after the MLP parts."""
        sizes, proj = _sizes(self.mixer), _positions(self.proj)
        assert sizes is not None and proj is not None
        mlp, inner = sizes[0], sizes[1]
        return proj[..., 2 * mlp : 2 * mlp + inner]


class GatedHeadScan(HeadScan):
    """Mamba-2's scan in a mixer with no gated norm: ``(y + D x) * act(z)`` goes into ``out_proj`` (the activation
    computed in the gate's dtype, as the model does, the product in float32 or wider)."""

    inject = "out_proj"
    gated_here = True

    def edit_targets(self) -> dict[str, tuple[str, int, str]]:
        return {}

    def _read_gate(self) -> Tensor:
        return self._gate()

    def _finish(self, args: tuple, kwargs: dict, y: Optional[Tensor]) -> Any:
        return ScanSite._finish(self, args, kwargs, y)

    def _combine(self, ys: Tensor) -> Tensor:
        gate = self._gate() if self.z is None else self.z
        return super()._combine(ys) * self.mixer.act(gate).to(self.wide)

    def edit_reaches(self, base: Tensor) -> Tensor:
        return base.float() + self.mixer.act(self._gate()).float()
