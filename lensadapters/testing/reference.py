"""Independent references the suites compare hook values with: rotary embeddings from their complex form,
norm outputs from their cached hook points, and the inputs of each block's projections.

Nothing here reads a plugin's code: each value is rebuilt from a definition, the hook points and the
declared layouts (``hm.block_layouts``), so a wrong plugin disagrees with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from lensadapters.hooks import norms

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.api.hooked_model import HookedModel
    from lensadapters.hooks.specs import NormSpec

Tensor = torch.Tensor

__all__ = ["BlockInputs", "apply_norm", "block_inputs", "norm_out", "reference_rope", "rope_inv_freq"]


# --- rotary embeddings ----------------------------------------------------------------------------------


def rope_inv_freq(rotary_dim: int, base: float = 10000.0) -> Tensor:
    """The unscaled inverse frequencies ``base ** (-2i / rotary_dim)``, ``i < rotary_dim / 2``, in float64."""
    return base ** (-torch.arange(rotary_dim // 2, dtype=torch.float64) * 2 / rotary_dim)


def reference_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotary embeddings written from the paper's complex form, in float64.

    Pairs of dimensions form complex numbers, each multiplied by ``exp(1j * position * inv_freq[i])``: dims
    ``(i, i + r/2)`` (rotate-half: GPT-NeoX, Llama) or, with ``interleaved``, ``(2i, 2i + 1)`` (GPT-J), where
    ``r = 2 * len(inv_freq)``; dims ``>= r`` pass through (partial rotary). ``x`` is ``[b, p, h, d]``,
    ``positions`` ``[b or 1, p]``; scaled rope types are a matter of ``inv_freq``.
    """
    xd = x.double()
    half = inv_freq.shape[-1]
    if half == 0:
        return xd
    rotary_dim = 2 * half
    angle = positions.double()[..., None] * inv_freq  # [b, p, r/2]
    rotation = torch.polar(torch.ones_like(angle), angle)[..., None, :]  # broadcast over heads
    if interleaved:
        z = torch.complex(xd[..., 0:rotary_dim:2], xd[..., 1:rotary_dim:2]) * rotation
        rotated = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        z = torch.complex(xd[..., :half], xd[..., half:rotary_dim]) * rotation
        rotated = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rotated, xd[..., rotary_dim:]], dim=-1)


# --- norms ------------------------------------------------------------------------------------------------


def norm_out(hm: "HookedModel", cache: Any, prefix: str) -> Tensor:
    """The output of the norm at ``prefix`` (``"blocks.0.ln1"``, ``"ln_final"``...) from its cached
    ``hook_normalized``: a LayerNorm's already includes weight and bias, an RMSNorm's is multiplied by its
    weight here (TransformerLens semantics)."""
    normalized = cache[f"{prefix}.hook_normalized"]
    spec = hm.norm_spec(hm.norm_module(prefix))
    if spec.kind == "LN" or spec.weight is None:
        return normalized
    return normalized * (spec.weight + spec.weight_offset)


def apply_norm(spec: "NormSpec", x: Tensor) -> Tensor:
    """The norm described by ``spec`` applied to ``x`` (float32 arithmetic, cast back to ``x``'s dtype)."""
    scale = norms.scale(x, spec)
    if spec.kind == "LN":
        return norms.layer_norm(x, spec, scale)
    return norms.rms_weighted_delta(norms.rms_normalized(x, scale), spec).to(x.dtype)


# --- the inputs of each block's projections -------------------------------------------------------------------


@dataclass(frozen=True)
class BlockInputs:
    """What the projections of block ``layer`` read, rebuilt from a cache of every hook point.

    ``attn_in``: the input of the query, key and value projections (ln1's output; the block input for
    post-LN blocks). ``mlp_in``: the input of the MLP's first projection(s) (ln2's output; ``hook_mlp_in`` for
    post-LN blocks; ln1's output for a parallel block sharing one norm), ``None`` where the layout shows none.
    """

    layer: int
    attn_in: Tensor
    mlp_in: Optional[Tensor]


def block_inputs(hm: "HookedModel", cache: Any) -> Iterator[BlockInputs]:
    """:class:`BlockInputs` of every block, in order: the walk behind the TransformerLens weight identities
    (``hook_q == attn_in @ W_Q + b_Q``, ``hook_pre == mlp_in @ W_in + b_in``...)."""
    for i in range(hm.cfg.n_layers):
        layout = hm.block_layouts[i]
        # post-LN blocks and blocks without a pre-attention norm (OLMo 2): attention reads the block input
        if layout.post_norm or layout.ln1 is None:
            attn_in = cache["resid_pre", i]
        else:
            attn_in = norm_out(hm, cache, f"blocks.{i}.ln1")
        mlp_in: Optional[Tensor] = None
        if layout.ln2 is not None:  # post-LN: the MLP reads ln1's output, which hook_mlp_in shows
            mlp_in = cache["mlp_in", i] if layout.post_norm else norm_out(hm, cache, f"blocks.{i}.ln2")
        elif layout.parallel:  # a parallel block sharing one norm (GPT-J): the MLP reads ln1's output
            mlp_in = attn_in
        else:  # no pre-MLP norm (OLMo 2): the MLP reads the residual stream, which hook_mlp_in shows
            mlp_in = cache["mlp_in", i]
        yield BlockInputs(i, attn_in, mlp_in)
