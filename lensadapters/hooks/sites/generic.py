"""Sites at a module's input or output, optionally viewed as heads; scaled and position embeddings; block shapes."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.errors import LensAdaptersError
from lensadapters.hooks.hook_point import HookPoint, is_recomputing
from lensadapters.hooks.sites.base import (
    ForwardState,
    Site,
    first_input,
    first_output,
    merge_heads,
    replace_first_input,
    replace_first_output,
    split_heads,
)


class OutputSite(Site):
    """A module's output (first element of a tuple), optionally viewed as heads."""

    def __init__(
        self,
        module: nn.Module,
        point: HookPoint,
        heads: Optional[int] = None,
        protect: bool = False,
        scale: float = 1.0,
    ) -> None:
        self.module, self.point, self.heads, self.protect = module, point, heads, protect
        # the point is the output times a constant the model multiplies it by next (MLPLayout.pre_scale): read as the
        # model computes the product, an edit's difference divided by it (the model multiplies it back)
        self.scale = scale
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        shaped = split_heads(value, self.heads) if self.heads else value
        shown = shaped if self.scale == 1.0 else shaped * self.scale
        edited, changed = self.point.apply(shown, self.protect or self.scale != 1.0)
        if not changed:
            return None
        if self.scale != 1.0:
            edited = shaped + ((edited - shown) / self.scale).to(shaped.dtype)
        return replace_first_output(output, merge_heads(edited) if self.heads else edited)


class ScaledOutputSite(Site):
    """``hook_embed`` where the model multiplies the embeddings by a factor after the module
    (``ModelLayout.embed_scale_after_module``): the first block's input, which is that product.

    The model computes ``embeddings * factor`` in its own forward (no module runs it), from the embedding module's
    output or from the ``inputs_embeds`` it was given (:meth:`given`), and passes it to the first block. The point is
    served there, so a read is the model's own product (bit for bit, in every dtype) and an edit is exactly what the
    first block gets. Each forward checks that the first block's input is that product (the factor as a tensor of
    the embeddings' dtype, or the Python float; ``rounded`` says which one ``W_E`` uses), and refuses by name a
    description that does not fit the model.
    """

    def __init__(
        self,
        module: nn.Module,
        first_block: nn.Module,
        point: HookPoint,
        factor: float,
        state: ForwardState,
        rounded: bool = True,
        in_place: bool = False,
    ) -> None:
        self.module, self.first_block, self.point, self.factor = module, first_block, point, factor
        self.state, self.rounded, self.in_place = state, rounded, in_place
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [
            self.module.register_forward_hook(self._record),
            # before the block's own input points (hook_resid_pre): hook_embed comes first
            self.first_block.register_forward_pre_hook(self.serve, with_kwargs=True, prepend=True),
        ]

    def scaled(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``embeddings * factor`` as the model computes it."""
        if self.rounded:
            return embeddings * torch.tensor(self.factor, dtype=embeddings.dtype)
        return embeddings * self.factor

    def given(self, embeddings: torch.Tensor) -> None:
        """The ``inputs_embeds`` of this forward (the embedding module does not run then)."""
        self._keep(embeddings)

    def _record(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._keep(first_output(output))

    def _keep(self, embeddings: torch.Tensor) -> None:
        values = self.state.site_values(self)
        values["source"] = embeddings
        if self.in_place:  # the model scales this very tensor later: its value now, to check the product with
            values["unscaled"] = embeddings.detach().clone()

    def _product(self, value: torch.Tensor, source: torch.Tensor) -> bool:
        return torch.equal(value, source * torch.tensor(self.factor, dtype=source.dtype)) or torch.equal(
            value, source * self.factor
        )

    def skip(self) -> None:
        """This forward's first block runs on something else than the embeddings (``start_at_layer=0``): no
        ``hook_embed`` there."""
        self.state.site_values(self).pop("source", None)

    def serve(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Serves ``hook_embed`` on the first block's input (a forward pre-hook with keyword arguments): the new
        ``(args, kwargs)`` when the point edits it, ``None`` otherwise. Installed on the first block; a caller that
        ends the forward before that block's own hooks run calls it to serve the point there."""
        value = first_input(args, kwargs)
        if self.in_place:
            return self._serve_in_place(args, kwargs, value)
        if not is_recomputing():  # a recomputed first block (gradient checkpointing) gets the input its forward had
            source = self.state.site_values(self).pop("source", None)
            if source is None:  # the first block runs on something else (a forward started at a later layer)
                return None
            if not self._product(value, source):
                raise LensAdaptersError(
                    f"hook_embed: the model's first block gets something other than the embeddings times "
                    f"embed_scale={self.factor}, which ModelLayout.embed_scale_after_module describes: the "
                    f"description does not fit this model"
                )
        edited, changed = self.point.apply(value)
        return replace_first_input(args, kwargs, edited) if changed else None

    def _serve_in_place(self, args: tuple, kwargs: dict, value: torch.Tensor) -> Any:
        """``ModelLayout.embed_scale_in_place``: the point is the embedding tensor the model scaled in place, and an
        edit moves the first block's input (that tensor plus what the model added) by exactly the edit."""
        values = self.state.site_values(self)
        if is_recomputing():  # gradient checkpointing: the scaled tensor of the forward being recomputed
            scaled = values.get("served")
        else:
            source, unscaled = values.pop("source", None), values.pop("unscaled", None)
            if source is None or unscaled is None:  # the first block runs on something else (start_at_layer)
                return None
            if source is value or not self._product(source, unscaled):
                raise LensAdaptersError(
                    f"hook_embed: the model did not multiply the embedding module's output by embed_scale="
                    f"{self.factor} in place before its first block, which ModelLayout.embed_scale_in_place "
                    f"describes: the description does not fit this model"
                )
            scaled = values["served"] = source
        if scaled is None:
            return None
        edited, changed = self.point.apply(scaled, protect=True)  # the model's own tensor: edits go to a copy
        return replace_first_input(args, kwargs, value + (edited - scaled)) if changed else None


class PositionEmbedSite(Site):
    """``hook_pos_embed`` as ``[batch, pos, d_model]``, even when the model broadcasts one row of positions.

    The token-embedding module's output tells the batch size; an edit may differ per batch element.
    """

    def __init__(self, module: nn.Module, embed_module: nn.Module, point: HookPoint, state: "ForwardState") -> None:
        self.module, self.embed_module, self.point, self.state = module, embed_module, point, state
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [
            self.embed_module.register_forward_hook(self._record_batch),
            self.module.register_forward_hook(self._hook),
        ]

    def _record_batch(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.state.batch = first_output(output).shape[0]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        batch, self.state.batch = self.state.batch, None
        shaped = value.expand(batch, *value.shape[1:]) if batch and value.shape[0] == 1 else value
        shaped, changed = self.point.apply(shaped, protect=shaped is not value)  # an expanded view: edit a copy
        return replace_first_output(output, shaped) if changed else None


class InputSite(Site):
    """A module's first input, optionally viewed as heads.

    ``protect``: the model uses the same tensor elsewhere (a post-LN block's MLP input is also its
    residual), so an in-place edit is made on a copy and reaches this module only.
    """

    def __init__(self, module: nn.Module, point: HookPoint, heads: Optional[int] = None, protect: bool = False) -> None:
        self.module, self.point, self.heads, self.protect = module, point, heads, protect
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_pre_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        value = first_input(args, kwargs)
        shaped = split_heads(value, self.heads) if self.heads else value
        shaped, changed = self.point.apply(shaped, self.protect)
        if not changed:
            return None
        return replace_first_input(args, kwargs, merge_heads(shaped) if self.heads else shaped)


class BlockShapeSite(Site):
    """Records a block's leading input dimensions ``(b, p)``, for points that see tokens flattened."""

    def __init__(self, layer: int, block: nn.Module, points: Sequence[HookPoint], state: ForwardState) -> None:
        self.layer, self.block, self.state = layer, block, state
        self.points = tuple(points)

    def install(self) -> list[RemovableHandle]:
        return [self.block.register_forward_pre_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.state.block_shape[self.layer] = tuple(first_input(args, kwargs).shape[:-1])
