"""Sites for the LoRA-delta hook points, and a guard against modules replaced after wrapping."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters import LensAdaptersError
from lensadapters.hook_point import HookPoint
from lensadapters.sites import Site, first_input, first_output, replace_first_output

from . import _lora

Tensor = torch.Tensor
Split = Callable[[Tensor], Sequence[Tensor]]
Merge = Callable[..., Tensor]


def _is_plain_lora_linear(module: nn.Module) -> bool:
    """PEFT's ``lora.Linear`` adds the delta in the adapter's dtype; its quantized siblings cast it first."""
    layer_mod = sys.modules.get("peft.tuners.lora.layer")
    return layer_mod is not None and type(module) is getattr(layer_mod, "Linear", None)


class LoraDeltaSite(Site):
    """The LoRA contribution of one adapted projection, split like the projection's output.

    The delta is what PEFT adds to the base layer's output: ``sum_a lora_B[a](lora_A[a](dropout(x))) *
    scaling[a]`` over the active adapters. It is read exactly: forward hooks capture (a copy of) the base
    layer's output and each ``lora_B[a]``'s output as PEFT computed them (dropout included), and the site's hook
    on the LoRA layer multiplies by ``scaling`` as PEFT does. After an edit the projection output is
    ``base_out + edited_delta`` (cast to the output dtype as PEFT does), so unedited entries keep
    PEFT's exact values.

    The hook on the LoRA layer is prepended, so it runs before the core's ``hook_q``/``hook_z``...
    sites on the same module whatever order hooks were added in: those see the edited output.

    Other states: adapters disabled — the delta is zero and an edit adds to the base output; adapters
    merged — the base output already contains the delta, which is recomputed from the input without
    dropout (``lora_B(lora_A(x)) * scaling``) and an edit changes the output by ``edited - delta``
    (equal to the unmerged computation within rounding); LoRA variants (DoRA...) and mixed-adapter
    batches (``adapter_names=``) — the delta is ``output - base_out`` (within rounding).
    """

    def __init__(self, module: nn.Module, points: Sequence[Optional[HookPoint]], split: Split, merge: Merge) -> None:
        self.module = module
        self.slots = tuple(points)
        self.points = tuple(p for p in points if p is not None)
        self.split, self.merge = split, merge
        self._base: Optional[Tensor] = None
        self._lora_out: dict[str, Tensor] = {}

    def install(self) -> list[RemovableHandle]:
        m = self.module
        handles = [m.base_layer.register_forward_hook(self._capture_base)]
        for name, lora_B in m.lora_B.items():
            handles.append(lora_B.register_forward_hook(self._capture_lora(name)))
        handles.append(m.register_forward_hook(self._hook, with_kwargs=True, prepend=True))
        return handles

    def _capture_base(self, module: nn.Module, args: tuple, output: Any) -> None:
        # a copy: several PEFT paths add the delta into the base output in place (mixed-adapter batches,
        # AQLM, some variants)
        self._base = first_output(output).clone()

    def _capture_lora(self, name: str) -> Callable[..., None]:
        def capture(module: nn.Module, args: tuple, output: Tensor) -> None:
            self._lora_out[name] = output

        return capture

    def _delta(self, module: nn.Module, x: Tensor, out: Tensor, kwargs: dict,
               base: Optional[Tensor], lora_out: dict[str, Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """``(delta, base_out)``; ``base_out`` is ``None`` when only ``out - delta`` is known (merged)."""
        state, adapters = _lora.contributing_adapters(module)
        if state == "disabled":
            return torch.zeros_like(out), out
        if state == "merged":
            delta: Optional[Tensor] = None
            for a in adapters:
                if _lora.is_variant(module, a):
                    raise LensAdaptersError(
                        f"the LoRA delta of merged variant adapter {a!r} (DoRA...) cannot be separated from the "
                        f"merged weight; unmerge the adapter (unmerge_adapter()) to hook it")
                d = _lora.recompute_delta(module, a, x, dropout=False)
                delta = d if delta is None else delta + d
            return (delta if delta is not None else torch.zeros_like(out)), None
        if base is None:
            raise RuntimeError("lensadapters-peft: the LoRA layer's base layer did not run in this forward pass")
        vanilla = kwargs.get("adapter_names") is None and not any(_lora.is_variant(module, a) for a in adapters)
        if not vanilla:
            return out - base, base
        cast = not _is_plain_lora_linear(module) and not torch.is_autocast_enabled()
        delta = None
        for a in adapters:
            y = lora_out.get(a)
            if y is None:  # adapter added after the site was installed: recompute (exact without dropout)
                d = _lora.recompute_delta(module, a, x, dropout=True)
            else:
                d = y * module.scaling[a]
            if cast:
                d = d.to(base.dtype)
            delta = d if delta is None else delta + d
        return (delta if delta is not None else torch.zeros_like(out)), base

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        base, self._base = self._base, None
        lora_out, self._lora_out = self._lora_out, {}
        out = first_output(output)
        delta, base_out = self._delta(module, first_input(args, kwargs), out, kwargs, base, lora_out)
        self._lora_out = {}  # a recomputation above may have run lora_B again
        parts = list(self.split(delta))
        changed = False
        for i, point in enumerate(self.slots):
            if point is None or not point.active:
                continue
            parts[i], part_changed = point.apply(parts[i], protect=True)  # the delta is needed as computed
            changed = changed or part_changed
        if not changed:
            return None
        edited = self.merge(*parts)
        new = base_out + edited if base_out is not None else out + (edited - delta)
        return replace_first_output(output, new.to(out.dtype))


class ModuleGuardSite(Site):
    """Refuses to run hooks on modules that were replaced after wrapping.

    PEFT replaces a layer by its LoRA wrapper when an adapter targeting a new module is added
    (``get_peft_model`` after wrapping, ``add_adapter``/``load_adapter`` with other target modules) and
    puts the base layers back on ``merge_and_unload()``/``unload()``. The core's sites stay on the old
    module objects and would silently hook the wrong place, so while any hook is attached a pre-hook
    on the model checks every layout path and raises a clear error.
    """

    def __init__(self, hooked: Any, points: Sequence[HookPoint]) -> None:
        self.hooked = hooked
        self.points = tuple(points)
        self.expected: list[tuple[nn.Module, str, nn.Module]] = []
        model = hooked.hf_model
        L = hooked.layout
        for path in (L.embed, L.pos_embed, L.unembed, L.ln_final, L.rotary):
            if path:
                self.expected.append((model, path, model.get_submodule(path)))
        for block, bl, qkv, mlp in zip(hooked.block_modules, hooked.block_layouts, hooked.qkv_layouts, hooked.mlp_layouts):
            paths = [bl.ln1, bl.attn, bl.o_proj, bl.ln2, bl.mlp, getattr(bl, "ln1_post", None),
                     getattr(bl, "ln2_post", None), mlp.out]
            paths += [mlp.module] if hasattr(mlp, "module") else [mlp.pre, mlp.pre_linear]
            paths += [qkv.module] if hasattr(qkv, "module") else [qkv.q, qkv.k, qkv.v]
            paths += [norm.module for norm in (getattr(qkv, "q_norm", None), getattr(qkv, "k_norm", None)) if norm]
            for path in paths:
                if path:
                    self.expected.append((block, path, block.get_submodule(path)))
        # every parent -> child link on those paths, checked per forward with one dict lookup each
        links: dict[tuple[int, str], tuple[nn.Module, str, nn.Module]] = {}
        self.slow: list[tuple[nn.Module, str, nn.Module]] = []
        for owner, path, expected in self.expected:
            parent = owner
            for name in path.split("."):
                child = parent._modules.get(name)
                if child is None:  # reached through an attribute that is not a registered submodule
                    self.slow.append((owner, path, expected))
                    break
                links[(id(parent), name)] = (parent, name, child)
                parent = child
        self.links = list(links.values())

    def wanted(self) -> bool:
        return self.hooked.has_hooks  # O(1): this site's points are all of the model's

    def install(self) -> list[RemovableHandle]:
        return [self.hooked.hf_model.register_forward_pre_hook(self._check)]

    def _check(self, module: nn.Module, args: tuple) -> None:
        if all(parent._modules.get(name) is child for parent, name, child in self.links):
            self._raise_if_replaced(self.slow)
            return
        self._raise_if_replaced(self.expected)

    def _raise_if_replaced(self, expected_modules: list[tuple[nn.Module, str, nn.Module]]) -> None:
        for owner, path, expected in expected_modules:
            try:
                current = owner.get_submodule(path)
            except AttributeError:
                current = None
            if current is not expected:
                where = self.hooked.module_name(owner)
                raise LensAdaptersError(
                    f"module {path!r} of {where} was replaced after HookedModel.wrap (it was "
                    f"{type(expected).__name__}, it is now {type(current).__name__}): PEFT does this when an adapter "
                    f"targeting new modules is added, or on merge_and_unload()/unload(). Hooks would land on the old "
                    f"module; call hm.unwrap() and HookedModel.wrap(model) again.")
