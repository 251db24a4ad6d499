"""Weight accessors in TransformerLens shapes, computed from the live parameters on every access."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from .errors import WeightUnavailableError
from .specs import FusedQKV, LinearWeight

if TYPE_CHECKING:  # pragma: no cover
    from .hooked_model import HookedModel

Tensor = torch.Tensor


def read_linear(hm: "HookedModel", module: nn.Module) -> LinearWeight:
    """The effective ``[d_in, d_out]`` weight and bias of ``module``, through every plugin."""
    result = hm._hooks.lensadapters_linear_weight(module=module, read=lambda m: read_linear(hm, m))
    if result is None:
        raise WeightUnavailableError(
            f"lensadapters cannot read the weight of {hm.module_name(module)} ({type(module).__module__}."
            f"{type(module).__name__}): no installed plugin knows this storage format. Install the plugin for "
            f"it (8-bit: `pip install lensadapters[bnb]`) or implement `lensadapters_linear_weight`.")
    return result


def _bias(b: Optional[Tensor], shape: tuple[int, ...], like: Tensor) -> Tensor:
    return b if b is not None else torch.zeros(shape, dtype=like.dtype, device=like.device)


def qkv_weights(hm: "HookedModel", layer: int) -> tuple[tuple[Tensor, Tensor], ...]:
    """``((W_Q, b_Q), (W_K, b_K), (W_V, b_V))`` of one layer: W as ``[heads, d_model, d_head]``."""
    layout = hm.qkv_layouts[layer]
    block = hm.blocks[layer]
    cfg = hm.cfg
    if isinstance(layout, FusedQKV):
        lw = read_linear(hm, block.get_submodule(layout.module))
        Ws = layout.split(lw.W)
        bs = layout.split(lw.b) if lw.b is not None else (None, None, None)
        parts = list(zip(Ws, bs))
    else:
        parts = []
        for path in (layout.q, layout.k, layout.v):
            lw = read_linear(hm, block.get_submodule(path))
            parts.append((lw.W.unflatten(-1, (-1, cfg.d_head)), None if lw.b is None else lw.b.unflatten(-1, (-1, cfg.d_head))))
    out = []
    for W, b in parts:
        W = W.permute(1, 0, 2)  # [h, d_model, d_head]
        out.append((W, _bias(b, (W.shape[0], W.shape[2]), W)))
    return tuple(out)  # type: ignore[return-value]


def stacked(hm: "HookedModel", which: int, part: int) -> Tensor:
    return torch.stack([qkv_weights(hm, layer)[which][part] for layer in range(hm.cfg.n_layers)])


def repeat_kv(t: Tensor, n_heads: int) -> Tensor:
    """Repeat key/value heads (dim 1 of ``[layers, hkv, ...]``) to ``n_heads`` as grouped attention does."""
    return t.repeat_interleave(n_heads // t.shape[1], dim=1)


def o_weights(hm: "HookedModel", layer: int) -> tuple[Tensor, Tensor]:
    lw = read_linear(hm, hm.blocks[layer].get_submodule(hm.block_layouts[layer].o_proj))
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
    lw = read_linear(hm, hm.blocks[layer].get_submodule(path))
    return lw.W, _bias(lw.b, (lw.W.shape[-1],), lw.W)
