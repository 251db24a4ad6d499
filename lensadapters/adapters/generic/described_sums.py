"""The branch points of a *described* layer (its attention and MLP described, :mod:`.describe`) that runs a second
token mixer beside its attention module and adds the two outputs, each times a constant of its config, before its
middle (:mod:`.parallel`'s split: ``mid = x + (beside_out * c_b + attn_out * c_a)``, exactly what its ``ln2`` reads;
``out = mid + mlp_out * c_m``), or whose MLP is two modules it adds as one sum (routed experts and a shared MLP:
``out = mid + (routed_out + shared_out) * c_m``, ``hook_mlp_out`` that contribution; no ``hook_mixer_out``). A
block description has one constant per branch (``BlockLayout.attn_scale`` and ``mlp_scale``, which the weights
include: ``W_O`` times ``c_a``, ``W_out`` times ``c_m``), and the core's sites know no second mixer and one MLP
module, so the generic adapter serves these points itself (claiming the core's):

* ``hook_attn_out``, ``hook_mixer_out``: the contributions the layer adds (each output times its constant), read
  where it adds them; ``hook_resid_mid`` the middle ``ln2`` reads; ``hook_mlp_out`` the MLP's contribution
  (:class:`.mixer_sites.SumSite`: an edit gives ``ln2`` the middle recomputed from the edited contributions and the
  layer's output as that middle plus the MLP's contribution; no module's output is changed, no edit divided back);
* ``attn.hook_result``: ``hook_z`` times ``W_O`` (``attn_scale`` included) per head, so ``sum(hook_result) + b_O``
  is ``hook_attn_out`` up to rounding; an edit enters the attention's contribution as ``sum_h (edited_h -
  result_h)`` before ``hook_attn_out``'s hooks see it (TransformerLens' order);
* ``hook_mlp_in``: the middle as the MLP branch alone reads it (an edit reaches ``ln2``, not the residual);
* ``hook_resid_post``: the layer's output, after the edits above.

Nothing here names an architecture.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.mixer_sites import SUM_POINTS, SumSite
from lensadapters.hooks.frames import ForwardState
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import (
    Site,
    first_input,
    first_output,
    replace_first_input,
    replace_first_output,
)
from lensadapters.hooks.sites.base import plus_delta, reads_output, split_heads

Tensor = torch.Tensor

#: the points this module serves for a described layer (besides ``hook_mixer_out``, a point of the generic adapter)
CLAIMED = ("attn.hook_result", "hook_attn_out", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out", "hook_resid_post")

#: each wrapped model's described layers served here, by index: ``(split, contribution names, ln2's path)``
DESCRIBED_SUMS: "weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[Any, tuple[str, ...], str]]]" = (
    weakref.WeakKeyDictionary()
)


class DescribedSumSite(SumSite):
    """:class:`.mixer_sites.SumSite`'s points, with ``attn.hook_result`` (entering the attention's contribution),
    ``hook_mlp_in`` and ``hook_resid_post`` (the module docstring). ``weight()``: ``W_O`` as ``[d_in, d_model]``
    with the attention's constant folded in."""

    def __init__(
        self,
        layer: nn.Module,
        reader: nn.Module,
        split: Any,
        contributions: tuple[str, ...],
        points: dict[str, Any],
        state: ForwardState,
        o_proj: nn.Module,
        heads: int,
        weight: Callable[[], tuple[Tensor, Optional[Tensor]]],
        entry: Optional[nn.Module] = None,
    ) -> None:
        super().__init__(layer, reader, split, contributions, points, state, entry)
        self.layer, self.reader, self.o_proj, self.heads, self.weight = layer, reader, o_proj, heads, weight
        self.attn_index = contributions.index("hook_attn_out")
        self.result: Optional[HookPoint] = points.get("attn.hook_result")
        self.mlp_in: Optional[HookPoint] = points.get("hook_mlp_in")
        self.resid_post: Optional[HookPoint] = points.get("hook_resid_post")
        extra = tuple(p for p in (self.result, self.mlp_in, self.resid_post) if p is not None)
        self.points = (*self.points, *extra)

    def install(self) -> list[Any]:
        handles: list[Any] = []
        if self.result is not None:
            handles.append(reads_output(self.o_proj, self._on_result, with_kwargs=True))
        handles += super().install()
        if self.mlp_in is not None:  # after the sum's own hook on the reader: the middle it recorded stays
            handles.append(self.reader.register_forward_pre_hook(self._on_mlp_in, with_kwargs=True))
        if self.resid_post is not None:  # after the sum's completion of the layer's output
            handles.append(reads_output(self.layer, self._on_resid_post))
        return handles

    def _on_result(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if "x" not in self.sum.state or self.result is None or not self.result.active:
            return
        z = split_heads(first_input(args, kwargs), self.heads)
        W, _ = self.weight()  # [d_in, d_model], the attention's constant folded in
        result = torch.einsum("...hd,hdm->...hm", z, W.unflatten(0, (self.heads, -1)).to(z.dtype))
        edited, changed = self.result.apply(result, protect=True)
        if changed:
            wide = torch.promote_types(result.dtype, torch.float32)
            self._values()["result_delta"] = edited.to(wide).sum(-2) - result.to(wide).sum(-2)

    def _before(self, k: int, contribution: Tensor) -> None:
        record = self._values()
        delta = record.pop("result_delta", None) if k == self.attn_index else None
        if delta is not None:
            contribution = plus_delta(contribution, delta)
        super()._before(k, contribution)
        if delta is not None:
            record["changed"] = True

    def _on_mlp_in(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        state = self.sum.state
        if "mid" not in state or state.get("mlp_in_seen") or self.mlp_in is None:
            return None
        state["mlp_in_seen"] = True
        mid = first_input(args, kwargs)
        edited, changed = self.mlp_in.apply(mid, protect=True)
        return replace_first_input(args, kwargs, edited.to(mid.dtype)) if changed else None

    def _on_resid_post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.resid_post is None:
            return None
        value, changed = self.resid_post.apply(first_output(output))
        return replace_first_output(output, value) if changed else None


def described_sum_site(hooked: Any, i: int, layer: nn.Module, block: Any, claimed: set) -> list[Site]:
    """The sites of described layer ``i``'s branch points (the module docstring), its core points claimed (into
    ``claimed``) and ``hook_mixer_out`` created where the probe saw it fire; ``[]`` where the layer is not of this
    shape."""
    form = block.mixer
    if form is None or form.sum is None or form.mid is None:
        return []
    if block.beside is None and (len(form.sum.before) != 1 or len(form.sum.after) != 2):
        return []  # (neither a mixer beside the attention nor an MLP of two modules)
    bl = hooked.block_layouts[i]
    points: dict[str, Any] = {}
    for name in CLAIMED:
        full = f"blocks.{i}.{name}"
        if full in hooked.hook_dict and full not in claimed:
            points[name] = hooked.claim_point(full)
            claimed.add(full)
    if block.beside is not None:
        first = block.points.index("hook_mixer_out") < block.points.index("hook_attn_out")
        anchors = ["ln1.hook_normalized", "hook_resid_pre"] if first else ["hook_attn_out"]
        after = next((f"blocks.{i}.{a}" for a in anchors if f"blocks.{i}.{a}" in hooked.hook_dict), None)
        points["hook_mixer_out"] = hooked.new_point(f"blocks.{i}.hook_mixer_out", after=after)
    DESCRIBED_SUMS.setdefault(hooked.hf_model, {})[i] = (form.sum, form.contributions, form.mid)
    o_proj = layer.get_submodule(bl.o_proj)
    site = DescribedSumSite(
        layer,
        layer.get_submodule(form.mid),
        form.sum,
        form.contributions,
        points,
        hooked.forward_state,
        o_proj,
        hooked.cfg.n_heads,
        hooked._o_reader(i),
        _ln1(layer, form, bl),
    )
    return [site]


def _ln1(layer: nn.Module, form: Any, bl: Any) -> Optional[nn.Module]:
    """The layer's pre-norm (where :class:`.mixer_sites.SumSite` starts its records while the layer trains with
    gradient checkpointing), ``None`` without one."""
    path = next((p for role, p, _ in form.norms if role == "ln1"), None) or getattr(bl, "ln1", None)
    return layer.get_submodule(path) if path else None


def described_sum_reference(hooked: Any, i: int, rest: str) -> Optional[Any]:
    """The plain-PyTorch reference of a point :func:`described_sum_site` serves, ``None`` for any other."""
    from lensadapters.adapters.generic.mixer_sites import SumReference
    from lensadapters.adapters.generic.references import Reference, _ScaledResult

    entry = DESCRIBED_SUMS.get(hooked.hf_model, {}).get(i)
    if entry is None:
        return None
    split, contributions, mid = entry
    layer, bl = hooked.block_modules[i], hooked.block_layouts[i]
    reader = layer.get_submodule(mid)
    if rest in SUM_POINTS:
        return Reference("hooks", layer, spec=SumReference(layer, reader, split, rest, list(contributions)))
    if rest == "attn.hook_result":
        o_proj = layer.get_submodule(bl.o_proj)
        k = list(contributions).index("hook_attn_out")
        return Reference("hooks", o_proj, spec=_ScaledResult(layer, reader, split, o_proj, hooked.cfg.n_heads, k))
    return None
