"""Per-forward plumbing of a wiring: the frame site (per-forward state) and the lazy pattern backend."""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from lensadapters.errors import LensAdaptersError
from lensadapters.hooks.frames import tag_for_recompute
from lensadapters.hooks.hook_point import is_recomputing
from lensadapters.hooks.sites import (
    Site,
    first_input,
    first_output,
    replace_first_input,
    replace_first_output,
)

Tensor = torch.Tensor


def _installed(ref: "weakref.ref[Any]") -> bool:
    wiring = ref()
    return wiring is not None and bool(wiring._installed)


class _FrameSite(Site):
    """Opens a frame (:mod:`lensadapters.frames`) around every forward of the model while any site is installed,
    and tags the output of each block for gradient-checkpoint recomputation when the forward may be recomputed."""

    def __init__(self, wiring: Any) -> None:  # the Wiring (core.py) it belongs to
        self.wiring = wiring
        self.points = tuple(wiring.hook_dict.values())

    def wanted(self) -> bool:
        return self.wiring.has_hooks

    def install(self) -> list[Any]:
        model = self.wiring.hf_model
        handles = [
            model.register_forward_pre_hook(self._open, with_kwargs=True),
            model.register_forward_hook(self._close, always_call=True),
        ]
        for block in self.wiring.block_modules:
            handles.append(block.register_forward_hook(self._tag))
        # where the hidden states leave the blocks: reentrant checkpointing runs the blocks' own hooks without
        # gradients, so the graph is tagged here too (before the final norm, or the unembedding)
        exit_path = self.wiring.layout.ln_final or self.wiring.layout.unembed
        if exit_path:
            handles.append(model.get_submodule(exit_path).register_forward_pre_hook(self._tag_input, with_kwargs=True))
        return handles

    def _open(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        wiring = self.wiring
        if module is not wiring.hf_model:
            raise LensAdaptersError(
                f"a copy of the wrapped {type(module).__name__} ran (torch.nn.DataParallel replicates the model into "
                f"worker threads) while lensadapters hooks were attached: hook points and caches belong to the wrapped "
                f"model itself. Use DistributedDataParallel (one process per device) or run the model unreplicated"
            )
        frame = wiring.forward_state.push()  # popped by _close even if what follows raises
        wiring.guard.check()
        frame.token = wiring._recompute_token()
        return wiring._given_embeddings(args, kwargs)

    def _close(self, module: nn.Module, args: tuple, output: Any) -> None:
        if module is self.wiring.hf_model:
            self.wiring.forward_state.pop()

    def _tagged(self, hidden: Any, exit: bool = False) -> Optional[torch.Tensor]:
        token = self.wiring.forward_state.frame.token
        if (
            token is None
            or not torch.is_grad_enabled()
            or is_recomputing()
            or not isinstance(hidden, torch.Tensor)
            or not hidden.requires_grad
        ):
            return None
        return tag_for_recompute(hidden, token, exit)

    def _tag(self, module: nn.Module, args: tuple, output: Any) -> Any:
        tagged = self._tagged(first_output(output))
        return None if tagged is None else replace_first_output(output, tagged)

    def _tag_input(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        tagged = self._tagged(first_input(args, kwargs), exit=True)  # outside any checkpointed region
        return None if tagged is None else replace_first_input(args, kwargs, tagged)


class _LazyBackend:
    """Creates the pattern backend on first use, so wrapping costs nothing until patterns are hooked."""

    def __init__(self, wiring: Any) -> None:  # the Wiring (core.py) it belongs to
        self.wiring = wiring

    def activate(self, layer: int, site: Any) -> Any:
        return self.wiring.pattern_backend.activate(layer, site)
