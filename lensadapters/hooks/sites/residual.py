"""The residual stream around a block's MLP: ``hook_resid_mid``, ``hook_mlp_in``, ``hook_mlp_out``,
``hook_resid_post``."""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites.base import (
    ForwardState,
    Site,
    first_input,
    first_output,
    replace_first_input,
    replace_first_output,
)


class ResidualSite(Site):
    """The residual stream around the MLP of one block.

    ``hook_resid_mid`` and ``hook_mlp_in`` are the input of ``ln2`` (the module passed as ``ln2``: the MLP module
    itself in a block without a pre-MLP norm). An edit of ``hook_mlp_in`` changes
    only the MLP's input. An edit of ``hook_resid_mid`` changes the MLP's input *and* the residual:
    the block output is then recomputed as ``resid_mid + mlp_out``, exactly what the block computes.
    ``hook_mlp_out`` is the output of ``mlp_out_module`` (the MLP, or the norm after it), ``hook_resid_post`` the
    block output.

    Under gradient checkpointing, transformers re-runs a block's forward but not the block's own hooks.
    While a block is checkpointed, and given ``residual_add`` (the module whose output the block adds to
    the residual after the MLP: the MLP module, or a dropout after it), the ``hook_resid_mid`` edit's
    difference ``edited - resid_mid`` is therefore added to that module's output, so that the block's own
    ``residual + mlp_out`` becomes ``edited + mlp_out`` inside the checkpointed forward and gradients
    reach the edit through both branches. Blocks without such a module (OPT, whose dropout follows
    ``fc2`` in the block body) are rebuilt at the block output in every case.

    ``layer`` keys the site's values in the forward's state (any key unique to the block); with
    ``prepend_block_hook`` the block-output hook runs before the block's other forward hooks.
    """

    prepend_block_hook: bool = False

    def __init__(
        self,
        layer: Hashable,
        block: nn.Module,
        ln2: Optional[nn.Module],
        mlp_out_module: nn.Module,
        state: ForwardState,
        resid_mid: Optional[HookPoint],
        mlp_in: Optional[HookPoint],
        mlp_out: HookPoint,
        resid_post: HookPoint,
        residual_add: Optional[nn.Module] = None,
        continues: bool = False,
        entries: Sequence[nn.Module] = (),
    ) -> None:
        self.layer, self.block, self.ln2, self.mlp_out_module, self.state = layer, block, ln2, mlp_out_module, state
        self.residual_add, self.continues, self.entries = residual_add, continues, tuple(entries)

        self.resid_mid, self.mlp_in, self.mlp_out, self.resid_post = resid_mid, mlp_in, mlp_out, resid_post
        self.points = tuple(p for p in (resid_mid, mlp_in, mlp_out, resid_post) if p is not None)

    def _edit_in_mlp(self) -> bool:
        """Carry resid_mid edits into the block's residual add: while the block is gradient-checkpointed, or
        always in a block that continues after that add.

        Otherwise the block output is rebuilt as ``edited + mlp_out``, which keeps gradients bit for bit
        (the difference form sums the residual gradient in another order).
        """
        return self.residual_add is not None and (
            self.continues or self.block.training and bool(getattr(self.block, "gradient_checkpointing", False))
        )

    def wanted(self) -> bool:
        return any(self.signature())

    def _mid_active(self) -> bool:
        return self.resid_mid is not None and self.resid_mid.active

    def install(self) -> list[RemovableHandle]:
        handles = []
        mid = self._mid_active()
        if self.ln2 is not None and (mid or (self.mlp_in is not None and self.mlp_in.active)):
            handles.append(self.ln2.register_forward_pre_hook(self._ln2_pre, with_kwargs=True))
            handles += [m.register_forward_pre_hook(self._entry_pre, with_kwargs=True) for m in self.entries]
        if mid or self.mlp_out.active:
            handles.append(self.mlp_out_module.register_forward_hook(self._mlp_out))
        if mid and self.residual_add is not None and self.residual_add is not self.mlp_out_module:
            handles.append(self.residual_add.register_forward_hook(self._add_delta))
        if mid or self.resid_post.active:
            handles.append(self.block.register_forward_hook(self._block_out, prepend=self.prepend_block_hook))
        return handles

    def signature(self) -> tuple[bool, ...]:
        """Which of the three PyTorch hooks are needed now (re-installed when this changes)."""
        mid = self._mid_active()
        return (
            mid or bool(self.mlp_in and self.mlp_in.active),
            mid or self.mlp_out.active,
            mid or self.resid_post.active,
        )

    def _ln2_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        value = first_input(args, kwargs)
        changed = False
        self.state.resid_mid.pop(self.layer, None)  # never a leftover of a forward that raised
        self.state.mlp_out.pop(self.layer, None)
        if self.resid_mid is not None and self.resid_mid.active:
            original = value
            value, changed = self.resid_mid.apply(value, protect=True)  # the block's residual is this tensor
            if changed:  # the difference (added to the MLP output) or the edited stream (rebuilt at the block output)
                in_mlp = self._edit_in_mlp()
                self.state.resid_mid[self.layer] = (in_mlp, value - original if in_mlp else value)
        if self.mlp_in is not None and self.mlp_in.active:
            value, in_changed = self.mlp_in.apply(value, protect=True)  # an edit reaches the MLP branch only
            changed = changed or in_changed
        if self.entries:  # the other modules reading the MLP input get the same edit
            self.state.site_values(self)["mlp_in"] = value if changed else None
        return replace_first_input(args, kwargs, value) if changed else None

    def _entry_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Another module reading the MLP input (``entries``: a branch beside the MLP, which may read it
        flattened to ``[b*p, d]``): it reads the edited ``hook_mlp_in`` when ``ln2``'s hook edited it."""
        edited = self.state.site_values(self).get("mlp_in")
        if edited is None:
            return None
        value = first_input(args, kwargs)
        return replace_first_input(args, kwargs, edited.reshape(value.shape).to(value.dtype))

    def _mlp_out(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        changed = False
        if self.mlp_out.active:
            value, changed = self.mlp_out.apply(value)
        stash = self.state.resid_mid.get(self.layer)
        if stash is not None:
            if stash[0] and self.residual_add is module:
                return self._add_delta(module, args, replace_first_output(output, value))
            if not stash[0]:
                self.state.mlp_out[self.layer] = value
        return replace_first_output(output, value) if changed else None

    def _add_delta(self, module: nn.Module, args: tuple, output: Any) -> Any:
        stash = self.state.resid_mid.get(self.layer)
        if stash is None or not stash[0]:
            return None
        delta = self.state.resid_mid.pop(self.layer)[1]
        value = first_output(output)
        return replace_first_output(output, value + delta.reshape(value.shape).to(value.dtype))

    def _block_out(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        changed = False
        stash = self.state.resid_mid.pop(self.layer, None)
        if stash is not None and not stash[0]:
            # the block may have flattened tokens around its MLP (BlockLayout.flat_mlp)
            value = (stash[1] + self.state.mlp_out.pop(self.layer)).reshape(value.shape)
            changed = True
        if self.resid_post.active:
            value, post_changed = self.resid_post.apply(value)
            changed = changed or post_changed
        return replace_first_output(output, value) if changed else None
