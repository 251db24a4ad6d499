"""Independent references the suites compare hook values with: rotary embeddings from their complex form,
norm outputs from their cached hook points, and the inputs of each block's projections; and the pieces of a
plugin's own hand-written reference forward (:class:`ReferencePoints`, :func:`seeded_tokens`,
:func:`masked_difference`).

Nothing here reads a plugin's code: each value is rebuilt from a definition, the hook points and the
declared layouts (``hm.block_layouts``), so a wrong plugin disagrees with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

import torch

from lensadapters.hooks import norms

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.api.hooked_model import HookedModel
    from lensadapters.hooks.specs import NormSpec

Tensor = torch.Tensor

__all__ = [
    "BlockInputs",
    "ReferencePoints",
    "apply_norm",
    "assert_edits_match",
    "assert_points_match",
    "points_against_reference",
    "block_inputs",
    "masked_difference",
    "norm_out",
    "reference_rope",
    "rope_inv_freq",
    "rotate_by",
    "seeded_tokens",
]


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


# --- a plugin's hand-written reference forward --------------------------------------------------------


class ReferencePoints:
    """The hook points of a reference forward written out by hand: ``point(name, value)`` applies the edit that
    ``edits`` maps ``name`` to (a function ``(value, hook) -> value``, ``hook.name`` the point's name, as a
    lensadapters hook is called), records the value in ``values`` and returns it."""

    def __init__(self, edits: Optional[Mapping[str, Callable[[Tensor, Any], Tensor]]] = None) -> None:
        self.edits = dict(edits or {})
        self.values: dict[str, Tensor] = {}

    def __call__(self, name: str, value: Tensor) -> Tensor:
        if name in self.edits:
            value = self.edits[name](value, SimpleNamespace(name=name))
        self.values[name] = value
        return value


def seeded_tokens(length: int = 9, batch: int = 2, vocab: int = 64) -> Tensor:
    """``batch`` unpadded rows of seeded token ids from 3 to ``vocab - 1`` (the tiny configs' special tokens are
    below 3)."""
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def masked_difference(ours: Tensor, theirs: Tensor, name: str) -> float:
    """The largest difference of two values of point ``name``, after checking that they have one shape and mask the
    same entries (``-inf`` scores)."""
    ours, theirs = ours.double(), theirs.double()
    assert ours.shape == theirs.shape, f"{name}: shape {tuple(ours.shape)} vs the reference's {tuple(theirs.shape)}"
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), f"{name}: masked entries differ"
    finite = torch.isfinite(ours)
    return (ours[finite] - theirs[finite]).abs().max().item() if finite.any() else 0.0


def assert_points_match(
    hm: Any, ids: Tensor, reference: tuple[Tensor, dict[str, Tensor]], atol: float = 1e-4
) -> list[str]:
    """Every hook point that ``reference``, a hand-written forward's ``(logits, values)`` on ``ids``, names holds
    its value within ``atol`` (masking the same entries), and so do the logits; the names compared, in hook order."""
    expected_logits, expected = reference
    with torch.no_grad():
        logits, cache = hm.run_with_cache(ids, names_filter=lambda name: True)
    compared = [name for name in hm.hook_names if name in expected]
    worst = max((masked_difference(cache[n], expected[n], n) for n in compared if cache[n].numel()), default=0.0)
    assert worst < atol, worst
    assert masked_difference(logits, expected_logits, "logits") < atol
    return compared


def points_against_reference(
    contract: Any, config: Any, reference_run: Callable[..., tuple[Tensor, dict[str, Tensor]]]
) -> tuple[list[str], list[str]]:
    """:func:`assert_points_match` on ``contract``'s model of ``config`` (seed 0, wrapped by the contract) and
    :func:`seeded_tokens`, against ``reference_run(model, ids)``; the names compared and every hook point's name (the
    model is unwrapped after)."""
    model = contract.make_model(config, 0)
    hm = contract.wrap(model)
    ids = seeded_tokens()
    compared = assert_points_match(hm, ids, reference_run(model, ids))
    names = list(hm.hook_names)
    hm.unwrap()
    return compared, names


def assert_edits_match(
    hm: Any,
    model: Any,
    ids: Tensor,
    reference_run: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    edit_for: Callable[[str], Callable[[Tensor, Any], Tensor]],
    may_keep_logits: tuple[str, ...] = ("hook_attn_scores", "hook_rot_q", "hook_q", "hook_k"),
) -> None:
    """The edit ``edit_for(name)`` at every hook point that ``reference_run(model, ids, edits)``, a hand-written
    forward returning ``(logits, values)``, names gives the reference's logits with that edit at that point (within
    1e-4 of their scale), and changes the logits unless the point ends with one of ``may_keep_logits``."""
    _, names = reference_run(model, ids)
    with torch.no_grad():
        base = hm(ids).logits
        for name in [n for n in hm.hook_names if n in names]:
            edit = edit_for(name)
            ours = hm.run_with_hooks(ids, fwd_hooks=[(name, edit)])
            theirs, _ = reference_run(model, ids, {name: edit})
            difference = masked_difference(ours, theirs, name)
            assert difference < 1e-4 * max(1.0, theirs.abs().max().item()), (name, difference)
            if names[name].numel() and not name.endswith(may_keep_logits):
                assert not torch.allclose(ours, base), f"editing {name} changed nothing"


def rotate_by(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool = False) -> Tensor:
    """``x`` ``[b, p, h, r]`` rotated by the angles whose ``cos``/``sin`` are ``[b, p, r/2]``: its halves, or
    (``interleave``) its pairs ``(x[2i], x[2i+1])``, laid out ``[first | second]`` after the rotation."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
