"""The generic adapter's sites: module inputs and outputs the model may write into later, and the attention function.

``attn.hook_attn_scores``, ``attn.hook_pattern`` and ``attn.hook_z`` are served through transformers' attention
interface, as the core serves patterns (:class:`lensadapters.attention.InterfacePatternBackend`): while one of a
layer's three points has a hook, the configuration selects the lensadapters attention function, which runs the
explicit attention for that layer when its scores or pattern are hooked (the model's own implementation otherwise)
and hands the output ``[b, p, h, d_head]`` to ``hook_z``; every other layer keeps the original implementation.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.errors import UnsupportedModelError
from lensadapters.hooks.attention import KEY_PREFIX, InterfacePatternBackend, original_function
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import Site, first_input, first_output, replace_first_input, replace_first_output

Tensor = torch.Tensor
SERVED_IMPLEMENTATIONS = ("eager", "sdpa")


class ModuleIOSite(Site):
    """A module's first input (``output=False``) or output as one hook point.

    ``copy``: the model writes into this tensor in place after producing it (the probe saw it), so while hooked the
    model continues with a copy and the value hooks saw (and caches hold) stays what it was.
    ``as_input``: the module returns its output with the leading dimensions merged (``[b * p, d]`` for an input
    ``[b, p, d]``, which the model views back before using it): the point serves it in its input's shape, and an
    edit goes back merged, exactly what the model continues with.
    """

    def __init__(
        self, module: nn.Module, point: HookPoint, output: bool = True, copy: bool = False, as_input: bool = False
    ) -> None:
        self.module, self.point, self.output, self.copy = module, point, output, copy
        self.as_input = as_input
        self.points = (point,)

    def install(self) -> list[RemovableHandle]:
        if self.output:
            return [self.module.register_forward_hook(self._on_output, with_kwargs=True)]
        return [self.module.register_forward_pre_hook(self._on_input, with_kwargs=True)]

    def _serve(self, value: Tensor) -> Optional[Tensor]:
        edited, changed = self.point.apply(value)
        if self.copy:
            return edited.clone()
        return edited if changed else None

    def _on_output(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        produced = first_output(output)
        if self.as_input:
            shape = first_input(args, kwargs).shape
            value = self._serve(produced.view(shape))
            value = None if value is None else value.reshape(produced.shape)
        else:
            value = self._serve(produced)
        return None if value is None else replace_first_output(output, value)

    def _on_input(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        value = self._serve(first_input(args, kwargs))
        return None if value is None else replace_first_input(args, kwargs, value)


class AttentionFunctionSite(Site):
    """``attn.hook_attn_scores``, ``attn.hook_pattern`` (when the model's patterns are served) and ``attn.hook_z`` of
    one layer, served by :class:`AttentionFunctionBackend`."""

    def __init__(
        self,
        layer: int,
        backend: "AttentionFunctionBackend",
        scores: Optional[HookPoint],
        pattern: Optional[HookPoint],
        z: HookPoint,
        copy_z: bool = False,
    ) -> None:
        self.layer, self.backend = layer, backend
        self.scores, self.pattern, self.z, self.copy_z = scores, pattern, z, copy_z
        self.points = tuple(p for p in (scores, pattern, z) if p is not None)

    def is_live(self) -> bool:
        """Whether a hook of this layer runs in the forward executing now."""
        return any(p.has_live_hooks() for p in self.points)

    def patterns_live(self) -> bool:
        return any(p is not None and p.has_live_hooks() for p in (self.scores, self.pattern))

    def install(self) -> list[Any]:
        return [self.backend.activate(self.layer, self)]


class AttentionFunctionBackend(InterfacePatternBackend):
    """The core's interface backend, extended to ``hook_z``: the attention function's output per head."""

    def __init__(self, config: Any, attention_modules: list[Optional[nn.Module]]) -> None:
        # only the layers that call the attention interface (a hybrid's linear-attention layers have no module):
        # the core's backend routes every module it holds, so it holds those; ``activate`` maps a layer to its slot
        present = [layer for layer, module in enumerate(attention_modules) if module is not None]
        self.present, self.slots = present, {layer: slot for slot, layer in enumerate(present)}
        modules = [attention_modules[layer] for layer in present]
        super().__init__(config, modules, lambda *args: None)  # scores: q·kᵀ·scaling (checked by the probe)

    def activate(self, layer: int, site: Any) -> Any:
        slot = self.slots[layer]
        implementation = self.config._attn_implementation or "eager"
        implementation = implementation[len(KEY_PREFIX) :] if implementation.startswith(KEY_PREFIX) else implementation
        if implementation not in SERVED_IMPLEMENTATIONS:  # hook_z too would run through a switched implementation
            return self.modules[slot].register_forward_pre_hook(_refuse(layer, implementation))
        return super().activate(slot, site)

    def _still_selected(self, slot: int) -> Callable[..., None]:
        return super()._still_selected(self.present[slot])  # its message names the model's layer, not the slot

    def attend(
        self,
        layer: int,
        site: AttentionFunctionSite,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        if site.patterns_live():
            output, weights = self.explicit(
                module, (query, key, value, attention_mask), site.scores, site.pattern, **kwargs
            )
        else:
            output, weights = original_function(self.original or "sdpa", module)(
                module, query, key, value, attention_mask, **kwargs
            )
        edited, changed = site.z.apply(output)
        return (edited.clone() if site.copy_z else edited), weights


def _refuse(layer: int, implementation: str) -> Callable[..., None]:
    def check(module: nn.Module, args: tuple) -> None:
        raise UnsupportedModelError(
            f"layer {layer}: attn.hook_z, hook_attn_scores and hook_pattern run through the eager or sdpa attention "
            f"implementation; this model uses {implementation!r}. Call model.set_attn_implementation('sdpa') before "
            f"adding these hooks, or leave them out: every other hook point works with {implementation!r}"
        )

    return check
