"""What lensadapters needs from ``torch.distributed``: sharded parameters and the process's place in a job.

Nothing here launches or coordinates processes: torchrun, accelerate and the HF Trainer do that. This module reads
what they set up (an initialized process group, or the ``RANK``/``WORLD_SIZE`` environment variables of a launcher),
and gathers FSDP2's sharded ``DTensor`` parameters when a weight is read outside the model's forward.

Gathering is a collective: under FSDP2 every rank must read the same weights in the same order (as every rank runs
the same forward), or the job waits forever.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Optional

import torch
from torch import nn

Tensor = torch.Tensor


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's sharded parameters are)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def full_tensor(value: Any) -> Any:
    """The whole tensor of a ``DTensor`` (gathered from every rank; differentiable); anything else as it is."""
    return value.full_tensor() if is_dtensor(value) else value


@contextlib.contextmanager
def gathered_parameters(module: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every ``DTensor`` parameter of ``module`` (and its submodules) is its whole tensor.

    Outside a forward, FSDP2 keeps each rank's shard of a parameter as a ``DTensor``; the weight accessors and the
    core's norm checks read whole matrices. The gathered tensors stay valid after the block; the module gets its
    sharded parameters back on exit, as FSDP2 left them. Without ``DTensor`` parameters nothing happens.
    """
    swapped: list[tuple[nn.Module, str, Tensor]] = []
    if "torch.distributed.tensor" in sys.modules:
        for owner in module.modules():
            for name, parameter in list(owner._parameters.items()):
                if parameter is not None and is_dtensor(parameter):
                    swapped.append((owner, name, parameter))
    if not swapped:
        yield module
        return
    try:
        for owner, name, shard in swapped:
            owner._parameters[name] = shard.full_tensor()  # type: ignore[attr-defined]
        yield module
    finally:
        for owner, name, shard in swapped:
            owner._parameters[name] = shard  # type: ignore[assignment]


# --- the process's place in a job ----------------------------------------------------------------------------


def process_group_ready() -> bool:
    """Whether ``torch.distributed`` is available and its default process group is initialized."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def launch_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: the initialized process group's, else the launcher's environment
    (``RANK``/``WORLD_SIZE``, set by torchrun and by ``accelerate launch``), else ``(0, 1)``."""
    if process_group_ready():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    rank, world_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world_size is None:
        return 0, 1
    try:
        return int(rank), int(world_size)
    except ValueError:
        raise ValueError(
            f"RANK={rank!r} and WORLD_SIZE={world_size!r} must be integers (as launchers set them)"
        ) from None


def is_main_process() -> bool:
    """Rank 0 (or the only process)."""
    return launch_rank()[0] == 0


def barrier(world_size: Optional[int] = None) -> bool:
    """Wait for every rank when a process group of ``world_size`` processes (any, when ``None``) is initialized;
    returns whether it waited."""
    if not process_group_ready():
        return False
    if world_size is not None and torch.distributed.get_world_size() != world_size:
        return False
    torch.distributed.barrier()
    return True


def local_device() -> torch.device:
    """This process's accelerator under a launcher (``cuda:LOCAL_RANK``), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# --- FSDP2's forward hooks stay outermost -------------------------------------------------------------------------


def _fsdp_handles(module: nn.Module) -> Optional[tuple[Any, Any]]:
    """FSDP2's pre- and post-forward hook handles on ``module`` (a module given to ``fully_shard``), or ``None``."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None or not isinstance(module, fsdp_module):
        return None
    state = module._get_fsdp_state()
    return getattr(state, "_pre_forward_hook_handle", None), getattr(state, "_post_forward_hook_handle", None)


def _any_module_sharded() -> bool:
    """Whether any module of this process was given to ``fully_shard`` (torch's registry of composable states, a
    private name: without it, assume so and walk the model). Transformers and accelerate import FSDP2 in every
    process, so without this look-up every hook installation would walk every module of an unsharded model."""
    composable = sys.modules.get("torch.distributed._composable_state")
    mapping = getattr(composable, "_module_state_mapping", None)
    if mapping is None:
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    return fsdp_module is None or any(isinstance(module, fsdp_module) for module in list(mapping.keys()))


class FsdpHookOrder:
    """Keeps FSDP2's own forward hooks around every hook lensadapters adds to a ``fully_shard`` module.

    FSDP2 gathers a module's parameters in a forward pre-hook it puts first, and in a forward hook it puts last
    frees them and marks the module's outputs, so that backward gathers them again. A hook point that edits a
    block's output from a hook added after ``fully_shard`` would run after that hook: its new output would carry
    no such mark, and backward would find the parameters freed. After lensadapters installs hooks, FSDP2's are
    moved back to the ends (``outermost``); ``restore`` puts every module's hooks back in their order before.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._saved: dict[nn.Module, tuple[Any, Any, list[int], list[int]]] = {}

    def outermost(self) -> None:
        """Move FSDP2's hooks to the ends (on modules sharded before or after wrapping)."""
        if "torch.distributed.fsdp" not in sys.modules or not (self._saved or _any_module_sharded()):
            return
        for module in self._model.modules():
            if module not in self._saved:
                handles = _fsdp_handles(module)
                if handles is None:
                    continue
                self._saved[module] = (*handles, list(module._forward_pre_hooks), list(module._forward_hooks))
            pre, post, _, _ = self._saved[module]
            if getattr(pre, "id", None) in module._forward_pre_hooks:
                module._forward_pre_hooks.move_to_end(pre.id, last=False)  # type: ignore[attr-defined]
            if getattr(post, "id", None) in module._forward_hooks:
                module._forward_hooks.move_to_end(post.id)  # type: ignore[attr-defined]

    def restore(self) -> None:
        for module, (_, _, pre_order, post_order) in self._saved.items():
            _reorder(module._forward_pre_hooks, pre_order)
            _reorder(module._forward_hooks, post_order)


def _reorder(hooks: Any, order: list[int]) -> None:
    """The keys of ``hooks`` that ``order`` lists in that order, then the others as they were."""
    rank = {key: i for i, key in enumerate(order)}
    for key in sorted((k for k in hooks if k in rank), key=rank.__getitem__) + [k for k in hooks if k not in rank]:
        hooks.move_to_end(key)
