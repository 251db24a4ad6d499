"""Sites at a module's input or output, optionally viewed as heads; scaled and position embeddings; block shapes."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks.hook_point import HookPoint
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

    def __init__(self, module: nn.Module, point: HookPoint, heads: Optional[int] = None, protect: bool = False) -> None:
        self.module, self.point, self.heads, self.protect = module, point, heads, protect
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        shaped = split_heads(value, self.heads) if self.heads else value
        shaped, changed = self.point.apply(shaped, self.protect)
        if not changed:
            return None
        return replace_first_output(output, merge_heads(shaped) if self.heads else shaped)


class ScaledOutputSite(Site):
    """A module's output times a factor the model applies after the module (``ModelLayout.embed_scale``).

    Hooks see ``output * factor`` as the model computes it next (the factor as a tensor of the output's dtype);
    an edit goes back into the module's output as ``output + (edited - shown) / factor``, so that the model's
    own multiplication turns it into the edited value (up to one rounding) and an identity edit is bitwise.
    """

    def __init__(self, module: nn.Module, point: HookPoint, factor: float) -> None:
        self.module, self.point, self.factor = module, point, factor
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        value = first_output(output)
        shown = value * torch.tensor(self.factor, dtype=value.dtype)
        edited, changed = self.point.apply(shown, protect=True)
        if not changed:
            return None
        delta = (edited.float() - shown.float()) / self.factor
        return replace_first_output(output, (value.float() + delta).to(value.dtype))


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
