"""Weight accessors in TransformerLens shapes, computed from the live parameters on every access."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from .errors import WeightUnavailableError
from .offload import live_parameters
from .specs import FusedQKV, LinearWeight

if TYPE_CHECKING:  # pragma: no cover
    from .hooked_model import HookedModel

Tensor = torch.Tensor


def read_linear(hm: "HookedModel", module: nn.Module) -> LinearWeight:
    """The effective ``[d_in, d_out]`` weight and bias of ``module``, through every plugin.

    A plugin that cannot read a module raises ``WeightUnavailableError``; the module's path in the model
    is put in front of its message here.
    """
    try:
        with live_parameters(module):  # an offloaded module's weights are loaded for the read
            result = hm._hooks.lensadapters_linear_weight(module=module, read=lambda m: read_linear(hm, m))
    except WeightUnavailableError as exc:
        if getattr(exc, "module_name", None) is None:  # the innermost module named, once
            exc.module_name = hm.module_name(module)
            exc.args = (f"{exc.module_name}: {exc.args[0] if exc.args else ''}",) + exc.args[1:]
        raise
    if result is None:
        raise WeightUnavailableError(
            f"lensadapters cannot read the weight of {hm.module_name(module)} ({type(module).__module__}."
            f"{type(module).__name__}): no installed plugin knows this storage format. Install the plugin for "
            f"it (8-bit: `pip install lensadapters[bnb]`) or implement `lensadapters_linear_weight`.")
    return result


def _bias(b: Optional[Tensor], shape: tuple[int, ...], like: Tensor) -> Tensor:
    return b if b is not None else torch.zeros(shape, dtype=like.dtype, device=like.device)


def qkv_weight(hm: "HookedModel", layer: int, which: int) -> tuple[Tensor, Tensor]:
    """``(W, b)`` of the queries (``which=0``), keys (1) or values (2) of one layer: W as ``[heads, d_model, d_head]``.

    Separate projections are read one by one: ``W_Q`` never reads (or fails on) ``k_proj``.
    """
    layout = hm.qkv_layouts[layer]
    block = hm.block_modules[layer]
    if isinstance(layout, FusedQKV):
        lw = read_linear(hm, block.get_submodule(layout.module))
        W = layout.split(lw.W)[which]
        b = layout.split(lw.b)[which] if lw.b is not None else None
    else:
        lw = read_linear(hm, block.get_submodule((layout.q, layout.k, layout.v)[which]))
        W = lw.W.unflatten(-1, (-1, hm.cfg.d_head))
        b = None if lw.b is None else lw.b.unflatten(-1, (-1, hm.cfg.d_head))
    W = W.permute(1, 0, 2)  # [h, d_model, d_head]
    return W, _bias(b, (W.shape[0], W.shape[2]), W)


def qkv_weights(hm: "HookedModel", layer: int) -> tuple[tuple[Tensor, Tensor], ...]:
    """``((W_Q, b_Q), (W_K, b_K), (W_V, b_V))`` of one layer."""
    return tuple(qkv_weight(hm, layer, which) for which in range(3))


def stacked(hm: "HookedModel", which: int, part: int) -> Tensor:
    return torch.stack([qkv_weight(hm, layer, which)[part] for layer in range(hm.cfg.n_layers)])


def repeat_kv(t: Tensor, n_heads: int) -> Tensor:
    """Repeat key/value heads (dim 1 of ``[layers, hkv, ...]``) to ``n_heads`` as grouped attention does."""
    return t.repeat_interleave(n_heads // t.shape[1], dim=1)


def o_weights(hm: "HookedModel", layer: int) -> tuple[Tensor, Tensor]:
    lw = read_linear(hm, hm.block_modules[layer].get_submodule(hm.block_layouts[layer].o_proj))
    W = lw.W.unflatten(0, (hm.cfg.n_heads, -1))  # [h, d_head, d_model]
    return W, _bias(lw.b, (W.shape[-1],), W)


def mlp_weights(hm: "HookedModel", layer: int, role: str) -> tuple[Tensor, Tensor]:
    """``role`` is ``in``, ``gate`` or ``out``; TransformerLens' W_in is the "up" projection of a gated MLP."""
    layout = hm.mlp_layouts[layer]
    if role == "in":
        path = layout.pre_linear or layout.pre
    elif role == "gate":
        if layout.pre_linear is None:
            raise AttributeError("W_gate exists only for gated MLPs (cfg.gated_mlp)")
        path = layout.pre
    else:
        path = layout.out
    lw = read_linear(hm, hm.block_modules[layer].get_submodule(path))
    return lw.W, _bias(lw.b, (lw.W.shape[-1],), lw.W)
