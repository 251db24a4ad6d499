"""Reading LoRA layers: which adapters contribute, their deltas, and the effective weight.

Everything here reads PEFT's live state (``disable_adapters``, ``merged_adapters``, ``active_adapters``,
``scaling``) on every call, so switching, disabling or merging adapters after wrapping is followed.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

import torch
from torch import nn

from lensadapters import LinearWeight, WeightUnavailableError

Tensor = torch.Tensor


def lora_layer_type() -> Optional[type]:
    """PEFT's ``LoraLayer`` class if peft is imported (a model cannot hold LoRA layers otherwise)."""
    module = sys.modules.get("peft.tuners.lora.layer")
    return getattr(module, "LoraLayer", None) if module is not None else None


def is_lora_linear(module: Any) -> bool:
    """A LoRA layer around a linear-like base layer (``lora.Linear``, its 8-bit/4-bit/GPTQ... siblings).

    Embedding and convolution LoRA layers are excluded: their adapters live elsewhere or are not
    ``nn.Linear`` maps.
    """
    cls = lora_layer_type()
    if cls is None or not isinstance(module, cls):
        return False
    if not isinstance(getattr(module, "lora_A", None), nn.ModuleDict) or not hasattr(module, "base_layer"):
        return False
    layer_mod = sys.modules.get("peft.tuners.lora.layer")
    for name in ("Embedding", "_ConvNd", "Conv1d", "Conv2d", "Conv3d"):
        excluded = getattr(layer_mod, name, None)
        if excluded is not None and isinstance(module, excluded):
            return False
    return True


def is_lora_embedding(module: Any) -> bool:
    layer_mod = sys.modules.get("peft.tuners.lora.layer")
    cls = getattr(layer_mod, "Embedding", None) if layer_mod is not None else None
    return cls is not None and isinstance(module, cls)


def is_variant(module: nn.Module, adapter: str) -> bool:
    """DoRA and the other LoRA variants do not add ``B·A·x·scaling``."""
    return adapter in getattr(module, "lora_variant", {}) or bool(getattr(module, "use_dora", {}).get(adapter, False))


def active_lora_adapters(module: nn.Module) -> list[str]:
    """The adapters whose delta PEFT adds in this layer's unmerged forward (in PEFT's order)."""
    return [a for a in module.active_adapters if a in module.lora_A]


def contributing_adapters(module: nn.Module) -> tuple[str, list[str]]:
    """``(state, adapters)``: what this layer's next forward computes.

    ``"disabled"``: base only (PEFT unmerges merged adapters first); ``"merged"``: the merged adapters are
    inside the base weight (unmerged active adapters are ignored by PEFT then); ``"active"``: base plus the
    active adapters' deltas.
    """
    if module.disable_adapters:
        return "disabled", []
    if module.merged:
        return "merged", [a for a in module.merged_adapters if a in module.lora_A]
    return "active", active_lora_adapters(module)


def adapter_scaling(module: nn.Module, adapter: str) -> float:
    return module.scaling[adapter]


def delta_linear(module: nn.Module, adapter: str) -> LinearWeight:
    """One adapter's contribution ``B·A·scaling`` as ``[d_in, d_out]`` (and its bias, ``lora_bias=True``)."""
    if is_variant(module, adapter):
        raise WeightUnavailableError(
            f"adapter {adapter!r} of this {type(module).__name__} is a LoRA variant (DoRA or similar) whose effective "
            f"weight is not base + B·A·scaling; lensadapters-peft reads only vanilla LoRA weights (merge the "
            f"adapter with merge_adapter() to read the merged weight)"
        )
    A = module.lora_A[adapter].weight  # [r, d_in]
    B = module.lora_B[adapter].weight  # [d_out, r]
    s = adapter_scaling(module, adapter)
    W = (B @ A).T * s
    bias = module.lora_B[adapter].bias
    return LinearWeight(W, None if bias is None else bias * s)


def _combine(W: Tensor, b: Optional[Tensor], deltas: Iterable[LinearWeight], sign: float) -> LinearWeight:
    for d in deltas:
        dtype = torch.promote_types(W.dtype, d.W.dtype)
        W = W.to(dtype) + sign * d.W.to(device=W.device, dtype=dtype)
        if d.b is not None:
            if b is None:  # lora_bias=True on a base layer without bias: PEFT adds B's bias anyway
                b = torch.zeros_like(d.b)
            bdtype = torch.promote_types(b.dtype, d.b.dtype)
            b = b.to(bdtype) + sign * d.b.to(device=b.device, dtype=bdtype)
    return LinearWeight(W, b)


def effective_linear(module: nn.Module, read: Any) -> LinearWeight:
    """The weight the LoRA layer's next forward applies, as ``[d_in, d_out]`` (TransformerLens orientation).

    ``read(base_layer)`` reads the base through every plugin (so an 8-bit base is dequantized by its
    plugin). Disabled adapters contribute nothing (merged ones are subtracted, as PEFT unmerges them
    before running the base); merged adapters are already inside the base weight; otherwise each
    active adapter adds ``(B @ A).T * scaling``. ``fan_in_fan_out`` (GPT-2's ``Conv1D``) only concerns
    the base's storage, which the base's reader handles.
    """
    base = read(module.base_layer)
    state, adapters = contributing_adapters(module)
    if state == "disabled":
        merged = [a for a in module.merged_adapters if a in module.lora_A]
        return _combine(base.W, base.b, (delta_linear(module, a) for a in merged), -1.0)
    if state == "merged":
        return base
    return _combine(base.W, base.b, (delta_linear(module, a) for a in adapters), 1.0)


def effective_embedding(module: nn.Module) -> Tensor:
    """The effective ``[vocab, d_model]`` table of a ``lora.Embedding``."""
    W = module.base_layer.weight
    state, adapters = contributing_adapters(module)
    sign = 1.0
    if state == "disabled":
        adapters, sign = [a for a in module.merged_adapters if a in module.lora_embedding_A], -1.0
    elif state == "merged":
        return W
    else:
        adapters = [a for a in module.active_adapters if a in module.lora_embedding_A]
    for a in adapters:
        if is_variant(module, a):
            raise WeightUnavailableError(f"adapter {a!r} of the embedding is a LoRA variant (DoRA or similar)")
        d = (module.lora_embedding_B[a] @ module.lora_embedding_A[a]).T * module.scaling[a]
        dtype = torch.promote_types(W.dtype, d.dtype)
        W = W.to(dtype) + sign * d.to(dtype)
    return W


def cast_input(module: nn.Module, x: Tensor, dtype: torch.dtype) -> Tensor:
    cast = getattr(module, "_cast_input_dtype", None)
    return cast(x, dtype) if cast is not None else x.to(dtype)


def recompute_delta(module: nn.Module, adapter: str, x: Tensor, dropout: bool) -> Tensor:
    """``lora_B(lora_A(dropout(x))) * scaling`` as PEFT computes it (``dropout=False`` skips dropout)."""
    lora_A = module.lora_A[adapter]
    x = cast_input(module, x, lora_A.weight.dtype)
    if dropout:
        x = module.lora_dropout[adapter](x)
    return module.lora_B[adapter](lora_A(x)) * module.scaling[adapter]
