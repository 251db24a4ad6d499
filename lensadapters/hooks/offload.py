"""Parameters of modules that accelerate offloads (``device_map`` with CPU or disk offload).

accelerate keeps an offloaded module's parameters on the ``meta`` device and loads them only around
the module's own forward. lensadapters reads parameters at other times — weight accessors, and hook
points computed from weights (``attn.hook_result``, norm edits) run after the module's forward — so
every such read goes through :func:`live_parameters`, which loads the weights of that one module for
the duration of the read (accelerate's ``align_module_device``). Nothing happens for modules that are
not offloaded, or when accelerate was never imported. The same reads gather FSDP2's sharded parameters
(:func:`lensadapters.distributed.gathered_parameters`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from torch import nn

from lensadapters.hooks.distributed import gathered_parameters


@contextlib.contextmanager
def live_parameters(module: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``module``'s own parameters hold their values even if accelerate offloads them (and its
    FSDP2-sharded parameters are whole).

    Tensors read inside the block stay valid after it (they keep the loaded storage alive); the module
    itself goes back to its offloaded state. Read one module at a time: the point of offloading is that
    the whole model does not fit.
    """
    with gathered_parameters(module):  # FSDP2's sharded parameters, whole for the read
        hook = getattr(module, "_hf_hook", None)
        utils = sys.modules.get("accelerate.utils")
        if hook is None or utils is None or not getattr(hook, "offload", False):
            yield module
            return
        with utils.align_module_device(module):
            yield module
