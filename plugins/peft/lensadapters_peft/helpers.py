"""What a user of a LoRA-adapted HookedModel calls: its LoRA hook points, switching adapters off or between them, the
base and adapted runs side by side, and one projection's LoRA factors in TransformerLens shapes."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from lensadapters import ActivationCache, FusedGateUp, FusedQKV, LensAdaptersError, MLPLayout

from . import _lora
from ._lora import is_lora_linear

Tensor = torch.Tensor


def lora_hook_names(hm: Any) -> list[str]:
    """The LoRA-delta hook points of ``hm``, in execution order."""
    return [n for n in hm.hook_names if n.endswith("_lora")]


# --- base versus adapted -------------------------------------------------------------------------


def _peft_model(hm: Any) -> Any:
    if "peft" not in sys.modules:
        return None
    from peft import PeftModel

    return hm.model if isinstance(hm.model, PeftModel) else None


def _tuner_layers(hm: Any) -> list[nn.Module]:
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in hm.hf_model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def _keep_requires_grad(layers: Sequence[nn.Module]) -> Iterator[None]:
    """PEFT's enable/disable/set_adapter also flip ``requires_grad``; put the user's flags back."""
    flags = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            if p.requires_grad != flag:
                p.requires_grad_(flag)


@contextlib.contextmanager
def adapters_disabled(hm: Any) -> Iterator[Any]:
    """Run ``hm`` as the base model inside the block (PEFT's ``disable_adapter``); yields ``hm``.

    Hook points stay the same; the ``*_lora`` points read zero (an edit adds to the base output).
    As in PEFT, merged adapters are unmerged by the first forward pass with adapters disabled.
    Adapter ``requires_grad`` flags are restored on exit.
    """
    layers = _tuner_layers(hm)
    if not layers:
        raise LensAdaptersError("adapters_disabled: this model has no PEFT adapter layers")
    peft_model = _peft_model(hm)
    with _keep_requires_grad(layers):
        if peft_model is not None:
            with peft_model.disable_adapter():
                yield hm
        else:
            before = [(layer, layer.disable_adapters) for layer in layers]
            try:
                for layer in layers:
                    layer.enable_adapters(False)
                yield hm
            finally:
                for layer, disabled in before:
                    layer.enable_adapters(not disabled)


def _active_adapters(hm: Any, layers: Sequence[nn.Module]) -> Union[str, list[str]]:
    peft_model = _peft_model(hm)
    if peft_model is not None:
        active = peft_model.base_model.active_adapter
    else:
        active = getattr(hm.model, "active_adapter", None) or layers[0].active_adapter
    return list(active) if isinstance(active, (list, tuple)) else active


def _set_adapters(hm: Any, names: Union[str, list[str]], layers: Sequence[nn.Module]) -> None:
    peft_model = _peft_model(hm)
    if peft_model is not None:
        if isinstance(names, str):
            peft_model.set_adapter(names)
        else:
            peft_model.base_model.set_adapter(names)
    elif hasattr(hm.model, "set_adapter") and hm.model is not hm.hf_model:
        hm.model.set_adapter(names)
    else:
        for layer in layers:
            layer.set_adapter(names)


@contextlib.contextmanager
def using_adapter(hm: Any, names: Union[str, Sequence[str]]) -> Iterator[Any]:
    """Make the named adapter(s) active inside the block and restore the previous ones after; yields ``hm``.

    Several names activate several adapters at once (their deltas add up in each ``*_lora`` point).
    Outside a ``with`` block, ``peft_model.set_adapter(name)`` works as well: hook points follow the
    active adapter at every forward pass.
    """
    layers = _tuner_layers(hm)
    if not layers:
        raise LensAdaptersError("using_adapter: this model has no PEFT adapter layers")
    names = names if isinstance(names, str) else list(names)
    previous = _active_adapters(hm, layers)
    with _keep_requires_grad(layers):
        _set_adapters(hm, names, layers)
        try:
            yield hm
        finally:
            _set_adapters(hm, previous, layers)


class BaseAndAdapted(NamedTuple):
    """Result of :func:`run_with_cache_base_and_adapted`."""

    logits: Any
    cache: ActivationCache
    base_logits: Any
    base_cache: ActivationCache


def run_with_cache_base_and_adapted(hm: Any, *args: Any, **kwargs: Any) -> BaseAndAdapted:
    """``run_with_cache`` twice on the same input: with the adapters as they are, then disabled.

    Takes the arguments of ``hm.run_with_cache`` (``names_filter``, ``device``...). Returns
    ``(logits, cache, base_logits, base_cache)``; both caches have the same keys. Call it with the
    adapters unmerged (disabling unmerges merged adapters, as in PEFT).
    """
    logits, cache = hm.run_with_cache(*args, **kwargs)
    with adapters_disabled(hm):
        base_logits, base_cache = hm.run_with_cache(*args, **kwargs)
    return BaseAndAdapted(logits, cache, base_logits, base_cache)


# --- LoRA factors in TransformerLens shapes ------------------------------------------------------


@dataclass(frozen=True)
class LoraFactors:
    """One adapter's factors on one projection, in TransformerLens orientation (``x @ A @ B * scaling``).

    ``A`` and ``B`` are views of the live parameters. Shapes (``r`` = rank):

    * ``"q"``: A ``[d_model, r]``, B ``[n_heads, r, d_head]``; ``"k"``/``"v"``: B ``[n_key_value_heads, r, d_head]``
      (for a fused QKV projection A is shared by q, k and v and B is split with the projection's layout; for a
      query projection that also computes an output gate per head, B holds the query columns only, as ``W_Q``);
    * ``"o"``: A ``[n_heads, d_head, r]``, B ``[r, d_model]``;
    * ``"in"``/``"gate"``/``"out"``: A ``[d_in, r]``, B ``[r, d_out]`` (``"in"`` is the up projection of a gated MLP,
      as ``W_in``; for a fused gate/up projection A is shared by both and B is split with the layout's ``split``).

    ``b`` is the adapter's bias (``lora_bias=True``) times ``scaling`` in the shape of the matching ``b_*``, else None.
    :attr:`W` is the delta weight ``A @ B * scaling`` in the shape of ``hm.W_Q[layer]``, ``hm.W_O[layer]``...
    """

    A: Tensor
    B: Tensor
    scaling: float
    adapter: str
    which: str
    b: Optional[Tensor] = None

    @property
    def W(self) -> Tensor:
        A, B = self.A, self.B.to(self.A.dtype)
        if self.which in ("q", "k", "v"):
            return torch.einsum("mr,hrd->hmd", A, B) * self.scaling
        if self.which == "o":
            return torch.einsum("hdr,rm->hdm", A, B) * self.scaling
        return A @ B * self.scaling


_WHICH = ("q", "k", "v", "o", "in", "gate", "out")


def _declared_parts(hm: Any, module: nn.Module) -> Any:
    """The parts the architecture declares ``module``'s output to hold (``ProjectionParts``), or ``None``."""
    return next((p for p in hm.wiring.projection_parts if p.module is module), None)


def lora_factors(hm: Any, layer: int, which: str, adapter: Optional[str] = None) -> LoraFactors:
    """The LoRA factors of ``adapter`` (default: the one active adapter) on one projection of block ``layer``.

    ``which`` is one of ``"q"``, ``"k"``, ``"v"``, ``"o"``, ``"in"``, ``"gate"``, ``"out"`` (the projections behind
    ``W_Q``, ``W_K``, ``W_V``, ``W_O``, ``W_in``, ``W_gate``, ``W_out``). See :class:`LoraFactors` for the shapes.
    """
    if which not in _WHICH:
        raise ValueError(f"which must be one of {_WHICH}, not {which!r}")
    cfg = hm.cfg
    block = hm.block_modules[layer]
    qkv, bl, mlp = hm.qkv_layouts[layer], hm.block_layouts[layer], hm.mlp_layouts[layer]
    if which in ("q", "k", "v"):
        path = qkv.module if isinstance(qkv, FusedQKV) else getattr(qkv, which)
    elif which == "o":
        path = bl.o_proj
    elif not isinstance(mlp, (MLPLayout, FusedGateUp)):
        raise LensAdaptersError(
            f"layer {layer}'s MLP is a mixture of experts: lora_factors reads single projections (q, k, v, o) there"
        )
    else:
        path = mlp.projection(which)
    module = block.get_submodule(path)
    if not is_lora_linear(module):
        raise LensAdaptersError(f"blocks.{layer}.{path} ({type(module).__name__}) has no LoRA adapter")
    if adapter is None:
        candidates = _lora.active_lora_adapters(module)
        if len(candidates) != 1:
            raise LensAdaptersError(
                f"blocks.{layer}.{path}: {len(candidates)} active LoRA adapters here ({candidates}); name one with "
                f"adapter=... (available: {list(module.lora_A)})"
            )
        adapter = candidates[0]
    if adapter not in module.lora_A:
        raise LensAdaptersError(f"blocks.{layer}.{path} has no LoRA adapter {adapter!r} (it has {list(module.lora_A)})")
    if _lora.is_variant(module, adapter):
        raise LensAdaptersError(f"adapter {adapter!r} is a LoRA variant (DoRA...): its update is not A @ B * scaling")
    scaling = module.scaling[adapter]
    A = module.lora_A[adapter].weight.T  # [d_in, r]
    B = module.lora_B[adapter].weight.T  # [r, d_out]
    bias = module.lora_B[adapter].bias
    b = None if bias is None else bias * scaling
    if which in ("q", "k", "v"):
        index = "qkv".index(which)
        parts = _declared_parts(hm, module)
        part = f"blocks.{layer}.attn.hook_{which}"
        if parts is not None and part in parts.points:  # the projection's output holds more than these heads
            B = parts.split(B)[parts.points.index(part)]  # [r, h, d_head]
            b = None if b is None else parts.split(b)[parts.points.index(part)]
        elif isinstance(qkv, FusedQKV):
            B = qkv.split(B)[index]  # [r, h, d_head]
            b = None if b is None else qkv.split(b)[index]
        else:
            B = B.unflatten(-1, (-1, cfg.d_head))
            b = None if b is None else b.unflatten(-1, (-1, cfg.d_head))
        B = B.permute(1, 0, 2)  # [h, r, d_head]
    elif which == "o":
        A = A.unflatten(0, (cfg.n_heads, -1))  # [h, d_head, r]
    elif which in ("in", "gate") and isinstance(mlp, FusedGateUp):  # B's columns split like the fused output
        index = 0 if which == "gate" else 1
        B = mlp.split(B)[index]
        b = None if b is None else mlp.split(b)[index]
    return LoraFactors(A, B, scaling, adapter, which, b)
