"""Reading bitsandbytes storage as matrices, with bitsandbytes' own functions where it has them.

Every function reads the module's live storage on each call (``Int8Params`` and their scales, the
4-bit ``quant_state``), so quantizing, merging a LoRA adapter into the base or moving the model
is followed. Nothing here changes the module: bitsandbytes moves ``CB``/``SCB`` from the weight to
``module.state`` on the first forward pass and repacks 4-bit weights for the CPU kernel; both
layouts are read as they are found.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from torch import nn

from lensadapters import WeightUnavailableError, wrapped_layers

Tensor = torch.Tensor


def bnb_modules() -> Any:
    """``bitsandbytes.nn.modules`` if bitsandbytes is imported (a model cannot hold its layers otherwise)."""
    return sys.modules.get("bitsandbytes.nn.modules")


def _is(module: Any, name: str) -> bool:
    mods = bnb_modules()
    cls = getattr(mods, name, None) if mods is not None else None
    return cls is not None and isinstance(module, cls)


def is_int8_linear(module: Any) -> bool:
    return _is(module, "Linear8bitLt")


def is_4bit_linear(module: Any) -> bool:
    return _is(module, "Linear4bit")  # LinearNF4 and LinearFP4 are subclasses


def is_bnb_module(module: Any) -> bool:
    """Any module defined by bitsandbytes (``bitsandbytes.*``)."""
    return type(module).__module__.split(".")[0] == "bitsandbytes"


def is_int8_embedding(module: Any) -> bool:
    return _is(module, "Embedding8bit")


def is_4bit_embedding(module: Any) -> bool:
    return _is(module, "Embedding4bit")


def _describe(module: nn.Module, name: Optional[str]) -> str:
    where = f"{name} " if name else ""
    shape = ""
    if hasattr(module, "in_features"):
        shape = f" [{module.in_features} -> {module.out_features}]"
    return f"{where}({type(module).__module__}.{type(module).__name__}{shape})"


def unavailable(module: nn.Module, name: Optional[str], fmt: str, fix: str = "") -> WeightUnavailableError:
    return WeightUnavailableError(
        f"lensadapters-bnb cannot read the weight of {_describe(module, name)}: {fmt}. "
        f"No matrix is returned for storage lensadapters cannot dequantize (its bytes are not the weight)."
        + (f" {fix}" if fix else "")
    )


# --- 8-bit (LLM.int8) ---------------------------------------------------------------------------------


def int8_parts(module: nn.Module, name: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """``(CB, SCB)`` that the layer's next forward multiplies with: int8 rows ``[out, in]`` and their absmax ``[out]``.

    Before the first forward pass they live on the weight (``weight.CB``/``weight.SCB``), afterwards in
    ``module.state``. A layer with ``has_fp16_weights=True`` quantizes its float weight on the fly
    (and keeps the result in ``state`` while it does not train): this is mirrored here.
    """
    from bitsandbytes import functional as F

    weight = module.weight
    state = getattr(module, "state", None)
    if weight.dtype == torch.int8:
        scb = getattr(weight, "SCB", None)
        if scb is None and state is not None:
            scb = state.SCB
        if scb is None:
            raise unavailable(
                module,
                name,
                "int8 weight (Int8Params) without its row scales SCB",
                "The layer has not been quantized properly (load it with BitsAndBytesConfig).",
            )
        cb = weight.data
        if cb.shape[0] != scb.numel():
            raise unavailable(module, name, f"int8 weight of shape {tuple(cb.shape)} with {scb.numel()} row scales")
        return cb, scb
    if weight.is_floating_point():
        # has_fp16_weights=True: MatMul8bitLt re-quantizes the float weight unless it can reuse the state's
        # copy (eval mode, or training with a gradient already present)
        cached = state is not None and state.CB is not None and state.SCB is not None
        reuse = cached and (not module.training or getattr(weight, "grad", None) is not None)
        if reuse:
            return state.CB, state.SCB
        cb, scb, _ = F.int8_vectorwise_quant(weight.detach().to(torch.float16))
        return cb, scb
    raise unavailable(module, name, f"Linear8bitLt weight stored as {weight.dtype}")


def dequantize_int8(module: nn.Module, name: Optional[str] = None) -> Tensor:
    """The weight ``[out, in]`` (float32) the 8-bit matmul applies: ``CB * SCB / 127`` per row.

    Uses ``bitsandbytes.functional.int8_vectorwise_dequant``. The int8 matmul multiplies exactly
    these values (its integer products are exact); the only other error of its output is the int8
    rounding of the *activations* (see :func:`matmul_error_bound`).
    """
    from bitsandbytes import functional as F

    cb, scb = int8_parts(module, name)
    return F.int8_vectorwise_dequant(cb, scb).float()


# --- 4-bit (NF4 / FP4) ----------------------------------------------------------------------------------


def _quant_state(module: nn.Module) -> Any:
    qs = getattr(module.weight, "quant_state", None)
    return qs if qs is not None else getattr(module, "quant_state", None)


def _cpu_packed_codes(packed: Tensor, block_n: int = 32) -> Tensor:
    """Undo bitsandbytes' CPU repacking (``_convert_weight_packed_for_cpu``): ``[N, K/2]`` bytes → ``[N, K]`` codes."""
    n, k_half = packed.shape
    flat = packed.reshape(-1, 32)
    qw = torch.cat([flat & 0xF, (flat >> 4) & 0xF], dim=-1)  # 32 low nibbles, then 32 high nibbles
    qw = qw.reshape(n // block_n, k_half, block_n, 2).transpose(-3, -2)
    return qw.reshape(n, 2 * k_half).long()


def dequantize_4bit(module: nn.Module, name: Optional[str] = None) -> Tensor:
    """The weight ``[out, in]`` (float32) of a ``Linear4bit`` (NF4 or FP4, double quantization included).

    Uses ``bitsandbytes.functional.dequantize_4bit``. On CPUs with AVX512-BF16, bitsandbytes repacks
    the weight at the first inference pass for its fused kernel (block scales rounded to bfloat16):
    that layout is unpacked here with the kernel's own code table and bfloat16 scales, so the
    matrix is the one the kernel multiplies with.
    """
    from bitsandbytes import functional as F

    weight = module.weight
    qs = _quant_state(module)
    if qs is None:
        if weight.is_floating_point() and weight.dim() == 2:
            return weight.detach().float()  # not quantized yet: the layer still holds its float weight
        raise unavailable(module, name, f"4-bit packed weight {tuple(weight.shape)} without its quant_state")
    if getattr(qs, "packing_format_for_cpu", False):
        data = weight.data if weight.dtype == torch.uint8 else weight.data.view(torch.uint8)
        n, k = int(qs.shape[0]), int(qs.shape[1])
        if data.dim() != 2 or tuple(data.shape) != (n, k // 2) or n % 32:
            raise unavailable(module, name, f"4-bit CPU-packed weight of unexpected shape {tuple(data.shape)}")
        codes = _cpu_packed_codes(data)
        table = qs.code.to(device=data.device, dtype=torch.float32)
        absmax = qs.absmax.float()  # [K / blocksize, N], as the CPU kernel reads it
        scales = absmax.T.repeat_interleave(qs.blocksize, dim=1)[:, :k]
        return table[codes] * scales
    if qs.quant_type not in ("nf4", "fp4"):
        raise unavailable(module, name, f"4-bit quant_type {qs.quant_type!r}")
    return F.dequantize_4bit(weight.data, qs).float().reshape(int(qs.shape[0]), int(qs.shape[1]))


# --- embeddings ---------------------------------------------------------------------------------------------


def dequantize_embedding(module: nn.Module, name: Optional[str] = None) -> Tensor:
    """The ``[vocab, d_model]`` table of a bitsandbytes ``Embedding8bit`` / ``Embedding4bit``, in its output dtype."""
    from bitsandbytes import functional as F

    dtype = getattr(module, "dtype", torch.float32)
    weight = module.weight
    if is_int8_embedding(module):
        scb = getattr(weight, "SCB", None)
        if weight.dtype != torch.int8 or scb is None:
            if weight.is_floating_point():
                return weight.detach()
            raise unavailable(module, name, "int8 embedding without row scales SCB")
        return (weight.data * (scb.view(-1, 1) / 127.0)).to(dtype)
    qs = _quant_state(module)
    if qs is None:
        if weight.is_floating_point():
            return weight.detach()
        raise unavailable(module, name, "4-bit embedding without its quant_state")
    return F.dequantize_4bit(weight.data, qs).reshape(module.num_embeddings, module.embedding_dim).to(dtype)


# --- error bounds ---------------------------------------------------------------------------------------------

#: relative rounding allowance on top of the quantization terms: fp32 rounding of the dequantization and
#: the ``1/127**2`` constant bitsandbytes uses (``6.200124e-05``, 1.8e-5 relative from the exact value)
REL_FP32 = 5e-5
#: half the int8 step, relative to a row's absmax: ``round(x * 127 / absmax)`` is off by at most 1/2
INT8_HALF_STEP = 1.0 / 254.0
FP16_UNIT = 2.0**-11  # unit roundoff of float16 (the 8-bit matmul casts its input to float16)
BF16_UNIT = 2.0**-8  # unit roundoff of bfloat16 (the CPU 4-bit kernel computes in bfloat16)


def _base_quantized(module: nn.Module) -> Optional[nn.Module]:
    """The bitsandbytes layer of ``module``: itself, or the layer under its wrapper layers (an adapter layer's
    base layer), as the installed plugins peel them (``lensadapters.wrapped_layers``)."""
    for layer in wrapped_layers(module):
        if is_int8_linear(layer) or is_4bit_linear(layer):
            return layer
    return None


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def matmul_error_bound(module: nn.Module, x: Tensor, W: Tensor, b: Optional[Tensor] = None) -> Tensor:
    """An upper bound on ``|module(x) - (x @ W + b)|``, elementwise ``[..., d_out]``.

    ``W`` ``[d_in, d_out]`` and ``b`` are what lensadapters reads for ``module`` (``hm.W_Q``... are built
    from them); ``x`` is the module's input in the model's compute dtype. With ``M = max_i |x_i|`` of
    the row, ``|W|_1 = sum_i |W_ij|`` and ``m = sum_i |x_i| |W_ij| + |b_j|``:

    * ``Linear8bitLt`` (LLM.int8): the weight read is exactly the one the int8 kernel multiplies with,
      so the error is the rounding of the activations: the input is cast to float16 and each row is
      rounded to ``round(x * 127 / M) * M / 127`` (at most ``M / 254`` per element; outlier columns
      above ``threshold`` are kept exactly and only make it smaller). Hence
      ``bound = M (1 + u16) / 254 * |W|_1 + u16 * sum_i |x_i| |W_ij| + r * m`` with ``u16 = 2**-11``.
    * ``Linear4bit``: no activation quantization; the input and output are rounded to the kernel's
      compute dtype (bfloat16 for bitsandbytes' CPU kernel), so ``bound = 4 * u_c * m + r * m``.
    * any other layer: ``bound = r * m``.

    ``r = 5e-5 + 4 * u(dtype)`` covers float rounding in the compute dtype (``u`` its unit roundoff).
    For an adapter wrapper (``lora.Linear8bitLt``...) the quantized base layer decides the terms, and
    ``W = W_base + delta`` includes the adapter: the bound uses ``|W_base| + |delta|`` for ``|W|`` (an adapter
    that cancels part of the base weight makes ``|W|`` smaller than the base path's error scale).
    """
    dtype = x.dtype
    xa = x.detach().abs().float()
    Wa = W.detach().abs().float().to(xa.device)
    base = _base_quantized(module)
    if base is not None and base is not module:
        W_base = (dequantize_int8(base) if is_int8_linear(base) else dequantize_4bit(base)).T.to(xa.device)
        Wa = W_base.abs() + (W.detach().float().to(xa.device) - W_base).abs()
    magnitude = xa @ Wa
    if b is not None:
        magnitude = magnitude + b.detach().abs().float().to(xa.device)
    rel = REL_FP32 + 4 * _unit(dtype)
    bound = rel * magnitude
    if base is not None and is_int8_linear(base):
        M = xa.amax(dim=-1, keepdim=True)
        bound = bound + M * (1 + FP16_UNIT) * INT8_HALF_STEP * Wa.sum(0) + FP16_UNIT * (xa @ Wa)
    elif base is not None and is_4bit_linear(base):
        compute = getattr(base, "compute_dtype", None) or dtype
        unit = max(_unit(compute), BF16_UNIT if x.device.type == "cpu" else 0.0)
        bound = bound + 4 * unit * magnitude
    return bound
