"""The branch points of a block that adds its branches multiplied by constants (``BlockLayout.attn_scale`` and
``mlp_scale``: Granite's ``residual_multiplier``): ``mid = x + attn_out_module * attn_scale``, ``out = mid +
mlp_module_out * mlp_scale``."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks.frames import ForwardState
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites.base import (
    Site,
    completes_output,
    first_input,
    first_output,
    plus_delta,
    reads_output,
    replace_first_input,
    replace_first_output,
    split_heads,
)

Tensor = torch.Tensor


def times(t: Tensor, c: float) -> Tensor:
    """``t * c`` as the model computes it with the Python float ``c`` (``t`` itself for 1.0)."""
    return t if c == 1.0 else t * c


class ScaledBranchSite(Site):
    """``attn.hook_result``, ``hook_attn_out``, ``hook_resid_mid``, ``hook_mlp_in``, ``hook_mlp_out`` and
    ``hook_resid_post`` of a block with branch constants (``BlockLayout.attn_scale``/``mlp_scale``).

    ``hook_attn_out`` is the attention module's output times ``attn_scale`` and ``hook_mlp_out`` the MLP module's
    output times ``mlp_scale``: what the block adds to the residual stream, read where it adds them. ``hook_resid_mid``
    is the input of ``reader`` (``ln2``, or the MLP module without one) and ``hook_mlp_in`` the same value for the MLP
    branch only. An edit of ``hook_attn_out`` gives ``reader`` the middle recomputed from the edited contribution
    (``x + edited``, as the block adds it); an edit of any of them gives the block's output as that middle plus the
    (edited) MLP contribution. The modules' own outputs are never changed, so no edit is divided back by a constant:
    the block computes exactly what it would with the edited contribution.

    Every value is recorded and every edit made by hooks on the block's modules (``entry``, the first one the block
    runs on its input, ``ln1`` or the attention module, gives the block's input), but the last: the block's output,
    rebuilt where an edit changed it. While the block trains with gradient checkpointing (:meth:`carried`) the
    rebuilt output's difference from the block's own (``mid + mlp_out * mlp_scale`` as the block adds it) is carried
    into the MLP module's output instead, divided by ``mlp_scale`` (its value the rebuilt one's up to rounding):
    transformers 5.x checkpoints a layer's ``forward`` and runs the layer's own forward hooks outside it, once, and a
    reentrant checkpoint's first forward runs without gradients, so an output rebuilt there would have no graph; the
    MLP module's hook runs inside the checkpointed function, and the recomputation in the backward pass makes every
    edit again with gradients (transformers 4.x checkpoints the layer's ``__call__``, its hooks included, where this
    is the same). ``hook_resid_post`` stays the block's output. Otherwise values are bitwise the rebuilt ones.

    ``attn.hook_result`` is ``hook_z`` times ``weight()`` per head (``W_O`` with ``attn_scale`` folded in, so that
    ``sum(hook_result) + b_O`` is ``hook_attn_out`` up to rounding); an edit enters the contribution as the
    difference ``sum_h (edited_h - result_h)``, before ``hook_attn_out``'s hooks see it (TransformerLens' order).
    What a forward records is its own (``forward_state``'s site values).
    """

    def __init__(
        self,
        block: nn.Module,
        entry: nn.Module,
        attn: nn.Module,
        o_proj: Optional[nn.Module],
        reader: nn.Module,
        mlp: nn.Module,
        attn_scale: float,
        mlp_scale: float,
        points: dict[str, Optional[HookPoint]],
        heads: Optional[int] = None,
        weight: Optional[Callable[[], tuple[Tensor, Optional[Tensor]]]] = None,
        forward_state: Optional[ForwardState] = None,
    ) -> None:
        self.block, self.entry, self.attn, self.o_proj, self.reader, self.mlp = block, entry, attn, o_proj, reader, mlp
        self.attn_scale, self.mlp_scale = attn_scale, mlp_scale
        self.heads, self.weight = heads, weight
        get = points.get
        self.result = get("attn.hook_result") if o_proj is not None and weight is not None else None
        self.attn_out, self.resid_mid, self.mlp_in = get("hook_attn_out"), get("hook_resid_mid"), get("hook_mlp_in")
        self.mlp_out, self.resid_post = get("hook_mlp_out"), get("hook_resid_post")
        named = (self.result, self.attn_out, self.resid_mid, self.mlp_in, self.mlp_out, self.resid_post)
        self.points = tuple(p for p in named if p is not None)
        self.forward_state = forward_state
        self._own: dict[str, Any] = {}

    @property
    def state(self) -> dict[str, Any]:
        """This forward's records (its site values: another thread's forward, or one a hook runs inside it, has its
        own; the site's own dict without ``forward_state``)."""
        return self._own if self.forward_state is None else self.forward_state.site_values(self)

    def install(self) -> list[RemovableHandle]:
        handles = [self.entry.register_forward_pre_hook(self._enter, with_kwargs=True)]
        if self.result is not None and self.o_proj is not None:
            handles.append(reads_output(self.o_proj, self._on_result, with_kwargs=True))
        handles.append(reads_output(self.attn, self._on_attn))
        handles.append(self.reader.register_forward_pre_hook(self._on_reader, with_kwargs=True))
        handles.append(reads_output(self.mlp, self._on_mlp))
        handles.append(completes_output(self.block, self._on_block))
        return handles

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        state = self.state
        state.clear()
        state["x"] = first_input(args, kwargs)

    def _on_result(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        state = self.state
        if "x" not in state or "delta" in state or self.result is None or not self.result.active:
            return
        assert self.weight is not None and self.heads is not None
        z = split_heads(first_input(args, kwargs), self.heads)
        W, _ = self.weight()  # [d_in, d_model], the constant folded in
        result = torch.einsum("...hd,hdm->...hm", z, W.unflatten(0, (self.heads, -1)).to(z.dtype))
        edited, changed = self.result.apply(result, protect=True)
        if changed:
            wide = torch.promote_types(result.dtype, torch.float32)
            state["delta"] = edited.to(wide).sum(-2) - result.to(wide).sum(-2)

    def _on_attn(self, module: nn.Module, args: tuple, output: Any) -> None:
        state = self.state
        if "x" not in state or "a" in state:
            return
        a = times(first_output(output), self.attn_scale)
        changed = "delta" in state
        if changed:
            a = plus_delta(a, state.pop("delta"))
        if self.attn_out is not None:
            a, edited = self.attn_out.apply(a, protect=True)
            changed |= edited
        state["a"], state["a_changed"] = a, changed

    def _on_reader(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        state = self.state
        if "a" not in state or "mid" in state:
            return None
        mid = first_input(args, kwargs)
        changed = state["a_changed"]
        if changed:  # the middle as the block adds it, from the edited contribution
            mid = state["x"] + state["a"].to(mid.dtype)
        if self.resid_mid is not None:
            mid, edited = self.resid_mid.apply(mid, protect=True)
            changed |= edited
        state["mid"], state["mid_changed"], state["read"] = mid, changed, first_input(args, kwargs)
        reads = mid
        if self.mlp_in is not None:  # the MLP branch only
            reads, edited = self.mlp_in.apply(mid, protect=True)
            changed |= edited
        return replace_first_input(args, kwargs, reads.to(mid.dtype)) if changed else None

    def carried(self) -> bool:
        """Whether the rebuilt output's difference goes into the MLP module's output (the block trains with gradient
        checkpointing)."""
        block: Any = self.block
        return bool(block.training and getattr(block, "gradient_checkpointing", False))

    def _on_mlp(self, module: nn.Module, args: tuple, output: Any) -> Any:
        state = self.state
        if "mid" not in state or "m" in state:
            return None
        state["m"] = first_output(output)
        if not self.carried():
            return None
        # inside the checkpointed function: the block's own output carries the rebuilt one's difference
        m, changed = self._contribution(state)
        own = state["read"] + times(state["m"], self.mlp_scale)  # what the block adds, as it adds it
        mid = state["mid"]
        state.clear()
        state["carried"] = True
        if not changed:
            return None
        y = first_output(output)
        difference = (mid + m.to(own.dtype)) - own
        if self.mlp_scale != 1.0:
            difference = difference / self.mlp_scale
        return replace_first_output(output, y + difference.reshape(y.shape).to(y.dtype))

    def _contribution(self, state: dict[str, Any]) -> tuple[Tensor, bool]:
        """The (edited) MLP contribution and whether the block's output changes."""
        m = times(state["m"], self.mlp_scale)
        changed = state["mid_changed"]
        if self.mlp_out is not None:
            m, edited = self.mlp_out.apply(m, protect=True)
            changed |= edited
        return m, changed

    def _on_block(self, module: nn.Module, args: tuple, output: Any) -> Any:
        state = self.state
        y = first_output(output)
        if state.get("carried"):  # the output was completed inside the block (the MLP module's output)
            state.clear()
            if self.resid_post is None:
                return None
            value, changed = self.resid_post.apply(y)
            return replace_first_output(output, value) if changed else None
        if "m" not in state:  # a forward that did not run the branches as described: nothing served
            state.clear()
            return None
        m, changed = self._contribution(state)
        value = (state["mid"] + m.to(y.dtype)).reshape(y.shape) if changed else y
        state.clear()
        if self.resid_post is not None:
            value, edited = self.resid_post.apply(value)
            changed |= edited
        return replace_first_output(output, value) if changed else None
