"""``hook_scale`` and ``hook_normalized`` of LayerNorm and RMSNorm modules."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.errors import LensAdaptersError
from lensadapters.hooks import norms
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites.base import (
    ForwardState,
    Site,
    completes_output,
    first_input,
    first_output,
    plus_delta,
    reads_output,
    replace_first_output,
)
from lensadapters.hooks.specs import NormSpec

Tensor = torch.Tensor
View = Callable[[Tensor], Tensor]


class NormSite(Site):
    """``hook_scale`` and ``hook_normalized`` of a LayerNorm/RMSNorm; an edited scale is used by the norm.

    ``view`` (with its inverse ``unview``) shows the norm's tensors to hooks in another layout than the module
    sees them (a per-head query norm that runs on ``[b, heads, p, d]`` is shown as ``[b, p, heads, d]``).

    Its PyTorch hook completes the norm's output (:func:`~lensadapters.hooks.sites.base.completes_output`):
    whatever else watches the norm's output (a post norm's output is ``hook_attn_out``; a query norm's output is
    rotated into ``hook_rot_q``; a plugin's own point) sees it with the norm's edits, whatever order the hooks were
    attached in.

    ``after`` (with ``state``): the norm module also runs elsewhere in the forward
    (``ModelLayout.ln_final_after_blocks``): the points are served on its first call after the module ``after`` (the
    last block) ran, and no other.
    """

    def __init__(
        self,
        module: nn.Module,
        spec: Callable[[], NormSpec],
        scale: HookPoint,
        normalized: HookPoint,
        view: Optional[View] = None,
        unview: Optional[View] = None,
        after: Optional[nn.Module] = None,
        state: Optional[ForwardState] = None,
    ) -> None:
        self.after, self.state = after, state
        self.module, self.spec = module, spec
        self.scale, self.normalized = scale, normalized
        self.points = (scale, normalized)
        self.view, self.unview = view, unview

    def install(self) -> list[RemovableHandle]:
        handles = [completes_output(self.module, self._hook, with_kwargs=True)]
        if self.after is not None:
            handles.append(reads_output(self.after, self._ran))
        return handles

    def _ran(self, module: nn.Module, args: tuple, output: Any) -> None:
        assert self.state is not None
        self.state.site_values(self)["after"] = tuple(first_output(output).shape)

    def _this_call(self, x: Tensor) -> bool:
        """Whether this call of the norm is the one the points are (``after``: the first after the last block)."""
        if self.after is None or self.state is None:
            return True
        shape = self.state.site_values(self).pop("after", None)
        if shape is None:  # a call before the last block ran (the embeddings' norm) or a forward ended early
            return False
        if tuple(x.shape) != shape:
            raise LensAdaptersError(
                f"ln_final: the first call of the final norm after the last block reads a tensor of shape "
                f"{tuple(x.shape)}, not the last block's output ({shape}), which ModelLayout.ln_final_after_blocks "
                f"describes: the description does not fit this model"
            )
        return True

    def _apply(self, point: HookPoint, value: Tensor, protect: bool = False) -> tuple[Tensor, bool]:
        if self.view is None:
            return point.apply(value, protect)
        shown, changed = point.apply(self.view(value), protect)
        return (self.unview(shown) if changed else value), changed

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        # Edits enter as the difference they make to the norm's own output, so that whatever a hook left as it
        # was keeps the model's exact numbers (an identity edit is bitwise; the written-out norm is not).
        x = first_input(args, kwargs)
        if not self._this_call(x):
            return None
        out = first_output(output)
        spec = self.spec()
        scale = edited_scale = None
        scale_changed = False
        if self.scale.active or spec.kind == "RMS" and self.normalized.active:
            scale = edited_scale = norms.scale(x, spec)
            if self.scale.active:
                edited_scale, scale_changed = self._apply(self.scale, scale, protect=True)
        if not (self.normalized.active or scale_changed):
            return None
        if spec.kind == "LN":  # hook_normalized is the norm's output itself
            normalized = out
            if scale_changed:
                delta = norms.layer_norm(x, spec, edited_scale).float() - norms.layer_norm(x, spec, scale).float()
                normalized = plus_delta(out, delta)
            normalized, norm_changed = self._apply(self.normalized, normalized)
            if not (scale_changed or norm_changed):
                return None
            return replace_first_output(output, normalized.to(out.dtype))
        base = norms.rms_normalized(x, scale)  # RMSNorm: hook_normalized is before the weight
        normalized = norms.rms_normalized(x, edited_scale) if scale_changed else base
        normalized, norm_changed = self._apply(self.normalized, normalized, protect=True)
        if not (scale_changed or norm_changed):
            return None
        delta = norms.rms_weighted_delta(normalized.float() - base.float(), spec)
        return replace_first_output(output, plus_delta(out, delta))
