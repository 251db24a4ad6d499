"""Per-head attention inputs: ``blocks.L.hook_attn_in``, ``hook_q_input``, ``hook_k_input``, ``hook_v_input``.

TransformerLens computes these when ``use_attn_in`` / ``use_split_qkv_input`` are set: the block input (the
residual stream *before* the attention norm) repeated once per head, ``[batch, pos, heads, d_model]``, each
head's copy normalized on its own and projected by that head's weights only. Editing one head's copy is the
path-patching primitive: it changes what that head reads and nothing else.

Here they are computed only while hooked, from the model's own computation: the hooks run on the norm's
input (post-LN blocks: the attention's input), and an edit enters the query/key/value projection's output as
``(norm(edited) - norm(x)) @ W`` per head, with the norm's live parameters and the projection's effective
weight (``hooked.read_linear``: fused layouts, LoRA deltas, dequantized storage). Heads whose input is left
as it was keep the model's exact numbers (and their gradient: the edit's path stays in the autograd graph).

* ``hook_q_input`` is ``[b, p, n_heads, d_model]``; ``hook_k_input`` and ``hook_v_input`` have one copy per
  key/value head (``n_key_value_heads`` under grouped-query attention), as in TransformerLens.
* ``hook_attn_in`` (``[b, p, n_heads, d_model]``) feeds head ``h``'s queries, keys and values; it fires first,
  and the split inputs start from its (possibly edited) value. Under grouped-query attention a key/value head
  serves several query heads, so there is no per-head "attention input" and the point does not exist (in
  TransformerLens it fails too): use the split inputs.
* An edit of ``ln1.hook_scale``/``hook_normalized`` applies to the shared normalized input; head-input edits
  are added to what the projections compute from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks import norms
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import (
    Site,
    completes_output,
    first_input,
    first_output,
    merge_heads,
    replace_first_output,
    split_heads,
)
from lensadapters.hooks.specs import FusedQKV, SeparateQKV
from lensadapters.wiring import weights as _w

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.adapters.protocol import Hooked

Tensor = torch.Tensor
NAMES = ("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")


class HeadInputSite(Site):
    """The four head-input points of one block."""

    def __init__(
        self,
        hm: "Hooked",
        layer: int,
        attn_in: Optional[HookPoint],
        q_input: HookPoint,
        k_input: Optional[HookPoint],
        v_input: Optional[HookPoint],
    ) -> None:
        self.hm, self.layer = hm, layer
        self.attn_in, self.q_input, self.k_input, self.v_input = attn_in, q_input, k_input, v_input
        self.points = tuple(p for p in (attn_in, q_input, k_input, v_input) if p is not None)
        block, layout = hm.block_modules[layer], hm.block_layouts[layer]
        # no norm before attention (post-LN, or none at all as in OLMo 2): attention reads the residual itself
        self.norm = None if layout.post_norm or layout.ln1 is None else block.get_submodule(layout.ln1)
        # pre-LN: the norm's input is the residual the attention reads; post-LN: the attention reads it directly
        self.entry = self.norm if self.norm is not None else block.get_submodule(layout.attn)
        self.qkv = hm.qkv_layouts[layer]
        if isinstance(self.qkv, FusedQKV):
            self.projections: list[tuple[Optional[int], nn.Module]] = [(None, block.get_submodule(self.qkv.module))]
        else:
            own_kv = self.qkv.kv_from is None and not self.qkv.values_from_keys
            paths = (self.qkv.q, self.qkv.k, self.qkv.v) if own_kv else (self.qkv.q,)
            self.projections = [(i, block.get_submodule(path)) for i, path in enumerate(paths)]

    @property
    def _pending(self) -> dict:
        """The per-head edits waiting for their projection, kept per forward (nested calls and threads apart)."""
        return self.hm.forward_state.site_values(self)

    def install(self) -> list[RemovableHandle]:
        handles = [self.entry.register_forward_pre_hook(self._inputs, with_kwargs=True)]
        for which, module in self.projections:
            # completes the projection's output: hook_q/k/v's own site then sees the edit in it
            handles.append(completes_output(module, self._fused if which is None else self._separate(which)))
        return handles

    # --- running the points -------------------------------------------------------------------------

    def _inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._pending.clear()
        x = first_input(args, kwargs)
        cfg = self.hm.cfg
        n_heads, n_kv = cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads  # set by HookedConfig
        if isinstance(self.qkv, SeparateQKV) and self.qkv.kv_heads:
            n_kv = self.qkv.kv_heads
        base = x.unsqueeze(-2)
        attn_in, attn_changed = None, False
        if self.attn_in is not None and self.attn_in.active:
            # protect: a fresh tensor, but an in-place edit must be seen under inference_mode too (no version counter)
            attn_in, attn_changed = self.attn_in.apply(base.repeat_interleave(n_heads, dim=-2), protect=True)
        streams: list[tuple[Tensor, bool]] = []
        for point, heads in ((self.q_input, n_heads), (self.k_input, n_kv), (self.v_input, n_kv)):
            start = attn_in.clone() if attn_changed else base.repeat_interleave(heads, dim=-2)
            if point is None:  # keys and values from another layer (SeparateQKV.kv_from): nothing to project here
                streams.append((start, False))
                continue
            value, changed = point.apply(start, protect=True) if point.active else (start, False)
            streams.append((value, changed or attn_changed))
        if not any(changed for _, changed in streams):
            return None
        normalize = self._normalizer()
        reference = normalize(base)  # [b, p, 1, d_model]
        for which, (value, changed) in enumerate(streams):
            if not changed:
                continue
            # heads whose copy was left as it was add an exact zero (the model's numbers), but keep the autograd
            # path: an edit that leaves the value unchanged (x + p*c at p = 0) still has its gradient
            edited_rows = (value != base).any(-1, keepdim=True)
            diff = normalize(value) - reference
            diff = torch.where(edited_rows, diff, diff - diff.detach())
            W = _w.layer_weight(self.hm, ("W_Q", "_W_K", "_W_V")[which], self.layer)  # [heads, d_model, d_head], live
            wide = _wide(W.dtype)  # float32 for the low-precision dtypes, the model's own where it is wider
            self._pending[which] = torch.einsum("...hd,hde->...he", diff.to(wide), W.to(wide))
        return None

    def _normalizer(self) -> Any:
        if self.norm is None:
            return lambda t: t.to(_wide(t.dtype))
        spec = self.hm.norm_spec(self.norm)
        return lambda t: norms.apply_norm(t, spec)

    def _separate(self, which: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            delta = self._pending.pop(which, None)
            if delta is None:
                return None
            out = first_output(output)
            shaped = split_heads(out, delta.shape[-2])
            c = self.qkv.scale(which) if isinstance(self.qkv, SeparateQKV) else 1.0
            if c != 1.0:  # W_Q/W_K include the attention module's constant; the projection's output does not
                delta = delta / c
            return replace_first_output(output, merge_heads((shaped.to(delta.dtype) + delta).to(out.dtype)))

        return hook

    def _fused(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._pending:
            return None
        out = first_output(output)
        parts = list(self.qkv.split(out))
        for which, delta in self._pending.items():
            parts[which] = (parts[which].to(delta.dtype) + delta).to(out.dtype)
        self._pending.clear()
        return replace_first_output(output, self.qkv.merge(*parts))


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype an edit's change is computed in: at least float32 (bf16/fp16 models), never narrower than the model
    (a float64 model's edits stay exact to float64)."""
    return torch.promote_types(dtype, torch.float32)


def head_input_sites(hm: "Hooked") -> list[Site]:
    """Create the head-input points of every block (after ``hook_resid_pre``); their sites, for the wiring to add."""
    sites: list[Site] = []
    cfg = hm.cfg
    for layer in range(cfg.n_layers):
        if hm.block_layouts[layer] is None or hm.qkv_layouts[layer] is None:  # opaque, or no softmax attention
            continue
        if f"blocks.{layer}.attn.hook_q" in getattr(hm, "_claimed", {}):  # a plugin serves the queries its own way
            continue
        if isinstance(hm.qkv_layouts[layer], SeparateQKV) and not hm.qkv_layouts[layer].head_inputs:
            continue  # the projections are not linear in the residual: no per-head input edit is exact
        pre = f"blocks.{layer}."
        anchor = pre + "hook_resid_pre"
        points: dict[str, HookPoint] = {}
        qkv = hm.qkv_layouts[layer]
        shared = isinstance(qkv, SeparateQKV) and (qkv.kv_from is not None or qkv.values_from_keys)
        withheld: set[str] = getattr(hm, "withheld", set())
        if pre + "hook_q_input" in withheld:  # a plugin could not verify them: none of the block's head inputs
            continue
        for name in NAMES:
            if pre + name in withheld:
                continue
            if name == "hook_attn_in" and cfg.n_key_value_heads != cfg.n_heads:
                continue  # grouped-query attention: no per-head input feeds a key/value head
            if shared and name in ("hook_k_input", "hook_v_input"):
                continue  # keys and values from another layer
            points[name] = hm.new_point(pre + name, after=anchor)
            anchor = pre + name
        sites.append(
            HeadInputSite(
                hm,
                layer,
                points.get("hook_attn_in"),
                points["hook_q_input"],
                points.get("hook_k_input"),
                points.get("hook_v_input"),
            )
        )
    return sites
