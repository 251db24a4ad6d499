"""A fused gate/up projection (``FusedGateUp``): ``mlp.hook_pre`` and ``mlp.hook_pre_linear`` from one output."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites.base import Site, first_output, replace_first_output
from lensadapters.hooks.specs import FusedGateUp


class FusedGateUpSite(Site):
    """``mlp.hook_pre`` (the gate) and ``mlp.hook_pre_linear`` (the up projection) split from one projection's
    output with the layout's ``split``, re-fused with ``merge`` after an edit."""

    def __init__(
        self, module: nn.Module, layout: FusedGateUp, pre: Optional[HookPoint], pre_linear: Optional[HookPoint]
    ) -> None:
        self.module, self.layout, self.pre, self.pre_linear = module, layout, pre, pre_linear
        self.points = tuple(p for p in (pre, pre_linear) if p is not None)

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook)]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        gate, up = self.layout.split(first_output(output))
        changed = False
        if self.pre is not None and self.pre.active:
            gate, changed = self.pre.apply(gate)
        if self.pre_linear is not None and self.pre_linear.active:
            up, up_changed = self.pre_linear.apply(up)
            changed = changed or up_changed
        if not changed:
            return None
        return replace_first_output(output, self.layout.merge(gate, up))
