"""The vision tower's residual points of a vision-language model, under the ``vision.`` prefix.

The tower is found from the model, naming no architecture: the submodule whose ``config`` is the model's
``config.vision_config``; its blocks are the tower's ``nn.ModuleList`` of ``vision_config.num_hidden_layers`` (or
``depth``) modules.
A probe forward of the tower alone, on a small synthetic image (``pixel_values`` of the shape its config gives, or
what else the tower's forward requires and :mod:`lensadapters.wiring.vision_inputs` builds from its config: Qwen's
flattened patches and their ``grid_thw``), proves each point before it is served:

- ``vision.hook_embed`` and ``vision.blocks.{i}.hook_resid_pre``: block ``i``'s first input (the patch embeddings as
  the first block reads them, for ``i == 0``);
- ``vision.blocks.{i}.hook_resid_post``: block ``i``'s first output, proven to be the next block's input (and, in the
  tower's ``hidden_states`` record, entry ``i + 1``), and an edit there proven to reach the next block, the record
  (transformers 5.x's LLaVA reads its selected layer from it) and the tower's output;
- ``vision.blocks.{i}.hook_attn_out``, ``hook_resid_mid``, ``hook_mlp_in``, ``hook_mlp_out`` and
  ``ln1``/``ln2.hook_scale`` and ``hook_normalized``: the outputs of the block's attention and MLP children, the
  input of its MLP's norm and its norms' scale and normalized values as TransformerLens defines them for the norm's
  kind (the core's ``NormSite``, where the norm's ``NormSpec`` is known: a LayerNorm's ``hook_normalized`` is its
  output, after the weight and bias; an RMSNorm's, Pixtral's, Qwen2.5-VL's and Gemma 4's, ``x / scale``, before the
  weight; where it is not known, a plain ``nn.LayerNorm``'s output is still its ``hook_normalized`` and any other
  norm's points are refused by name), the children as :mod:`lensadapters.wiring.vision_parts` finds them from the
  probe's values
  (``resid_mid == resid_pre + attn_out``, ``resid_post == resid_mid + mlp_out`` exactly) and proves their edits; in a
  sandwich-normed block (Gemma 4's) ``hook_attn_out``/``hook_mlp_out`` are the outputs of the norms after the
  attention and the MLP, what the block adds to the residual, as TransformerLens' Gemma 2 blocks have them, and
  those norms get ``ln1_post``/``ln2_post.hook_scale`` and ``hook_normalized`` as the language model's norms do
  (the core's ``NormSite``: before the weight; served where the norm's ``NormSpec`` is known). An
  edit of ``hook_resid_mid`` reaches the MLP and the residual (the block's output rebuilt as ``edited + mlp_out``),
  one of ``hook_mlp_in`` the MLP only, as on the language model's blocks;
- ``vision.blocks.{i}.attn.hook_q``/``hook_k``/``hook_v``/``hook_z`` (``hook_rot_q``/``hook_rot_k`` where the
  attention rotates them, Pixtral, Gemma 4 and Qwen; ``attn.q_norm``/``k_norm``/``v_norm.hook_scale`` and
  ``hook_normalized``, before the norm's weight as the language models' are, where per-head norms follow the
  projections, Gemma 4, and their ``NormSpec`` is known; Qwen's from one fused ``qkv``, of its flat sequence of
  all images' patches, a batch of 1) and ``attn.hook_attn_scores``/``hook_pattern`` (block-diagonal over the images, or
  windows, where the tower attends one at a time):
  the attention's projections and its attention function's call, as :mod:`lensadapters.wiring.vision_attention`
  finds them from one more probe forward (patterns computed explicitly in the hooked layers only).

A tower whose forward needs an input the probe cannot build (patch positions...) is refused by name
(:class:`VisionTowerWarning`), and so is any point the probe did not prove. The points fire only in a forward with
an image. No hook is installed until a ``vision.*`` point is hooked.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.errors import UnsupportedModelError
from lensadapters.hooks.frames import ForwardState
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import (
    AttentionRotarySite,
    AttentionSite,
    InputSite,
    OutputSite,
    ResidualSite,
)
from lensadapters.wiring.vision_attention import (
    ROTATIONS,
    AttnParts,
    TowerPatternBackend,
    TowerRotary,
    attention_names,
    probe_attention,
)
from lensadapters.wiring.vision_attention_sites import GatheredAttentionSite, attention_sites
from lensadapters.wiring.vision_inputs import probe_inputs
from lensadapters.wiring.vision_parts import EDITS, BlockParts, check_part_edits, find_parts

#: the prefix of the vision tower's points
PREFIX = "vision."
#: the condition under which the tower's points fire
FIRES_WHEN = "in a forward with images (pixel_values)"


class VisionTowerWarning(UserWarning):
    """The vision tower's points (or some of them) are not served; the message says why."""


@dataclass(frozen=True)
class Tower:
    """What the probe proved: the tower, its blocks, and their parts (``None``: the residual points only), their
    attention's (``None``: no attention point) and the backend of its patterns."""

    module: nn.Module
    blocks: nn.ModuleList
    parts: Optional[list[BlockParts]]
    attn: Optional[list[AttnParts]] = None
    backend: Optional[TowerPatternBackend] = None
    #: whether the sandwich norms' ``ln1_post``/``ln2_post.hook_scale``/``hook_normalized`` are served
    post_norms: bool = False
    #: for each block, how its ``ln1``/``ln2`` are served: ``"spec"`` (their ``NormSpec`` is known: ``hook_scale``
    #: and ``hook_normalized`` by the core's ``NormSite``), ``"output"`` (a plain ``nn.LayerNorm`` whose
    #: normalization is not known: ``hook_normalized``, its output, only); a norm absent is not served
    norms: Optional[tuple[dict[str, str], ...]] = None
    #: whether the attention's per-head norms' ``attn.q_norm``/``k_norm``/``v_norm.hook_scale``/``hook_normalized``
    #: are served (how each normalizes, its ``NormSpec``, is known)
    attn_norms: bool = False


def vision_tower(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The path and module of the vision tower: the submodule built from ``model.config.vision_config``."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is None:
        return None
    for name, module in model.named_modules():
        if module is not model and getattr(module, "config", None) is vision:
            return name, module
    return None


def block_count(config: Any) -> Optional[int]:
    """The number of the tower's blocks its config gives: ``num_hidden_layers``, or ``depth`` where it has none."""
    n = getattr(config, "num_hidden_layers", None)
    return n if isinstance(n, int) else getattr(config, "depth", None)


def tower_blocks(tower: nn.Module) -> Optional[tuple[str, nn.ModuleList]]:
    """The tower's blocks: its ``nn.ModuleList`` of ``num_hidden_layers`` modules of one class."""
    n = block_count(tower.config)
    for name, module in tower.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n and len({type(m) for m in module}) == 1:
            return name, module
    return None


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) else value


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


def _replace_input(args: tuple, kwargs: dict, value: Any) -> tuple[tuple, dict]:
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, next(iter(kwargs)): value}


def _replace_output(output: Any, value: Any) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


def _edited(kind: Optional[str], part: Optional[BlockParts], name: str) -> bool:
    """Whether the child ``name`` is edited (its output; ``ln2``'s input for ``mid``) in a probe of ``kind``."""
    if kind is None or part is None:
        return False
    edits = {"attn": (part.attn_out,), "mlp": (part.mlp_out,), "mid": (part.ln2,), "norms": (part.ln1, part.ln2)}
    return name in edits[kind]


def _watch_children(block: nn.Module, i: int, seen: dict, kind: Optional[str], part: Optional[BlockParts]) -> list:
    """Hooks recording the first input and output of each of ``block``'s children (edited as ``kind`` says)."""
    seen["child_in"][i], seen["child_out"][i], calls = {}, {}, seen["calls"].setdefault(i, {})
    handles = []
    for name, child in block.named_children():

        def pre(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> Any:
            calls[name] = calls.get(name, 0) + 1
            value = args[0] if args else next(iter(kwargs.values()), None)
            if not isinstance(value, torch.Tensor):
                return None
            edit = kind == "mid" and _edited(kind, part, name)
            value = value * 2 + 1 if edit else value
            seen["child_in"][i].setdefault(name, value.clone())
            return _replace_input(args, kwargs, value) if edit else None

        def post(module: nn.Module, args: tuple, output: Any, name: str = name) -> Any:
            value = _first(output)
            if not isinstance(value, torch.Tensor):
                return None
            edit = kind != "mid" and _edited(kind, part, name)
            value = value * 2 + 1 if edit else value
            seen["child_out"][i].setdefault(name, value.clone())
            return _replace_output(output, value) if edit else None

        handles += [child.register_forward_pre_hook(pre, with_kwargs=True), child.register_forward_hook(post)]
    return handles


def _run(
    tower: nn.Module,
    blocks: nn.ModuleList,
    pixels: dict[str, torch.Tensor],
    edit: Optional[int] = None,
    parts_edit: Optional[tuple[str, list[BlockParts]]] = None,
) -> dict:
    """One probe forward: each block's first input and output and its children's, the tower's output and
    ``hidden_states``; with ``edit``, block ``edit``'s output is replaced by ``2 * output + 1`` by a hook placed as
    the site's is; with ``parts_edit``, the parts its kind names in every block (see ``vision_parts.EDITS``)."""
    seen: dict[str, Any] = {"in": {}, "out": {}, "child_in": {}, "child_out": {}, "calls": {}}
    kind, parts = parts_edit if parts_edit is not None else (None, None)
    handles: list[RemovableHandle] = []
    for i, block in enumerate(blocks):

        def pre(module: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            seen["in"][i] = (args[0] if args else next(iter(kwargs.values()))).clone()

        def post(module: nn.Module, args: tuple, output: Any, i: int = i) -> Any:
            value = _first(output)
            if i == edit:
                value = value * 2 + 1
                output = _replace_output(output, value)
            seen["out"][i] = value.clone()
            return output if i == edit else None

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, prepend=True))
        handles += _watch_children(block, i, seen, kind, parts[i] if parts is not None else None)
    try:
        with torch.no_grad():
            result = tower(**pixels, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    for i, calls in seen["calls"].items():  # a child called more than once is no part
        for name, count in calls.items():
            if count != 1:
                seen["child_in"][i].pop(name, None)
                seen["child_out"][i].pop(name, None)
    seen["hidden"] = getattr(result, "hidden_states", None)
    last = getattr(result, "last_hidden_state", None)
    seen["last"] = (_first(result) if last is None else last).clone()
    return seen


def _probe_parts(
    tower: nn.Module, blocks: nn.ModuleList, pixels: dict[str, torch.Tensor], base: dict, path: str
) -> tuple[Optional[list[BlockParts]], list[str]]:
    """Each block's parts, found from the probe's values and their edits proven, or ``None`` and why."""
    found = [find_parts(base["in"][i], base["out"][i], base["child_in"][i], base["child_out"][i]) for i in base["in"]]
    missing = [i for i, part in enumerate(found) if part is None]
    if missing:
        return None, [
            f"{path}: block {missing[0]} has no attention and MLP children whose outputs, added to the residual, "
            f"give the block's output"
        ]
    parts = [part for part in found if part is not None]
    for kind in EDITS:
        reasons = check_part_edits(base, _run(tower, blocks, pixels, parts_edit=(kind, parts)), kind, parts, path)
        if reasons:
            return None, reasons
    return parts, []


def probe(model: nn.Module) -> tuple[Optional[Tower], list[str], list[str], list[str]]:
    """The tower when the probe proved its blocks' residual points, else ``None``; the reasons of what is not
    served: of the tower's points, of its blocks' parts' points, and of their attention's."""
    found = vision_tower(model)
    if found is None:
        return None, [], [], []
    path, tower = found
    blocks = tower_blocks(tower)
    if blocks is None:
        n = block_count(tower.config) or "?"
        return None, [f"{path}: no list of its {n} blocks was found"], [], []
    pixels, why = probe_inputs(tower)
    if pixels is None:
        return None, [f"{path}: {why}"], [], []
    snapshot = _snapshot(tower)
    parts: Optional[list[BlockParts]] = None
    attn: Optional[list[AttnParts]] = None
    backend: Optional[TowerPatternBackend] = None
    part_reasons: list[str] = []
    attn_reasons: list[str] = []
    try:
        base = _run(tower, blocks[1], pixels)
        n = len(blocks[1])
        reasons = _check(base, n, path)
        if not reasons:
            for i in range(n):
                reasons += _check_edit(base, _run(tower, blocks[1], pixels, edit=i), i, n, path)
        if not reasons:
            parts, part_reasons = _probe_parts(tower, blocks[1], pixels, base, path)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe refuses the points, naming it
        return None, [f"{path}: the probe forward failed ({type(exc).__name__}: {exc})"], [], []
    finally:
        _restore(snapshot)
    if parts is not None:
        snapshot = _snapshot(tower)
        try:
            attn_paths = [part.attn for part in parts]
            attn, backend, attn_reasons = probe_attention(
                blocks[1], attn_paths, lambda: _run(tower, blocks[1], pixels), path
            )
        except Exception as exc:  # noqa: BLE001 - the attention points only are refused, naming the failure
            attn, backend, attn_reasons = (
                None,
                None,
                [f"{path}: the probe forward failed ({type(exc).__name__}: {exc})"],
            )
        finally:
            _restore(snapshot)
    return (None if reasons else Tower(tower, blocks[1], parts, attn, backend)), reasons, part_reasons, attn_reasons


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
    # a record of another shape is no block's output (Gemma 4's last: the pooled image tokens): nothing to reach
    if hidden is not None and hidden[i + 1].shape == out.shape and not torch.equal(hidden[i + 1], out):
        return [f"{path}: an edit of block {i}'s output does not reach its hidden_states record"]
    if torch.equal(edited["last"], base["last"]):
        return [f"{path}: an edit of block {i}'s output does not change the tower's output"]
    return []


class PrependedOutputSite(OutputSite):
    """A block's output, by a forward hook that runs before the module's other forward hooks (transformers 5.x
    records ``hidden_states`` by a forward hook on each block: an edit must be what it records)."""

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_hook(self._hook, prepend=True)]


class PrependedInputSite(InputSite):
    """A block's first input, by a pre-hook that runs before the module's other pre-hooks: ``vision.hook_embed``,
    which fires before block 0's ``hook_resid_pre`` on the same input whatever order the sites were installed in."""

    def install(self) -> list[RemovableHandle]:
        return [self.module.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True)]


class TowerResidualSite(ResidualSite):
    """A tower block's residual around its MLP (its output's hook prepended, as :class:`PrependedOutputSite`'s)."""

    prepend_block_hook = True


def block_names(
    part: Optional[BlockParts],
    attn: Optional[AttnParts] = None,
    post_norms: bool = False,
    norms: Optional[dict[str, str]] = None,
    attn_norms: bool = True,
) -> list[str]:
    """The points of a tower block (relative to ``vision.blocks.{i}.``), in the order they fire (``post_norms``:
    with the sandwich norms' scale and normalized points, where the block has them; ``norms``: how its ``ln1`` and
    ``ln2`` are served, see :attr:`Tower.norms`; ``attn_norms``: with the attention's per-head norms' points)."""
    if part is None:
        return ["hook_resid_pre", "hook_resid_post"]
    served = norms or {}
    ln1, ln2 = (
        {"spec": [f"{norm}.hook_scale", f"{norm}.hook_normalized"], "output": [f"{norm}.hook_normalized"]}.get(
            served.get(norm, ""), []
        )
        for norm in ("ln1", "ln2")
    )
    ln1_post, ln2_post = (
        [f"{norm}.hook_scale", f"{norm}.hook_normalized"] if post_norms and name is not None else []
        for norm, name in (("ln1_post", part.ln1_post), ("ln2_post", part.ln2_post))
    )
    middle = [*ln1_post, "hook_attn_out", "hook_resid_mid", "hook_mlp_in", *ln2, *ln2_post]
    return ["hook_resid_pre", *ln1, *attention_names(attn, attn_norms), *middle, "hook_mlp_out", "hook_resid_post"]


def _unknown_normalization(wiring: Any, module: nn.Module) -> Optional[str]:
    """Why how the norm ``module`` normalizes is not known (its ``NormSpec``: a plugin's ``lensadapters_norm_scale``,
    or the core's ``nn.LayerNorm`` and its ``*RMSNorm`` guess checked against the module); ``None`` where it is."""
    try:
        wiring._norm_spec(module)()
    except UnsupportedModelError as exc:
        return str(exc)
    return None


def _post_norm_reasons(wiring: Any, tower: Tower) -> list[str]:
    """Why the sandwich norms' ``hook_scale``/``hook_normalized`` are not served (empty: served): how each norm
    after an attention or MLP normalizes must be known (a plugin's ``lensadapters_norm_scale``, or the core's
    ``nn.LayerNorm`` and its ``*RMSNorm`` guess checked against the module), as for the language model's norms."""
    reasons: list[str] = []
    for i, (block, part) in enumerate(zip(tower.blocks, tower.parts or [])):
        for name in (part.ln1_post, part.ln2_post):
            if name is not None:
                why = _unknown_normalization(wiring, block.get_submodule(name))
                if why is not None:
                    reasons.append(f"block {i}: {why}")
    return reasons


def _attention_norm_reasons(wiring: Any, tower: Tower) -> list[str]:
    """Why the attention's per-head norms' ``hook_scale``/``hook_normalized`` are not served (empty: served, or no
    norms): how each normalizes must be known (its ``NormSpec``), as for the language models' ``q_norm``."""
    reasons: list[str] = []
    for i, (block, part, attn) in enumerate(zip(tower.blocks, tower.parts or [], tower.attn or [])):
        for x in "qkv":
            name = attn.norm(x)
            if name is not None:
                why = _unknown_normalization(wiring, block.get_submodule(part.attn).get_submodule(name))
                if why is not None:
                    reasons.append(f"block {i} {x}_norm: {why}")
    return reasons


def _plain_layer_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a torch ``nn.LayerNorm`` computing torch's own forward: its output is after the weight
    and bias, TransformerLens' ``hook_normalized`` of a LayerNorm."""
    return isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward


def _block_norms(wiring: Any, tower: Tower) -> tuple[tuple[dict[str, str], ...], list[str]]:
    """How each block's ``ln1``/``ln2`` are served (see :attr:`Tower.norms`), and why those not served are not:
    ``hook_normalized`` is defined per kind of norm (a LayerNorm's output; an RMSNorm's ``x / scale``, before its
    weight), so a norm whose ``NormSpec`` is not known serves it only where it is provably a LayerNorm."""
    served: list[dict[str, str]] = []
    reasons: list[str] = []
    for i, (block, part) in enumerate(zip(tower.blocks, tower.parts or [])):
        kinds: dict[str, str] = {}
        for norm, name in (("ln1", part.ln1), ("ln2", part.ln2)):
            if name is None:
                continue
            module = block.get_submodule(name)
            why = _unknown_normalization(wiring, module)
            if why is None:
                kinds[norm] = "spec"
            elif _plain_layer_norm(module):
                kinds[norm] = "output"
            else:
                reasons.append(f"block {i} {norm}: {why}")
        served.append(kinds)
    return tuple(served), reasons


def create_tower_points(wiring: Any, new: Callable[[str], HookPoint]) -> Optional[Tower]:
    """Create the tower's points that the probe proves (before the projector's: the tower runs first); the tower,
    or ``None`` (with a :class:`VisionTowerWarning` saying why where the model has a tower)."""
    proven, reasons, part_reasons, attn_reasons = probe(wiring.hf_model)
    if reasons:
        warnings.warn(
            "the vision tower's points are not served: " + "; ".join(reasons), VisionTowerWarning, stacklevel=4
        )
    if part_reasons:
        warnings.warn(
            "the vision tower's attention and MLP points are not served: " + "; ".join(part_reasons),
            VisionTowerWarning,
            stacklevel=4,
        )
    if attn_reasons:
        patterns_only = proven is not None and proven.attn is not None
        what = "hook_attn_scores and hook_pattern are" if patterns_only else "attention points are"
        warnings.warn(
            f"the vision tower's {what} not served: " + "; ".join(attn_reasons), VisionTowerWarning, stacklevel=4
        )
    if proven is None:
        return None
    if any(p.ln1_post is not None or p.ln2_post is not None for p in proven.parts or []):
        norm_reasons = _post_norm_reasons(wiring, proven)
        if norm_reasons:
            warnings.warn(
                "the vision tower's ln1_post/ln2_post points are not served: " + "; ".join(norm_reasons),
                VisionTowerWarning,
                stacklevel=4,
            )
        proven = replace(proven, post_norms=not norm_reasons)
    if proven.parts is not None:
        norms, norm_reasons = _block_norms(wiring, proven)
        if norm_reasons:
            warnings.warn(
                "the vision tower's ln1/ln2.hook_scale and hook_normalized are not served where how the norm "
                "normalizes is not known (hook_normalized is an RMSNorm's input divided by its scale, before the "
                "weight, not its output): " + "; ".join(norm_reasons),
                VisionTowerWarning,
                stacklevel=4,
            )
        proven = replace(proven, norms=norms)
    if proven.attn is not None and proven.parts is not None:
        attn_norm_reasons = _attention_norm_reasons(wiring, proven)
        if attn_norm_reasons:
            warnings.warn(
                "the vision tower's attn.q_norm/k_norm/v_norm.hook_scale and hook_normalized are not served where "
                "how the norm normalizes is not known (hook_normalized is the norm's input divided by its scale, "
                "before the weight): " + "; ".join(attn_norm_reasons),
                VisionTowerWarning,
                stacklevel=4,
            )
        proven = replace(proven, attn_norms=not attn_norm_reasons)
    new(PREFIX + "hook_embed").fires_when = FIRES_WHEN
    for i in range(len(proven.blocks)):
        attn = proven.attn[i] if proven.attn is not None else None
        part = proven.parts[i] if proven.parts is not None else None
        norms_i = proven.norms[i] if proven.norms is not None else None
        for name in block_names(part, attn, proven.post_norms, norms_i, proven.attn_norms):
            new(f"{PREFIX}blocks.{i}.{name}").fires_when = FIRES_WHEN
    return proven


def build_tower_sites(wiring: Any, tower: Optional[Tower], core: Callable[[str], HookPoint]) -> None:
    """The sites of the points :func:`create_tower_points` created: a pre-hook on each block's first input (block
    0's ``hook_embed`` first, then its ``hook_resid_pre``), a prepended forward hook on its first output, and hooks
    on its parts' outputs and ``ln2``'s input (a :class:`TowerResidualSite`)."""
    if tower is None:
        return
    wiring.add_site(PrependedInputSite(tower.blocks[0], core(PREFIX + "hook_embed")))
    for i, block in enumerate(tower.blocks):

        def pt(name: str, i: int = i) -> HookPoint:
            return core(f"{PREFIX}blocks.{i}.{name}")

        wiring.add_site(InputSite(block, pt("hook_resid_pre")))
        if tower.parts is None:
            wiring.add_site(PrependedOutputSite(block, pt("hook_resid_post")))
            continue
        part, get = tower.parts[i], block.get_submodule
        norms = tower.norms[i] if tower.norms is not None else {}
        if part.ln1 is not None:
            _ln_site(wiring, get(part.ln1), pt, "ln1", norms)
        if tower.attn is not None:
            _attention_sites(wiring, tower, i, get(part.attn), pt)
        if tower.post_norms and part.ln1_post is not None:  # its scale and normalized values, as a text model's
            wiring._norm_site(get(part.ln1_post), pt, "ln1_post")
        wiring.add_site(OutputSite(get(part.attn_out), pt("hook_attn_out")))  # after ln1_post, if any
        _ln_site(wiring, get(part.ln2), pt, "ln2", norms)
        mlp_out = get(part.mlp_out)  # the MLP, or the norm after it
        if tower.post_norms and part.ln2_post is not None:
            wiring._norm_site(mlp_out, pt, "ln2_post")
        wiring.add_site(
            TowerResidualSite(
                (PREFIX, i),
                block,
                get(part.ln2),
                mlp_out,
                wiring.forward_state,
                pt("hook_resid_mid"),
                pt("hook_mlp_in"),
                pt("hook_mlp_out"),
                pt("hook_resid_post"),
                residual_add=mlp_out,
            )
        )


def _ln_site(wiring: Any, module: nn.Module, pt: Callable[[str], HookPoint], norm: str, norms: dict[str, str]) -> None:
    """``norm``'s site as ``norms`` says (:attr:`Tower.norms`): the core's ``NormSite`` (its ``NormSpec`` known), its
    output (a plain ``nn.LayerNorm``), or none."""
    kind = norms.get(norm)
    if kind == "spec":
        wiring._norm_site(module, pt, norm)
    elif kind == "output":
        wiring.add_site(OutputSite(module, pt(f"{norm}.hook_normalized")))


def _attention_sites(wiring: Any, tower: Tower, i: int, attention: nn.Module, pt: Callable[[str], HookPoint]) -> None:
    """A block's attention sites: a pre-hook on the attention module recording the ``(cos, sin)`` it gets (where it
    rotates its queries and keys), forward hooks on its projections' outputs (``hook_q/k/v``, split into heads, and
    ``hook_rot_q/k`` rotated with those angles; the thirds of one fused projection's; on the outputs of the per-head
    norms after the projections where it has them, with those norms' ``hook_scale``/``hook_normalized``), its layer
    of the tower's pattern backend (gathered over the whole sequence where it attends block by block) and a
    pre-hook on the output projection's input (``hook_z``):
    :func:`~lensadapters.wiring.vision_attention_sites.attention_sites`."""
    assert tower.attn is not None
    parts, state = tower.attn[i], wiring.forward_state
    rotary = cast(ForwardState, TowerRotary(state)) if parts.rotary is not None else None
    if rotary is not None:
        rot = [pt("attn.hook_rot_q"), pt("attn.hook_rot_k")]
        wiring.add_site(AttentionRotarySite(attention, "position_embeddings", rot, rotary))
    rotation = ROTATIONS[parts.rotary] if parts.rotary is not None else None
    norm_spec = wiring._norm_spec if tower.attn_norms else None
    for site in attention_sites(parts, attention, tower.backend, state, rotary, rotation, i, pt, norm_spec):
        if isinstance(site, (AttentionSite, GatheredAttentionSite)):
            wiring.guard.also(site, [attention])  # a replaced attention module is noticed, as the language model's are
        wiring.add_site(site)
