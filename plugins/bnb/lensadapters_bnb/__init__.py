"""bitsandbytes for lensadapters: a cross-cutting plugin (it claims no architecture).

Models loaded with ``BitsAndBytesConfig(load_in_8bit=True)`` (LLM.int8, ``bnb.nn.Linear8bitLt``) or
``load_in_4bit=True`` (NF4/FP4, ``bnb.nn.Linear4bit``) are wrapped by their architecture plugin as
usual: every hook point sits on module inputs and outputs, which quantization does not change, so
hook values are in the dtype the model computes in and edits are cast back to it. This plugin adds
what the quantized storage hides:

* ``lensadapters_linear_weight``: the dequantized weight of ``Linear8bitLt`` (``CB * SCB / 127`` per
  row, ``bitsandbytes.functional.int8_vectorwise_dequant``) and ``Linear4bit``
  (``bitsandbytes.functional.dequantize_4bit``; the CPU kernel's repacked layout too), in the
  ``[d_in, d_out]`` orientation of the core, so fused layouts (GPT-2 ``c_attn``, GPT-NeoX
  ``query_key_value``) split with their architecture plugin's ``FusedQKV.split``, and an adapter layer
  on top (a PEFT LoRA layer, read by its own plugin) adds its delta to the dequantized base.
* ``lensadapters_weight``: ``W_E``/``W_pos`` of bitsandbytes ``Embedding8bit``/``Embedding4bit``.
* A clear ``WeightUnavailableError`` (naming the module and the format) for any bitsandbytes layer
  it cannot dequantize; packed storage is never returned as if it were a matrix.
* :func:`matmul_error_bound`: how far a quantized layer's output may be from ``x @ W + b`` (the
  tolerance of the TransformerLens identities on quantized models, see the README).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from lensadapters import Architecture, ContractVariant, LinearWeight, hookimpl

from ._dequant import (
    bnb_modules,
    dequantize_4bit,
    dequantize_embedding,
    dequantize_int8,
    int8_parts,
    is_4bit_embedding,
    is_4bit_linear,
    is_bnb_module,
    is_int8_embedding,
    is_int8_linear,
    matmul_error_bound,
    unavailable,
)

__version__ = "0.1.0"
LENSADAPTERS_HOOKSPEC = "1"
#: the layers whose weights this plugin supplies: bitsandbytes' quantized linears and embeddings
LENSADAPTERS_LAYERS = ("bitsandbytes.",)

__all__ = [
    "dequantized_weight",
    "dequantize_int8",
    "dequantize_4bit",
    "dequantize_embedding",
    "int8_parts",
    "matmul_error_bound",
    "is_quantized_linear",
    "compute_dtype",
]

Tensor = torch.Tensor

# bitsandbytes module -> (weak reference to the wrapped HF model, qualified name); filled at wrap time so
# weights come back in the model's compute dtype and errors name the module
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, tuple[Any, str]]" = weakref.WeakKeyDictionary()


def is_quantized_linear(module: Any) -> bool:
    """A bitsandbytes 8-bit or 4-bit linear layer."""
    return is_int8_linear(module) or is_4bit_linear(module)


def _name(module: nn.Module) -> Optional[str]:
    owner = _OWNERS.get(module)
    return owner[1] if owner is not None else None


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the model around ``module`` computes in (its hook values' dtype).

    The wrapped model's floating dtype (``model.dtype``); for a layer outside a wrapped model, its
    bias' dtype, the 4-bit layer's compute dtype, or float32.
    """
    owner = _OWNERS.get(module)
    model = owner[0]() if owner is not None else None
    dtype = getattr(model, "dtype", None) if model is not None else None
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    bias = getattr(module, "bias", None)
    if bias is not None and bias.is_floating_point():
        return bias.dtype
    for attr in ("compute_dtype", "dtype"):
        value = getattr(module, attr, None)
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return value
    return torch.float32


def dequantized_weight(module: nn.Module, dtype: Optional[torch.dtype] = None) -> LinearWeight:
    """``LinearWeight(W [d_in, d_out], b)`` of a bitsandbytes linear layer.

    ``dtype`` defaults to the model's compute dtype (what ``hm.W_Q``... use); pass ``torch.float32``
    for the exact dequantization (an 8-bit weight in float16 carries a further ``2**-11`` relative rounding).
    """
    name = _name(module)
    if is_int8_linear(module):
        W = dequantize_int8(module, name)
    elif is_4bit_linear(module):
        W = dequantize_4bit(module, name)
    else:
        raise unavailable(module, name, "not a bitsandbytes Linear8bitLt or Linear4bit layer")
    dtype = dtype or compute_dtype(module)
    bias = module.bias
    if bias is not None and bias.dtype != dtype:
        bias = bias.to(dtype)
    return LinearWeight(W.T.to(dtype), bias)


# --- adapter hooks -----------------------------------------------------------------------------------------


@hookimpl
def lensadapters_contract_variants() -> list[ContractVariant]:
    """``lensadapters check PLUGIN --int8``: the contract suite on models loaded in 8-bit."""
    return [ContractVariant("int8", "lensadapters_bnb.testing:Int8Contract", "8-bit (bitsandbytes LLM.int8) models")]


@hookimpl
def lensadapters_linear_weight(module: nn.Module, read: Any) -> Optional[LinearWeight]:
    """Dequantize bitsandbytes linears; refuse (clearly) the bitsandbytes layers without a dequantizer."""
    if bnb_modules() is None:
        return None
    if is_quantized_linear(module):
        return dequantized_weight(module)
    if is_bnb_module(module):
        weight = getattr(module, "weight", None)
        fmt = f"{type(module).__name__} with a {getattr(weight, 'dtype', 'missing')} weight"
        raise unavailable(
            module,
            _name(module),
            f"{fmt}: lensadapters-bnb has no dequantizer for this layer type",
            "Supported: Linear8bitLt (LLM.int8) and Linear4bit (NF4/FP4).",
        )
    return None


@hookimpl
def lensadapters_weight(arch: Architecture, hooked: Any, name: str) -> Optional[Tensor]:
    """``W_E`` / ``W_pos`` stored in a bitsandbytes ``Embedding8bit`` / ``Embedding4bit``."""
    if name not in ("W_E", "W_pos") or bnb_modules() is None:
        return None
    layout = hooked.layout
    path = layout.embed if name == "W_E" else layout.pos_embed
    if not path:
        return None
    module = hooked.hf_model.get_submodule(path)
    if not (is_int8_embedding(module) or is_4bit_embedding(module)):
        if is_bnb_module(module) and not module.weight.is_floating_point():
            raise unavailable(module, path, f"{type(module).__name__} embedding stored as {module.weight.dtype}")
        return None
    W = dequantize_embedding(module, path)
    return W[layout.pos_embed_offset :] if name == "W_pos" else W


@hookimpl
def lensadapters_extra_sites(arch: Architecture, hooked: Any) -> list[Any]:
    """No new hook points: records the model's bitsandbytes layers (for dtypes and error messages)."""
    if bnb_modules() is None:
        return []
    ref = weakref.ref(hooked.hf_model)
    for qualified, module in hooked.hf_model.named_modules():
        if is_bnb_module(module):
            _OWNERS[module] = (ref, qualified)
    return []
