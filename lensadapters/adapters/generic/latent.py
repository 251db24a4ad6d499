"""The automatic description of multi-head latent attention (the core's :class:`LatentAttention` form), read from the
probe's values inside a layer's attention module (nothing is taken from module names or classes):

* **output projection**: the one linear module whose input is the attention function's output (heads merged) and
  whose output is the attention module's;
* **key/value up-projection**: a linear module whose output, split into the attention's heads, is per head
  ``[no-rope key | value]``: its last ``v`` columns (the value head size) are the values the attention function
  gets, and its first ``nope`` the first columns of the keys it gets (``nope``: what is left of each head);
* **key/value latent**: the module inside the attention module whose output is the up-projection's input (its norm,
  ``hook_kv_latent``), and the **down-projection**: the linear module reading the attention input whose output is
  ``[that norm's input | rope key]``, with as many rope columns as the keys have beyond ``nope``;
* **rotary**: rotate-half, or interleaved pairs laid out ``[even' | odd']``, on the rope columns, with the layer's
  ``(cos, sin)``: ``[no-rope key | rope key]`` of every head rotated so is the keys the attention function gets;
* **queries**: a linear module whose output, split into heads and rotated the same way, is the queries the
  attention function gets: reading the attention input (no query latent), or the output of a module (the query
  latent's norm, ``hook_q_latent``) whose input is the output of a linear module reading the attention input.

Every point it then serves is verified at wrap time (:mod:`.verify`, with the references of
:func:`.references.latent_reference`);
``W_K``/``W_V`` (and ``W_Q`` with a query latent) are refused by name (:func:`.latent_attention.refused_weight`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.probe import InterfaceCall, Recording, _close
from lensadapters.adapters.latent_attention import (
    LatentAttention,
    LatentQKV,
    form_of,
    latent_layer_sites,
    latent_points,
    latent_rotary,
    three_d,
)
from lensadapters.hooks.sites import Site
from lensadapters.hooks.specs import RotarySpec

Tensor = torch.Tensor
#: the rope layouts the automatic description tries (a complex rotary table is not read: see :mod:`.describe`)
TRIED_LAYOUTS = ("rotate_half", "interleaved")


def _linear(module: nn.Module) -> bool:
    """A linear module (or a quantized or adapted one: a 2-D ``weight`` in a class named ``...Linear``)."""
    weight = getattr(module, "weight", None)
    named = "Linear" in type(module).__name__
    return isinstance(module, nn.Linear) or (isinstance(weight, Tensor) and weight.dim() == 2 and named)


def _rotated(spec: Optional[RotarySpec], x: Tensor, cos_sin: Optional[tuple[Tensor, Tensor]]) -> Optional[Tensor]:
    if spec is None:
        return x
    if cos_sin is None:
        return None
    try:
        return spec.apply(x, *cos_sin)
    except RuntimeError:
        return None


def describe_latent_attention(
    layer: nn.Module,
    i: int,
    attn: str,
    call: InterfaceCall,
    rec: Recording,
    cos_sin: Optional[tuple[Tensor, Tensor]],
    attn_in: Tensor,
    attn_out: Tensor,
) -> Optional[tuple[LatentQKV, str]]:
    """``(the layer's LatentQKV, the output projection's path)`` where the layer's attention is latent attention
    (see the module docstring), ``None`` where it is not of that shape."""
    if call.query is None or call.key is None or call.value is None or call.kv_heads != call.heads:
        return None
    prefix, heads = attn + ".", call.heads
    seen = {
        path: (three_d(x), three_d(y))
        for (j, path), (x, y) in rec.inner.items()
        if j == i and path.startswith(prefix) and x is not None and y is not None
    }
    linears = {p for p in seen if _linear(layer.get_submodule(p))}
    z = call.output.value.flatten(-2)
    o_proj = [p for p in linears if _close(seen[p][0], z) and _close(seen[p][1], attn_out)]
    if len(o_proj) != 1:
        return None
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (call.query, call.key, call.value))  # [b, p, h, d]
    d, dv = q_t.shape[-1], v_t.shape[-1]
    for up in sorted(linears):
        y_up = seen[up][1]
        if y_up.shape[:2] != v_t.shape[:2] or y_up.shape[-1] % heads:
            continue
        nope = y_up.shape[-1] // heads - dv
        if not 0 < nope < d or k_t.shape[-1] != d:
            continue
        parts = y_up.unflatten(-1, (heads, nope + dv))
        if not (_close(parts[..., nope:], v_t) and _close(parts[..., :nope], k_t[..., :nope])):
            continue
        found = _latent_of(seen, linears, up, parts[..., :nope], d - nope, attn_in, k_t, q_t, cos_sin)
        if found is not None:
            norm, down, rank, spec, q, q_down, q_norm = found
            form = LatentAttention(
                q,
                down,
                norm,
                up,
                heads=heads,
                kv_rank=rank,
                nope=nope,
                rope=d - nope,
                v_head_dim=dv,
                rotary=spec,
                q_down=q_down,
                q_norm=q_norm,
            )
            return form.qkv(), o_proj[0]
    return None


def _latent_of(
    seen: dict[str, tuple[Tensor, Tensor]],
    linears: set[str],
    up: str,
    k_nope: Tensor,
    rope: int,
    attn_in: Tensor,
    k_t: Tensor,
    q_t: Tensor,
    cos_sin: Optional[tuple[Tensor, Tensor]],
) -> Optional[tuple[str, str, int, Optional[RotarySpec], str, Optional[str], Optional[str]]]:
    """``(kv norm, kv down-projection, kv rank, rotary, query projection, query down-projection, query norm)``."""
    latent = seen[up][0]
    for norm in sorted(p for p in seen if p not in linears and _close(seen[p][1], latent)):
        x_norm = seen[norm][0]
        rank = x_norm.shape[-1]
        for down in sorted(linears):
            x, y = seen[down]
            if not (_close(x, attn_in) and y.shape[-1] == rank + rope and _close(y[..., :rank], x_norm)):
                continue
            shared = y[..., rank:].unsqueeze(-2).expand(*k_nope.shape[:-1], rope)
            keys = torch.cat((k_nope, shared.to(k_nope.dtype)), dim=-1)
            nope = k_nope.shape[-1]
            specs: list[Optional[RotarySpec]] = [latent_rotary(nope, rope, layout) for layout in TRIED_LAYOUTS]
            for spec in [*specs, None] if cos_sin is not None else [None]:
                if not _close(_rotated(spec, keys, cos_sin), k_t):
                    continue
                query = _queries(seen, linears, {up, down}, attn_in, q_t, spec, cos_sin)
                if query is not None:
                    return (norm, down, rank, spec, *query)
    return None


def _queries(
    seen: dict[str, tuple[Tensor, Tensor]],
    linears: set[str],
    taken: set[str],
    attn_in: Tensor,
    q_t: Tensor,
    spec: Optional[RotarySpec],
    cos_sin: Optional[tuple[Tensor, Tensor]],
) -> Optional[tuple[str, Optional[str], Optional[str]]]:
    """``(query projection, its latent's down-projection, its latent's norm)``: the projection whose output, split
    into heads and rotated with ``spec``, is the queries; reading the attention input or a norm of a down-projection
    of it."""
    heads = q_t.shape[-2]
    for q in sorted(linears - taken):
        x, y = seen[q]
        if y.shape[-1] != q_t.shape[-2] * q_t.shape[-1] or not _close(
            _rotated(spec, y.unflatten(-1, (heads, -1)), cos_sin), q_t
        ):
            continue
        if _close(x, attn_in):
            return q, None, None
        for norm in sorted(p for p in seen if p not in linears and _close(seen[p][1], x)):
            for down in sorted(linears - taken - {q}):
                if _close(seen[down][0], attn_in) and _close(seen[down][1], seen[norm][0]):
                    return q, down, norm
    return None


# --- the generic adapter's sites and references of the described latent layers ------------------------------


def latent_forms(hooked: Any) -> dict[int, LatentAttention]:
    """The described layers' latent attention forms, by layer."""
    forms = {i: form_of(hooked, i) for i in range(len(hooked.block_modules)) if hooked.block_layouts[i] is not None}
    return {i: f for i, f in forms.items() if f is not None}


def claim_latent_points(hooked: Any) -> set[str]:
    """Create every described latent layer's points (:func:`.latent_attention.latent_points`); their names."""
    return {name for i, form in latent_forms(hooked).items() for name in latent_points(hooked, i, form)}


def latent_sites_served(hooked: Any) -> list[Site]:
    """The sites of the latent points still served (after the verification removed what failed)."""
    return [s for i, form in latent_forms(hooked).items() for s in latent_layer_sites(hooked, i, form)]
