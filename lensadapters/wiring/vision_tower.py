"""The vision tower's residual points of a vision-language model, under the ``vision.`` prefix.

The tower is found from the model, naming no architecture: the submodule whose ``config`` is the model's
``config.vision_config``; its blocks are the tower's ``nn.ModuleList`` of ``vision_config.num_hidden_layers`` modules.
A probe forward of the tower alone, on a small synthetic image (``pixel_values`` of the shape its config gives),
proves each point before it is served:

- ``vision.hook_embed`` and ``vision.blocks.{i}.hook_resid_pre``: block ``i``'s first input (the patch embeddings as
  the first block reads them, for ``i == 0``);
- ``vision.blocks.{i}.hook_resid_post``: block ``i``'s first output, proven to be the next block's input (and, in the
  tower's ``hidden_states`` record, entry ``i + 1``), and an edit there proven to reach the next block, the record
  (transformers 5.x's LLaVA reads its selected layer from it) and the tower's output.

A tower whose forward needs inputs beyond ``pixel_values`` (an image grid, patch positions...) is refused by name
(:class:`VisionTowerWarning`), and so is any point the probe did not prove. The points fire only in a forward with
an image. No hook is installed until a ``vision.*`` point is hooked.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import InputSite, OutputSite

#: the prefix of the vision tower's points
PREFIX = "vision."
#: the condition under which the tower's points fire
FIRES_WHEN = "in a forward with images (pixel_values)"


class VisionTowerWarning(UserWarning):
    """The vision tower's points (or some of them) are not served; the message says why."""


def vision_tower(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The path and module of the vision tower: the submodule built from ``model.config.vision_config``."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is None:
        return None
    for name, module in model.named_modules():
        if module is not model and getattr(module, "config", None) is vision:
            return name, module
    return None


def tower_blocks(tower: nn.Module) -> Optional[tuple[str, nn.ModuleList]]:
    """The tower's blocks: its ``nn.ModuleList`` of ``num_hidden_layers`` modules of one class."""
    n = getattr(tower.config, "num_hidden_layers", None)
    for name, module in tower.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n and len({type(m) for m in module}) == 1:
            return name, module
    return None


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) else value


def _probe_pixels(tower: nn.Module) -> Optional[torch.Tensor]:
    config = tower.config
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", 3)
    if not isinstance(size, int):
        return None
    parameter = next(tower.parameters())
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, channels, size, size, generator=g).to(parameter.device, parameter.dtype)


def _required_inputs(tower: nn.Module) -> list[str]:
    """The tower's forward arguments with no default beyond ``pixel_values`` (``None`` when it takes none)."""
    parameters = inspect.signature(tower.forward).parameters
    if "pixel_values" not in parameters:
        return [next(iter(parameters), "?")]
    return [
        p.name
        for p in parameters.values()
        if p.name != "pixel_values"
        and p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _snapshot(tower: nn.Module) -> list[tuple[nn.Module, set[str], dict[str, set]]]:
    return [(m, set(vars(m)), {d: set(getattr(m, d, {})) for d in _HOOK_DICTS}) for m in tower.modules()]


def _restore(snapshot: list[tuple[nn.Module, set[str], dict[str, set]]]) -> None:
    """Undo what the probe's forwards left on the tower's modules: the forward hooks and attributes transformers
    adds the first time a forward records ``hidden_states`` (it would add them again in a forward that asks)."""
    for module, attributes, hooks in snapshot:
        for name in set(vars(module)) - attributes:
            delattr(module, name)
        for name, keys in hooks.items():
            table = getattr(module, name, {})
            for key in set(table) - keys:
                del table[key]


def _run(tower: nn.Module, blocks: nn.ModuleList, pixels: torch.Tensor, edit: Optional[int] = None) -> dict:
    """One probe forward: each block's first input and output, the tower's output and ``hidden_states``; with
    ``edit``, block ``edit``'s output is replaced by ``2 * output + 1`` by a hook placed as the site's is."""
    seen: dict[str, Any] = {"in": {}, "out": {}}
    handles: list[RemovableHandle] = []
    for i, block in enumerate(blocks):

        def pre(module: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            seen["in"][i] = (args[0] if args else next(iter(kwargs.values()))).clone()

        def post(module: nn.Module, args: tuple, output: Any, i: int = i) -> Any:
            value = _first(output)
            if i == edit:
                value = value * 2 + 1
                output = (value, *output[1:]) if isinstance(output, tuple) else value
            seen["out"][i] = value.clone()
            return output if i == edit else None

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, prepend=True))
    try:
        with torch.no_grad():
            result = tower(pixel_values=pixels, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    seen["hidden"] = getattr(result, "hidden_states", None)
    last = getattr(result, "last_hidden_state", None)
    seen["last"] = (_first(result) if last is None else last).clone()
    return seen


def probe(model: nn.Module) -> tuple[Optional[tuple[nn.Module, nn.ModuleList]], list[str]]:
    """The tower and its blocks when the probe proved their residual points, else ``None``; and the reasons of
    what is not served."""
    found = vision_tower(model)
    if found is None:
        return None, []
    path, tower = found
    blocks = tower_blocks(tower)
    if blocks is None:
        return None, [f"{path}: no list of its {getattr(tower.config, 'num_hidden_layers', '?')} blocks was found"]
    required = _required_inputs(tower)
    if required:
        return None, [f"{path}: its forward needs {', '.join(required)} besides pixel_values; the probe gives none"]
    pixels = _probe_pixels(tower)
    if pixels is None:
        return None, [f"{path}: its config gives no image_size for a probe image"]
    snapshot = _snapshot(tower)
    try:
        base = _run(tower, blocks[1], pixels)
        n = len(blocks[1])
        reasons = _check(base, n, path)
        if not reasons:
            for i in range(n):
                reasons += _check_edit(base, _run(tower, blocks[1], pixels, edit=i), i, n, path)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe refuses the points, naming it
        return None, [f"{path}: the probe forward failed ({type(exc).__name__}: {exc})"]
    finally:
        _restore(snapshot)
    return (None if reasons else (tower, blocks[1])), reasons


def _check(seen: dict, n: int, path: str) -> list[str]:
    if len(seen["in"]) != n or len(seen["out"]) != n:
        return [f"{path}: the probe forward did not run each block once"]
    hidden = seen["hidden"]
    for i in range(n - 1):
        if not torch.equal(seen["out"][i], seen["in"][i + 1]):
            return [f"{path}: block {i}'s output is not block {i + 1}'s input (not a residual stream)"]
    if hidden is not None and (len(hidden) != n + 1 or not torch.equal(hidden[0], seen["in"][0])):
        return [f"{path}: its hidden_states are not the blocks' inputs and outputs"]
    return []


def _check_edit(base: dict, edited: dict, i: int, n: int, path: str) -> list[str]:
    out = edited["out"][i]
    if i + 1 < n and not torch.equal(edited["in"][i + 1], out):
        return [f"{path}: an edit of block {i}'s output does not reach block {i + 1}"]
    hidden = edited["hidden"]
    if hidden is not None and not torch.equal(hidden[i + 1], out):
        return [f"{path}: an edit of block {i}'s output does not reach its hidden_states record"]
    if torch.equal(edited["last"], base["last"]):
        return [f"{path}: an edit of block {i}'s output does not change the tower's output"]
    return []


class PrependedOutputSite(OutputSite):
    """A block's output, by a forward hook that runs before the module's other forward hooks (transformers 5.x
    records ``hidden_states`` by a forward hook on each block: an edit must be what it records)."""

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook, prepend=True)]


def create_tower_points(wiring: Any, new: Callable[[str], HookPoint]) -> Optional[nn.ModuleList]:
    """Create the tower's points that the probe proves (before the projector's: the tower runs first); the blocks,
    or ``None`` (with a :class:`VisionTowerWarning` saying why where the model has a tower)."""
    proven, reasons = probe(wiring.hf_model)
    if reasons:
        warnings.warn(
            "the vision tower's points are not served: " + "; ".join(reasons), VisionTowerWarning, stacklevel=4
        )
    if proven is None:
        return None
    blocks = proven[1]
    new(PREFIX + "hook_embed").fires_when = FIRES_WHEN
    for i in range(len(blocks)):
        for name in ("hook_resid_pre", "hook_resid_post"):
            new(f"{PREFIX}blocks.{i}.{name}").fires_when = FIRES_WHEN
    return blocks


def build_tower_sites(wiring: Any, blocks: Optional[nn.ModuleList], core: Callable[[str], HookPoint]) -> None:
    """The sites of the points :func:`create_tower_points` created: a pre-hook on each block's first input (block
    0's ``hook_embed`` first, then its ``hook_resid_pre``) and a prepended forward hook on its first output."""
    if blocks is None:
        return
    wiring.add_site(InputSite(blocks[0], core(PREFIX + "hook_embed")))
    for i, block in enumerate(blocks):
        wiring.add_site(InputSite(block, core(f"{PREFIX}blocks.{i}.hook_resid_pre")))
        wiring.add_site(PrependedOutputSite(block, core(f"{PREFIX}blocks.{i}.hook_resid_post")))
