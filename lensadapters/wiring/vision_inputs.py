"""The inputs of the vision tower's probe forward: what the tower's forward needs, built from its config.

Choice: a small table of recognised arguments (:data:`BUILDERS`), keyed by the argument's name in the tower's
``forward`` signature, each built from the tower's config alone (no architecture is named):

- ``pixel_position_ids``: one image's patches' (x, y) positions, a square of ``2 * pooling_kernel_size`` patches
  a side (1 where the config gives no pooling), row by row; ``position_embedding_size`` must hold them;
- ``pixel_values``: one image of ``num_channels x image_size x image_size`` (``image_size`` required); with
  ``pixel_position_ids``, that image as its patches, one row of ``num_channels * patch_size ** 2`` pixels in
  ``(0, 1)`` per position;
- ``grid_thw``: two images' grids of patches, ``[[1, 2 * m, 2 * m], [1, 2 * m, 4 * m]]`` for a
  ``spatial_merge_size`` ``m`` (1 where the config gives none): the smallest grid a tower merging its patches
  ``m x m`` merges into more than one token, and one twice as wide. Two images of different sizes: a tower that
  attends image by image (``cu_seqlens``) calls its attention function once per image in the probe, and the
  attention probe (:mod:`lensadapters.wiring.vision_attention`) sees the sequence's blocks;
- ``hidden_states`` (the tower's first argument, only with a ``grid_thw``): the grid's patches flattened, one row
  of ``in_channels * temporal_patch_size * patch_size ** 2`` features per patch (``in_channels`` or
  ``num_channels``, 3 where neither is given; ``temporal_patch_size`` 1 where none is).

A required argument (no default) of the tower's forward that the table does not know, or whose config fields are
missing, refuses the probe by name. Arguments with a default are left to the tower. The values are random (seeded)
in the tower's dtype and on its device; the grid is an integer tensor.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

#: the tower's patch grid argument, a tensor ``[images, 3]`` of (frames, height, width) in patches
GRID = "grid_thw"
#: the tower's per-patch positions argument, a tensor ``[images, patches, 2]`` of (x, y) in patches
POSITIONS = "pixel_position_ids"


def _random(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g).to(like.device, like.dtype)


def _positions(config: Any, built: dict[str, Any], like: torch.Tensor) -> Optional[torch.Tensor]:
    pool = getattr(config, "pooling_kernel_size", None) or 1
    table = getattr(config, "position_embedding_size", None)
    side = 2 * pool
    if not isinstance(pool, int) or not isinstance(table, int) or side > table:
        return None
    xy = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1)
    return xy.reshape(1, side * side, 2).to(like.device)


def _pixels(config: Any, built: dict[str, Any], like: torch.Tensor) -> Optional[torch.Tensor]:
    positions, patch = built.get(POSITIONS), getattr(config, "patch_size", None)
    if positions is not None:  # the image as its patches, one row of channels x patch x patch pixels each
        if not isinstance(patch, int):
            return None
        return _random((1, positions.shape[1], getattr(config, "num_channels", 3) * patch**2), like).sigmoid()
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", 3)
    if not isinstance(size, int):
        return None
    return _random((1, channels, size, size), like)


def _grid(config: Any, built: dict[str, Any], like: torch.Tensor) -> Optional[torch.Tensor]:
    merge = getattr(config, "spatial_merge_size", None) or 1
    if not isinstance(merge, int):
        return None
    return torch.tensor([[1, 2 * merge, 2 * merge], [1, 2 * merge, 4 * merge]], device=like.device)


def _patches(config: Any, built: dict[str, Any], like: torch.Tensor) -> Optional[torch.Tensor]:
    grid, patch = built.get(GRID), getattr(config, "patch_size", None)
    if grid is None or not isinstance(patch, int):
        return None
    channels = getattr(config, "in_channels", None) or getattr(config, "num_channels", None) or 3
    temporal = getattr(config, "temporal_patch_size", None) or 1
    n = int(grid.prod(-1).sum())
    return _random((n, channels * temporal * patch**2), like)


#: the recognised arguments and their builders, in the order they are built (a builder may read what an earlier
#: one built: the flattened patches read the grid)
BUILDERS: dict[str, Callable[[Any, dict[str, Any], torch.Tensor], Optional[torch.Tensor]]] = {
    POSITIONS: _positions,
    "pixel_values": _pixels,
    GRID: _grid,
    "hidden_states": _patches,
}
#: what each builder needs of the config, for the refusal's message
NEEDS = {
    POSITIONS: "position_embedding_size of at least twice its pooling_kernel_size",
    "pixel_values": "image_size (patch_size with pixel_position_ids)",
    GRID: "spatial_merge_size",
    "hidden_states": "a grid_thw and patch_size",
}


def required_inputs(tower: nn.Module) -> list[str]:
    """The tower's forward arguments without a default (positional or keyword)."""
    parameters = inspect.signature(tower.forward).parameters.values()
    return [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def probe_inputs(tower: nn.Module) -> tuple[Optional[dict[str, torch.Tensor]], Optional[str]]:
    """The keyword arguments of a probe forward of ``tower`` (its required ones, or ``pixel_values`` where it takes
    them and requires nothing else), or ``None`` and why (naming the arguments)."""
    parameters = inspect.signature(tower.forward).parameters
    wanted = required_inputs(tower)
    if "pixel_values" in parameters and "pixel_values" not in wanted:
        wanted = ["pixel_values", *wanted]
    if not wanted:
        return None, "its forward takes neither pixel_values nor a required input"
    unknown = [name for name in wanted if name not in BUILDERS]
    if unknown:
        return None, f"its forward needs {', '.join(unknown)}, which the probe cannot build"
    if "hidden_states" in wanted and GRID not in wanted:
        return None, "its forward needs hidden_states without a grid_thw, which the probe cannot build"
    like = next(tower.parameters())
    built: dict[str, Any] = {}
    for name, build in BUILDERS.items():
        if name in wanted:
            value = build(tower.config, built, like)
            if value is None:
                return None, f"its config gives no {NEEDS[name]} for the probe's {name}"
            built[name] = value
    return built, None
