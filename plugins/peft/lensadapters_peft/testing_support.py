"""What the LoRA contract's parts share: the drawn adapter's spec, the adapted layers and their points, tolerances
and hypothesis settings (:mod:`lensadapters_peft.testing` exports the public ones)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from hypothesis import HealthCheck, settings
from torch import nn

import lensadapters_peft as lp
from lensadapters import HookedModel, ProjectionParts

SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.differing_executors],
)
# pattern/score hooks run the core's explicit attention (equal to SDPA within rounding, not bitwise)
NO_PATTERN = lambda name: not name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731
WEIGHTS = (("q", "W_Q"), ("k", "_W_K"), ("v", "_W_V"), ("o", "W_O"), ("in", "W_in"), ("out", "W_out"))
HEAD_DELTAS = ("hook_q_lora", "hook_k_lora", "hook_v_lora")
# the core's hook point on the output of the projection a *_lora point belongs to
ADAPTED_OUTPUT = {
    "hook_q_lora": "attn.hook_q",
    "hook_k_lora": "attn.hook_k",
    "hook_v_lora": "attn.hook_v",
    "hook_pre_lora": "mlp.hook_pre",
    "hook_pre_linear_lora": "mlp.hook_pre_linear",
}


@dataclass
class LoraSpec:
    """The LoRA adapters put on a model: relative module names (inside each block) and hyperparameters."""

    targets: list[str]
    r: int
    alpha: int
    rslora: bool
    lora_bias: bool
    second: Optional[list[str]] = None  # a second adapter's targets, active together with the first
    second_r: int = 2
    second_alpha: int = 3


def _is_linear_like(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D)) and not list(module.children())


def peft_renamed_targets(model: nn.Module) -> frozenset[str]:
    """The module names (leaf names) PEFT turns into targets of fused parameters on this model's type, whatever the
    module is: on transformers 5, for the model types whose experts transformers fuses, a target named ``gate_proj``,
    ``up_proj`` or ``down_proj`` (Qwen2-MoE's pattern, Qwen3-Next's too, on its dense MLPs as on its experts) becomes
    the experts' ``gate_up_proj``/``down_proj`` parameter, or an error when one half of a fused pair is named alone.
    Empty where PEFT converts nothing (transformers 4, older PEFT)."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a PEFT without the conversion: nothing renamed
        return frozenset()
    config = getattr(model, "config", None)
    pattern = getattr(conversion, "_MODEL_TO_CONVERSION_PATTERN", {}).get(getattr(config, "model_type", None))
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4: PEFT converts nothing
        return frozenset()
    if pattern is None or get_checkpoint_conversion_mapping(config.model_type) is None:
        return frozenset()
    return frozenset(getattr(conversion, "_MOE_TARGET_MODULE_MAPPING", {}).get(pattern, {}))


def linear_targets(blocks: list[tuple[str, nn.Module]], renamed: frozenset[str] = frozenset()) -> list[str]:
    """Relative names of the linear-like leaf modules (``nn.Linear``, ``Conv1D``) of the first block, without those
    whose leaf name PEFT renames into a fused parameter's target (``renamed``: :func:`peft_renamed_targets`)."""
    _, first = blocks[0]
    return sorted(
        name
        for name, module in first.named_modules()
        if name and _is_linear_like(module) and name.rsplit(".", 1)[-1] not in renamed
    )


def init_lora(model: nn.Module, seed: int) -> None:
    """Random, non-zero LoRA factors (and LoRA biases) for every adapter of ``model``."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=g) / math.sqrt(max(p.shape))).to(p.dtype))


def lora_layers(hm: HookedModel) -> dict[str, nn.Module]:
    """``{*_lora hook name: the LoRA layer it reads}``."""
    out = {}
    for site in hm.wiring.sites:
        if isinstance(site, lp.LoraDeltaSite):
            for point in site.points:
                out[point.name] = site.module
    return out


def declared_parts(hm: HookedModel, name: str) -> Optional[ProjectionParts]:
    """The parts the architecture declares for the projection of the ``*_lora`` point ``name``, when that point is
    one of its parts' (``<part's point>_lora``), else ``None``."""
    part = name[: -len("_lora")]
    return next((p for p in hm.wiring.projection_parts if part in p.points), None)


def split_like(hm: HookedModel, name: str, t: torch.Tensor) -> torch.Tensor:
    """Split a projection-output tensor as the ``*_lora`` hook point ``name`` shows it."""
    parts = declared_parts(hm, name)
    if parts is not None:  # a part of a projection the architecture's points show in parts
        return parts.split(t)[parts.points.index(name[: -len("_lora")])]
    layer = int(name.split(".")[1])
    short = name.rsplit(".", 1)[1]
    qkv = hm.qkv_layouts[layer]
    if short in HEAD_DELTAS:
        if hasattr(qkv, "split"):
            return qkv.split(t)["qkv".index(short[5])]
        return t.unflatten(-1, (-1, hm.cfg.d_head))
    mlp = hm.mlp_layouts[layer]
    if short in ("hook_pre_lora", "hook_pre_linear_lora") and hasattr(mlp, "split"):  # a fused gate/up projection
        return mlp.split(t)[0 if short == "hook_pre_lora" else 1]
    return t


#: the ``*_lora`` points (relative to their block) that :func:`lensadapters_peft.lora_factors` has factors for
FACTOR_POINTS = tuple(f"attn.hook_{w}_lora" for w in "qkvo") + tuple(
    f"mlp.hook_{w}_lora" for w in ("pre", "pre_linear", "out")
)


def factor_kind(hm: HookedModel, name: str) -> Optional[str]:
    """The ``which`` of :func:`lensadapters_peft.lora_factors` for the ``*_lora`` point ``name`` (``None``: a point
    it has no factors for, such as the parts of a gated DeltaNet's projections or a query projection's gates)."""
    if name.split(".", 2)[2] not in FACTOR_POINTS:
        return None
    short = name.rsplit(".", 1)[1][len("hook_") : -len("_lora")]
    return {"pre": "gate" if hm.cfg.gated_mlp else "in", "pre_linear": "in"}.get(short, short)


def float_tol(reference: torch.Tensor) -> float:
    """Merging moves B·A·s into the weight: float32 rounding relative to the activations' magnitude."""
    finite = reference[torch.isfinite(reference)]
    return 1e-4 * max(1.0, finite.abs().max().item() if finite.numel() else 1.0)


def base_layer(module: nn.Module) -> nn.Module:
    """The layer a PEFT tuner layer wraps (the module itself when it is not one)."""
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def has_module(block: nn.Module, name: str) -> bool:
    try:
        block.get_submodule(name)
    except AttributeError:
        return False
    return True
