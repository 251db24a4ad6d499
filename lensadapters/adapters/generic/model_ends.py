"""The ends of the stack, read from the probe: the final norm (a norm child outside the layers reading the last layer's
output, or one in front of a prediction head, or proof that the unembedding reads the last layer as it is), the
embedding's scale (in every dtype: the factor and where the model applies it) and the logits' scale. Used by
:func:`.identify.identify`."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.norms import NormBehaviour, norm_behaviour
from lensadapters.adapters.generic.probe import Recording, run_embedding_edit
from lensadapters.adapters.generic.structure import Structure

Tensor = torch.Tensor

#: why a model whose unembedding reads the last layer's output as it is has no ``ln_final`` point
NO_FINAL_NORM = (
    "the model has no final norm: the unembedding reads the last layer's output exactly as it is (the point is not "
    "part of this architecture, as in TransformerLens' post-LN HookedEncoder)"
)


def _final_norm(
    model: nn.Module, structure: Structure, rec: Recording
) -> tuple[Optional[str], Optional[NormBehaviour]]:
    last = rec.last_hidden
    if last is None:
        return None, None
    candidates = []
    for name, record in rec.outside_out.items():
        x = rec.outside_in.get(name)
        if (
            (record.calls == 1 or once_after_blocks(rec, name))
            and x is not None
            and name != structure.embed
            and record.value.shape == last.shape
            and torch.equal(record.value, last)
            and not (x.shape == last.shape and torch.equal(x, last))
        ):
            candidates.append(name)
    if len(candidates) != 1:
        return None, None
    module = model.get_submodule(candidates[0])
    behaviour = norm_behaviour(module, rec.outside_in[candidates[0]], rec.outside_out[candidates[0]].value)
    return (candidates[0], behaviour) if behaviour is not None else (None, None)


def once_after_blocks(rec: Recording, name: str) -> bool:
    """Whether the module ``name`` outside the layers, which the model runs more than once in a forward, runs once
    after the last layer ends, and then on that layer's output (NanoChat's final norm, which also normalizes the
    embeddings): its points are served on that call only (``ModelLayout.ln_final_after_blocks``)."""
    record, x = rec.outside_out.get(name), rec.outside_in.get(name)
    exits = [k for k, e in enumerate(rec.events) if e[0] == "exit"]
    last = rec.layer_out.get(max(rec.layer_out)) if rec.layer_out else None
    if record is None or record.calls < 2 or x is None or last is None or not exits:
        return False
    after = [e for e in rec.events[exits[-1] + 1 :] if e == ("outside", name)]
    return len(after) == 1 and x.shape == last.value.shape and torch.equal(x, last.value)


def _head_norm(model: nn.Module, structure: Structure, rec: Recording, n: int) -> tuple[Optional[str], Any]:
    """The norm of the last layer's output that a prediction head follows (``_no_final_norm`` names it): its path
    and behaviour, served as ``ln_final`` (its values are the norm's) while ``final @ W_U`` is refused."""
    last = rec.layer_out.get(n - 1)
    for name, record in rec.outside_out.items():
        x = rec.outside_in.get(name)
        if last is None or x is None or name == structure.embed or x.shape != last.value.shape:
            continue
        if record.calls == 1 and torch.equal(x, last.value):
            behaviour = norm_behaviour(model.get_submodule(name), x, record.value)
            if behaviour is not None:
                return name, behaviour
    return None, None


def _no_final_norm(model: nn.Module, structure: Structure, rec: Recording, n: int) -> str:
    """Why no final norm is served: the general reason, or the norm of the last layer's output that the model
    computes more from before the unembedding (a prediction head), or that the model has none (the unembedding reads
    the last layer's output exactly as it is)."""
    last = rec.layer_out.get(n - 1)
    head = rec.last_hidden
    if last is not None and head is not None and head.shape == last.value.shape and torch.equal(head, last.value):
        return NO_FINAL_NORM
    for name, record in rec.outside_out.items():
        x = rec.outside_in.get(name)
        if last is None or x is None or name == structure.embed or x.shape != last.value.shape:
            continue
        if not torch.equal(x, last.value):
            continue
        if record.calls > 1:
            return (
                f"{name} reads the last layer's output, but the model runs it {record.calls} times in a forward "
                f"(also elsewhere), so a hook on it would not be one point"
            )
        if norm_behaviour(model.get_submodule(name), x, record.value) is not None:
            return (
                f"{name} normalizes the last layer's output, but the model computes more from it before the "
                f"unembedding (a prediction head), so final @ W_U would not be the logits"
            )
    return (
        "no module outside the layers both produces the model's last hidden state and computes a LayerNorm or "
        "RMSNorm of its input"
    )


def _constant_factors(config: object, a: Tensor, b: Tensor) -> list[float]:
    """Candidates for ``c`` in ``b == a * c``: the float32 ratio (and its neighbours) and any number in the config
    that is close to it (the multiplier is a config value; nothing is looked up by name)."""
    a64, b64 = a.double(), b.double()
    usable = a64.abs() > 1e-6
    if a.shape != b.shape or not bool(usable.any()):
        return []
    ratio = float((b64[usable] / a64[usable]).median())
    if ratio == 0.0 or not torch.isfinite(torch.tensor(ratio)):
        return []
    values: dict = getattr(config, "to_dict", lambda: {})()
    close = [
        float(v)
        for v in values.values()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(float(v) - ratio) <= 1e-3 * abs(ratio)
    ]
    f32 = torch.tensor(ratio, dtype=torch.float32)
    neighbours = [f32, torch.nextafter(f32, f32 + 1), torch.nextafter(f32, f32 - 1)]
    return list(dict.fromkeys(close + [float(t) for t in neighbours]))


def _embed_scale(model: nn.Module, structure: Structure, rec: Recording) -> tuple[Optional[float], bool, bool, str]:
    """``(factor, rounded, in_place, why)``: the first layer's input is the embedding module's output times ``factor``
    (1.0: as it is) computed as a tensor of the embeddings' dtype (``rounded``) or with the Python float, or
    (``in_place``) the model multiplied the module's output tensor by it in place and added more to it before the
    first layer; ``None`` and why not otherwise."""
    out, x = rec.outside_out.get(structure.embed), rec.first_layer_in
    if out is None or x is None:
        return None, False, False, "the probe did not see the embedding module's output reach the first layer"
    e = out.value
    if e.shape == x.shape and torch.equal(e, x):
        return 1.0, False, False, ""
    for factor in _constant_factors(model.config, e, x):
        for rounded in (False, True):
            product = e * torch.tensor(factor, dtype=e.dtype) if rounded else e * factor
            if torch.equal(product, x):
                return factor, rounded, False, ""
    # the model changes them further (adds position embeddings, normalizes them): hook_embed is the module's
    # output, as TransformerLens' (an edit there is what a plain hook on the module does), unless the model also
    # multiplies them by a constant: an edit would then reach the layers scaled, and hook_embed is not served
    delta = torch.randn(e.shape, generator=torch.Generator().manual_seed(1)).to(e.dtype).to(e.device)
    layers = list(model.get_submodule(structure.layers))
    edited = run_embedding_edit(
        model, model.get_submodule(structure.embed), layers[0], rec.input_ids, delta, rec.interface
    )
    if edited is not None and edited.shape == x.shape == e.shape:  # not where the model projects the embeddings
        change, d = edited.double() - x.double(), delta.double()
        factor = float((change * d).sum() / (d * d).sum())
        eps = torch.finfo(x.dtype).eps if x.is_floating_point() else 0.0
        tol = 4 * eps * float(max(x.double().abs().max(), edited.double().abs().max()))
        if abs(factor - 1.0) > 1e-3 and torch.allclose(change, d * factor, atol=tol * max(1.0, abs(factor)), rtol=0):
            in_place = _scaled_in_place(model, out, factor)
            if in_place is not None:  # the module's own output tensor, scaled in place: hook_embed is that tensor
                return in_place[0], in_place[1], True, ""
            return (
                None,
                False,
                False,
                (
                    f"the model multiplies the embedding module's output by {factor:.6g} and adds something before the "
                    f"first layer, so neither the module's output nor the first layer's input is the scaled embeddings"
                ),
            )
    return 1.0, False, False, ""


def _scaled_in_place(model: nn.Module, out: Any, factor: float) -> Optional[tuple[float, bool]]:
    """``(factor, rounded)`` where the model multiplied the embedding module's output tensor itself, in place, by the
    constant an edit of it reaches the first layer times (``embeddings *= factor``, then more added to it); ``None``
    otherwise. :func:`.identify.identify` then serves ``hook_embed`` as that tensor
    (``ModelLayout.embed_scale_in_place``)."""
    if not out.written_later:
        return None
    e, now = out.value, out.tensor.detach()
    for candidate in _constant_factors(model.config, e, now):
        if abs(candidate - factor) > 1e-3 * abs(factor):
            continue
        for rounded in (False, True):
            product = e * torch.tensor(candidate, dtype=e.dtype) if rounded else e * candidate
            if torch.equal(product, now):
                return candidate, rounded
    return None


def _table_scale(model: nn.Module, structure: Structure, rec: Recording) -> tuple[Optional[float], str]:
    """``(factor, why)``: the embedding module's output is its weight's rows times ``factor`` (as a tensor of the
    weight's dtype, as the core computes ``W_E``); ``None`` and why not otherwise."""
    weight = getattr(model.get_submodule(structure.embed), "weight", None)
    out, ids = rec.outside_out.get(structure.embed), rec.input_ids
    why = "the embedding module's output is not its weight's rows (times a constant)"
    if not isinstance(weight, Tensor) or weight.dim() != 2 or out is None or ids is None:
        return None, why
    rows = weight.detach()[ids.to(weight.device)]
    if rows.shape == out.value.shape and torch.equal(rows, out.value):
        return 1.0, ""
    for factor in _constant_factors(model.config, rows, out.value):
        if torch.equal(rows * torch.tensor(factor, dtype=rows.dtype), out.value):
            return factor, ""
    return None, why


def _logit_scale(rec: Recording, structure: Structure) -> tuple[Optional[float], str]:
    """``(factor, why)``: the logits are the unembedding's output times ``factor``; ``None`` and why not otherwise."""
    out = rec.outside_out.get(structure.unembed) if structure.unembed is not None else None
    logits = rec.logits
    if out is None or logits is None:
        return 1.0, ""  # no head, or no logits to compare with: W_U is the head's weight (or absent)
    u = out.value
    if u.shape == logits.shape and torch.equal(u, logits):
        return 1.0, ""
    for factor in _constant_factors(_NoConfig(), u, logits)[:1]:
        atol, rtol = (1e-5, 1e-4) if logits.dtype in (torch.float32, torch.float64) else (1e-2, 1e-2)
        if torch.allclose(u.double() * factor, logits.double(), atol=atol, rtol=rtol):
            return factor, ""
    return None, (
        "the model's logits are not its unembedding's output (nor a constant multiple of it): it transforms them "
        "after the unembedding (a softcap?), so final @ W_U would not be the logits"
    )


class _NoConfig:
    def to_dict(self) -> dict:
        return {}
