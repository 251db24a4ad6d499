"""``hook_scale`` and ``hook_normalized`` of LayerNorm and RMSNorm modules."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import norms
from ..hook_point import HookPoint
from ..specs import NormSpec
from .base import Site, first_input, first_output, replace_first_output


class NormSite(Site):
    """``hook_scale`` and ``hook_normalized`` of a LayerNorm/RMSNorm; an edited scale is used by the norm."""

    def __init__(self, module: nn.Module, spec: Callable[[], NormSpec], scale: HookPoint,
                 normalized: HookPoint) -> None:
        self.module, self.spec = module, spec
        self.scale, self.normalized = scale, normalized
        self.points = (scale, normalized)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook, with_kwargs=True)]

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        # Edits enter as the difference they make to the norm's own output, so that whatever a hook left as it
        # was keeps the model's exact numbers (an identity edit is bitwise; the written-out norm is not).
        x = first_input(args, kwargs)
        out = first_output(output)
        spec = self.spec()
        scale = edited_scale = None
        scale_changed = False
        if self.scale.active or spec.kind == "RMS" and self.normalized.active:
            scale = edited_scale = norms.scale(x, spec)
            if self.scale.active:
                edited_scale, scale_changed = self.scale.apply(scale, protect=True)
        if not (self.normalized.active or scale_changed):
            return None
        if spec.kind == "LN":  # hook_normalized is the norm's output itself
            normalized = out
            if scale_changed:
                delta = norms.layer_norm(x, spec, edited_scale).float() - norms.layer_norm(x, spec, scale).float()
                normalized = (out.float() + delta).to(out.dtype)
            normalized, norm_changed = self.normalized.apply(normalized)
            if not (scale_changed or norm_changed):
                return None
            return replace_first_output(output, normalized.to(out.dtype))
        base = norms.rms_normalized(x, scale)  # RMSNorm: hook_normalized is before the weight
        normalized = norms.rms_normalized(x, edited_scale) if scale_changed else base
        normalized, norm_changed = self.normalized.apply(normalized, protect=True)
        if not (scale_changed or norm_changed):
            return None
        delta = norms.rms_weighted_delta(normalized.float() - base.float(), spec)
        return replace_first_output(output, (out.float() + delta).to(out.dtype))
