"""What the generic adapter can say about a model: which hook points it serves, where, and why others are absent.

The rules (each decided per model, and per layer where layers differ; nothing is taken from a table of names):

* **Embeddings** (``hook_embed``, ``W_E``): the embedding module's output (TransformerLens' token embeddings, before
  the position embeddings or a norm the model adds); when the model multiplies it by a constant (Granite's
  ``embedding_multiplier``), the product, which is the first layer's input (checked in every forward:
  ``ModelLayout.embed_scale_after_module``), and ``W_E`` times the constant. Neither where the model multiplies by a
  constant and then adds something (a second probe forward with an edited embedding output shows how an edit
  reaches the first layer), nor ``W_E`` where the module's output is not its weight's rows (times a constant).
* **Blocks** (``hook_resid_pre``/``hook_resid_post``): the decoder-layer list of :mod:`.structure`, served when the
  probe saw every layer run exactly once, in order, and each layer's output is exactly what the model continues
  with (the next layer's input, or the input of a module after the layers): a layer that returns only its change,
  which the model's own code adds to the residual, gets neither point (its input and output are not the residual
  stream an edit would change).
* **Attention function** (``attn.hook_z``): a layer that calls transformers' attention interface exactly once, with a
  module inside that layer. ``hook_z`` is that call's output ``[b, p, h, d_head]`` (per head, the pattern-weighted
  mix of values, before heads are merged for the output projection); an edit replaces what the model continues with.
* **Patterns** (``attn.hook_attn_scores``/``attn.hook_pattern``): additionally, the arguments of that call are plain
  attention's (or add only a score softcap or sinks, ``s_aux``, which the explicit attention applies as eager
  attention does; no other extras) and the core's explicit attention reproduced the weights and the output of the
  model's own eager attention function on them, in the probe.
* **Attention and MLP outputs** (``hook_attn_out``/``hook_mlp_out``): the attention module is the layer's direct child
  that holds the module the attention interface is called with; for a layer that computes attention without the
  interface, the one direct child whose class name ends in ``Attention`` (transformers' naming convention). The MLP
  module is the one other direct child with matrix parameters (norms and dropouts have none). Both are served only
  when the layer's output is exactly its input plus the two modules' outputs (``resid_post = resid_pre + attn_out +
  mlp_out``, sequential or parallel), checked on the probe: a block that scales its branches, adds the residual
  inside them or normalizes after them fails it, and gets neither point. A layer running a second token mixer beside
  its attention module (both before its middle) or an MLP of two modules: :mod:`.parallel`.
* **Final norm** (``ln_final.hook_normalized``): the one module outside the layers, run once, whose output is the
  model's last hidden state and differs from its input, and whose output is LayerNorm or RMSNorm of its input with
  its own parameters. TransformerLens' meaning: a LayerNorm's output; an RMSNorm's ``x / scale`` (before the weight).
* **Unembedding** (``W_U``): the output embeddings' weight when the logits are the unembedding's output; times the
  constant when the model scales the logits after it (Cohere's ``logit_scale``, Granite's ``logits_scaling``), so
  that ``final @ W_U`` is the logits; not served when the model transforms them otherwise (a softcap).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.model_ends import (  # noqa: F401  (their old import path)
    NO_FINAL_NORM,
    _embed_scale,
    _final_norm,
    _head_norm,
    _logit_scale,
    _no_final_norm,
    _table_scale,
    once_after_blocks,
)
from lensadapters.adapters.generic.norms import NormBehaviour
from lensadapters.adapters.generic.probe import Recording, flattened, run_probe
from lensadapters.adapters.generic.structure import Structure, find_structure

Tensor = torch.Tensor
BRANCHES = ("hook_attn_out", "hook_mlp_out")
PATTERNS = ("attn.hook_attn_scores", "attn.hook_pattern")


@dataclass(frozen=True)
class BlockFindings:
    """What the generic adapter serves in one decoder layer (paths relative to the layer)."""

    points: tuple[str, ...]  # the layer's hook points (relative to ``blocks.{i}.``), in the order they fire
    attn: Optional[str] = None  # the child whose output is hook_attn_out
    mlp: Optional[str] = None  # the child whose output is hook_mlp_out
    attention_function: Optional[str] = None  # the module the attention interface is called with ("" = the layer)
    copied: frozenset[str] = frozenset()  # points whose tensor the model writes into after producing it
    flat: frozenset[str] = frozenset()  # branch points whose module returns ``[b * p, d]`` (served as ``[b, p, d]``)
    mixer: Optional[Any] = None  # a layer of the mixer form: its norms', MLP's and mixer's points (:mod:`.mixer`)
    beside: Optional[str] = None  # the token mixer run beside the attention, whose output is hook_mixer_out (.parallel)


@dataclass(frozen=True)
class Findings:
    """Everything the generic adapter found out about one model (see the module docstring)."""

    structure: Structure
    blocks: tuple[BlockFindings, ...]
    final_norm: Optional[str] = None
    final_norm_behaviour: Optional[NormBehaviour] = None
    copied: frozenset[str] = frozenset()  # model-level points whose tensor the model writes into afterwards
    embed_scale: Optional[float] = 1.0  # hook_embed = embedding output * embed_scale (None: hook_embed not served)
    embed_scale_rounded: bool = False  # the model multiplies by the factor in the embeddings' dtype
    embed_scaled_in_module: bool = False  # the embedding module's output includes the factor (else: after it)
    embed_scaled_in_place: bool = False  # the model scales the module's output tensor in place, then adds to it
    final_norm_after_blocks: bool = False  # the final norm also runs elsewhere: served on its call after the layers
    logit_scale: Optional[float] = 1.0  # logits = unembedding output * logit_scale (None: W_U not served)
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    d_head: Optional[int] = None
    missing: dict[str, str] = field(default_factory=dict)  # absent points (a plain-language group) -> why
    unserved_weights: dict[str, str] = field(default_factory=dict)  # W_E / W_U the probe could not verify -> why
    description: Optional[Any] = None  # the automatic description (:mod:`.describe`), where a layer has one
    unverified: dict[str, str] = field(default_factory=dict)  # described points that failed verification -> why
    #: described layers whose attention the model computes in its own code (:mod:`.own_attention`): layer -> heads
    own_attention: dict[int, int] = field(default_factory=dict)


def _sums_to_output(x: Tensor, parts: list[Tensor], y: Tensor) -> bool:
    """Whether ``y == x + sum(parts)`` up to rounding, with every part non-zero (a zero part proves nothing); a part
    with its leading dimensions merged (:func:`flattened`) counts in ``y``'s shape."""
    parts = [p.reshape(y.shape) if flattened(p, y) else p for p in parts]
    if any(p.shape != y.shape for p in parts) or x.shape != y.shape:
        return False
    norms = [p.float().norm() for p in parts]
    if any(n == 0 for n in norms):
        return False
    expected = x.float()
    for p in parts:
        expected = expected + p.float()
    eps = torch.finfo(y.dtype).eps if y.is_floating_point() else 0.0
    scale = sum(norms)
    tol = 1e-3 * scale + 8 * eps * (x.float().norm() + scale + y.float().norm())
    return bool((y.float() - expected).norm() <= tol)


def _has_matrix(module: nn.Module) -> bool:
    return any(p.dim() >= 2 for p in module.parameters())


def _child_holding(layer: nn.Module, module: nn.Module) -> Optional[str]:
    for name, child in layer.named_children():
        if any(m is module for m in child.modules()):
            return name
    return None


def _relative_path(layer: nn.Module, module: nn.Module) -> Optional[str]:
    for name, candidate in layer.named_modules():
        if candidate is module:
            return name
    return None


class _Notes:
    """Absent points and why, grouped for the warning (layers listed when only some lack a point)."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.by_group: dict[str, dict[str, list[int]]] = {}

    def add(self, group: str, reason: str, layer: int) -> None:
        self.by_group.setdefault(group, {}).setdefault(reason, []).append(layer)

    def result(self) -> dict[str, str]:
        out = {}
        for group, reasons in self.by_group.items():
            parts = []
            for reason, layers in reasons.items():
                where = "" if len(layers) == self.n_layers else f" (layers {layer_ranges(layers)})"
                parts.append(reason + where)
            out[group] = "; ".join(parts)
        return out


def layer_ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    spans: list[list[int]] = []
    for i in sorted(set(layers)):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _block(
    i: int,
    layer: nn.Module,
    rec: Recording,
    notes: _Notes,
    stream: bool,
    mixing: Optional[Any] = None,
    model: Optional[nn.Module] = None,
    hybrid: bool = False,
) -> BlockFindings:
    """``stream``: the layer's input and output are the residual stream (see :func:`_continues`); ``mixing``: what
    :func:`.mixer.probe_mixers` saw of the layer (the mixer form, tried where the attention-and-MLP form fails, and
    on every layer of a ``hybrid``: a model where some layer has the mixer form)."""
    calls = [c for c in rec.calls if c.layer == i]
    attention_function = attn = mlp = None
    patterns = False
    if len(calls) == 1:
        attention_function = _relative_path(layer, calls[0].module)
        attn = _child_holding(layer, calls[0].module)
        if calls[0].pattern_problem is None:
            patterns = True
        else:
            notes.add("attention scores and patterns", calls[0].pattern_problem, i)
    else:
        why = (
            "the decoder layers do not call transformers' attention interface (they compute attention in the "
            "model's own code)"
            if not calls
            else "the layers call the attention interface more than once"
        )
        notes.add("attention scores, patterns and hook_z", why, i)
        named = [n for n, c in layer.named_children() if type(c).__name__.endswith("Attention")]
        attn = named[0] if len(named) == 1 else None
    if attn is not None:
        others = [n for n, c in layer.named_children() if n != attn and _has_matrix(c)]
        mlp = others[0] if len(others) == 1 else None
    x, y = rec.layer_in.get(i), rec.layer_out.get(i)
    outputs = [rec.children.get((i, n)) for n in (attn, mlp) if n is not None]
    branches_ok = (
        attn is not None
        and mlp is not None
        and x is not None
        and y is not None
        and all(o is not None and o.calls == 1 for o in outputs)
        and _sums_to_output(x.value, [o.value for o in outputs], y.value)
    )
    form = beside = None
    if stream and (not branches_ok or hybrid):  # the mixer form: a token mixer of any kind and an MLP (.mixer)
        from lensadapters.adapters.generic import mixer as mixer_form

        attention = _child_holding(layer, calls[0].module) if len(calls) == 1 else None
        found = (attn, mlp) if branches_ok else mixer_form.branches(i, layer, rec, mixing, attention, _sums_to_output)
        if found is not None:
            (attn, mlp), branches_ok = found, True
            form = mixer_form.layer_form(model, i, layer, rec, mixing, attn, mlp, attn != attention)
            if form.moe_why is not None:  # a mixture of experts the generic description does not read
                notes.add("mlp.* points (router, experts)", form.moe_why, i)
            three = mixer_form._split(i, layer, rec)
            if three is not None and three.summed and form.sum is None:  # no norm reads its middle: not served
                if not three.plain:
                    attn = None
                    mlp = mlp if three.after_scale == 1.0 else None
                three = replace(three, scaled=True)
            if attn is None and getattr(three, "scaled", False):
                notes.add("hook_attn_out", mixer_form.SCALED, i)
            if three is not None:
                from lensadapters.adapters.generic.parallel import beside as beside_of

                beside = beside_of(three, attn)
    if not branches_ok:
        attn = mlp = None
        notes.add(
            "hook_attn_out and hook_mlp_out",
            "a layer's output is not its input plus the outputs of one attention module and one MLP module "
            "(the block scales its branches, adds the residual inside them, normalizes after them, or its "
            "attention and MLP modules cannot be told apart)",
            i,
        )
    # the points in the order the probe saw them fire
    points: list[str] = ["hook_resid_pre"] if stream else []
    points += form.before("attn") if form is not None else []
    copied, flat = set(), set()
    if stream and x is not None and x.written_later:
        copied.add("hook_resid_pre")
    for event in rec.events:
        if event[0] == "attention" and event[1] == i and attention_function is not None:
            points += (list(PATTERNS) if patterns else []) + ["attn.hook_z"]
            if calls[0].output.written_later:
                copied.add("attn.hook_z")
        elif event[0] == "child" and event[1] == i and beside is not None and event[2] == beside:
            points.append("hook_mixer_out")
            if rec.children[(i, beside)].written_later:
                copied.add("hook_mixer_out")
        elif event[0] == "child" and event[1] == i and event[2] in (attn, mlp):
            point = "hook_attn_out" if event[2] == attn else "hook_mlp_out"
            points += form.before("mlp" if event[2] == mlp else "attn", inside=True) if form is not None else []
            points.append(point)
            if rec.children[(i, event[2])].written_later:
                copied.add(point)
            if y is not None and flattened(rec.children[(i, event[2])].value, y.value):
                flat.add(point)
    if form is not None and mlp is None and form.mid is not None:  # an MLP of two modules (.parallel): no mlp event
        points += form.before("mlp", inside=True)
        if form.sum is not None:  # the sum of their outputs, as the layer adds it (.mixer_sites.SumSite)
            points.append("hook_mlp_out")
    if stream:
        points.append("hook_resid_post")
        if y is not None and y.written_later:
            copied.add("hook_resid_post")
    return BlockFindings(tuple(points), attn, mlp, attention_function, frozenset(copied), frozenset(flat), form, beside)


def _continues(i: int, rec: Recording, n: int) -> bool:
    """Whether the model continues with layer ``i``'s output exactly as it is: the next layer's input, or (the last
    layer) the input of a module outside the layers or the model's last hidden state."""
    y = rec.layer_out.get(i)
    if y is None:
        return False
    if i + 1 < n:
        x = rec.layer_in.get(i + 1)
        return x is not None and x.value.shape == y.value.shape and torch.equal(x.value, y.value)
    after = [t for t in rec.outside_in.values() if t is not None] + (
        [rec.last_hidden] if rec.last_hidden is not None else []
    )
    return any(t.shape == y.value.shape and torch.equal(t, y.value) for t in after)


def _hybrid_described(blocks: tuple[BlockFindings, ...], description: Any) -> bool:
    """Whether a partial description is kept: a hybrid whose undescribed layers all have the mixer form (:mod:`.mixer`,
    served and verified by it) and some layer is described (an attention layer among token mixers of other kinds)."""
    undescribed = [i for i, layer in enumerate(description.layers) if layer is None]
    return len(undescribed) < len(blocks) and all(blocks[i].mixer is not None for i in undescribed)


def _drop_notes(notes: _Notes, missing: dict[str, str], described: set[int]) -> None:
    """``missing`` without the notes on the described layers' branch and attention points (served by the
    description)."""
    groups = (
        "hook_attn_out and hook_mlp_out",
        "attention scores, patterns and hook_z",
        "attention scores and patterns",
    )
    for group in groups:
        reasons = notes.by_group.pop(group, None)
        missing.pop(group, None)
        if reasons is None:
            continue
        kept = {why: [i for i in where if i not in described] for why, where in reasons.items()}
        kept = {why: where for why, where in kept.items() if where}
        if kept:
            notes.by_group[group] = kept
            missing[group] = notes.result()[group]


def _fails_without_hooks(model: nn.Module, embed: nn.Module) -> bool:
    """Whether ``model`` fails a short forward with no hook at all (the probe's failure is then the model's own)."""
    vocab = getattr(embed, "num_embeddings", None) or 2
    weight = getattr(embed, "weight", None)
    ids = torch.zeros(1, 4, dtype=torch.long, device=weight.device if isinstance(weight, torch.Tensor) else None)
    ids[0, 1::2] = min(1, int(vocab) - 1)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Exception:
        return True
    return False


def identify(model: nn.Module) -> Findings:
    """Find what the generic adapter serves for ``model`` (``UnsupportedModelError`` without a layer list)."""
    structure = find_structure(model)
    layers = list(model.get_submodule(structure.layers))
    embed = model.get_submodule(structure.embed)
    n = len(layers)
    notes = _Notes(n)
    try:
        rec = run_probe(model, embed, layers, structure.unembed)
    except Exception as exc:  # a model that cannot run a short forward here: nothing is verified, nothing served
        reason = f"the probe forward pass failed ({type(exc).__name__}: {exc}), so no value or edit could be checked"
        if _fails_without_hooks(model, embed):
            reason += (
                "; the model's own forward fails the same way without any hook, so it cannot run as it is here (in "
                "this dtype or on this device: choose an implementation that can, e.g. "
                "model.set_experts_implementation('eager') or attn_implementation='eager', or another dtype)"
            )
        return Findings(
            structure,
            tuple(BlockFindings(()) for _ in range(n)),
            embed_scale=None,
            logit_scale=None,
            missing={"every hook point (hook_embed, the residual, attention and MLP points, ln_final)": reason},
            unserved_weights={"W_E": reason, "W_U": reason},
        )
    order = [e[1] for e in rec.events if e[0] == "enter"]
    if order == list(range(n)):
        continues = [_continues(i, rec, n) for i in range(n)]
        stream = [continues[i] and (i == 0 or continues[i - 1]) for i in range(n)]
        for i in range(n):
            if not stream[i]:
                notes.add(
                    "hook_resid_pre and hook_resid_post",
                    "the model does not continue with a layer's output as it is (the layers return their change and "
                    "the model's own code adds it to the residual, or changes it between layers), so a layer's input "
                    "and output are not the residual stream an edit would change",
                    i,
                )
        from lensadapters.adapters.generic.mixer import probe_mixers

        mixing = probe_mixers(model, layers, rec)
        scratch = _Notes(n)
        blocks = tuple(
            _block(i, layer, rec, scratch, stream[i], mixing.get(i), model) for i, layer in enumerate(layers)
        )
        if any(b.mixer is not None for b in blocks):  # a hybrid: its attention layers get the same points
            scratch = _Notes(n)
            blocks = tuple(
                _block(i, layer, rec, scratch, stream[i], mixing.get(i), model, hybrid=True)
                for i, layer in enumerate(layers)
            )
        for group, reasons in scratch.by_group.items():
            for reason, where in reasons.items():
                notes.by_group.setdefault(group, {}).setdefault(reason, []).extend(where)
        missing = notes.result()
    else:  # a block point would fire never, or several times per forward
        blocks = tuple(BlockFindings(()) for _ in range(n))
        missing = {
            "block hook points": f"the decoder layers did not run once each, in order, in a forward pass "
            f"(order seen: {order})"
        }
    final_norm, behaviour = _final_norm(model, structure, rec)
    unserved = {}
    if final_norm is None:
        why = _no_final_norm(model, structure, rec, n)
        if why != NO_FINAL_NORM and structure.unembed is not None:  # the unembedding reads more than the stream
            unserved["W_U"] = f"the unembedding does not read the final residual stream through a final norm ({why})"
        final_norm, behaviour = _head_norm(model, structure, rec, n)
        if final_norm is None:
            missing["ln_final.hook_normalized"] = why
    copied = set()
    embed_record = rec.outside_out.get(structure.embed)
    if embed_record is not None and embed_record.written_later:
        copied.add("hook_embed")
    if final_norm is not None and rec.outside_out[final_norm].written_later:
        copied.add("ln_final.hook_normalized")
    embed_scale, rounded, in_place, why = _embed_scale(model, structure, rec)
    in_module, why_table = _table_scale(model, structure, rec)
    scaled_in_module = False
    if embed_scale is None:
        missing["hook_embed"] = why
        unserved["W_E"] = f"hook_embed is not served: {why}"
    elif in_module is None:
        unserved["W_E"] = why_table
    elif in_module != 1.0 and embed_scale != 1.0:
        unserved["W_E"] = "the model scales the embeddings inside the embedding module and again after it"
    elif in_module != 1.0:  # the module scales its rows: hook_embed is its output, W_E the table times the factor
        embed_scale, rounded, scaled_in_module = in_module, True, True
    logit_scale, why = _logit_scale(rec, structure)
    if logit_scale is None:
        unserved.setdefault("W_U", why)
    first = next((c for c in rec.calls + rec.own_calls if c.layer is not None), None)
    description = None
    if order == list(range(n)):
        from lensadapters.adapters.generic.describe import describe
        from lensadapters.adapters.generic.post_norm import DESCRIBERS

        description = describe(model, layers, blocks, rec, DESCRIBERS)
        if description.why:
            by_reason: dict[str, list[int]] = {}
            for i, why in description.why.items():
                by_reason.setdefault(why, []).append(i)
            missing["the automatic description (queries, keys, values, norm scales, MLP activations, weights)"] = (
                "; ".join(
                    why + ("" if len(ls) == n else f" (layers {layer_ranges(ls)})") for why, ls in by_reason.items()
                )
            )
        if description.why and not _hybrid_described(blocks, description):
            description = None  # described only where every layer is, or (a hybrid) where the rest have the mixer form
        elif description.why:  # the probe's notes on the described layers' points no longer apply
            _drop_notes(notes, missing, {i for i, layer in enumerate(description.layers) if layer is not None})
        else:
            from lensadapters.adapters.generic.moe import undescribed_mlps

            opaque = undescribed_mlps(description.layers)
            if opaque:
                missing["mlp.hook_pre and mlp.hook_post (and the MLP weights)"] = "; ".join(
                    why + ("" if len(ls) == n else f" (layers {layer_ranges(ls)})") for why, ls in opaque.items()
                )
    own = {c.layer: c.heads for c in rec.own_calls if c.layer is not None}
    if description is not None:
        own = {i: heads for i, heads in own.items() if description.layers[i] is not None}
    return Findings(
        structure,
        blocks,
        final_norm,
        behaviour,
        frozenset(copied),
        embed_scale=embed_scale,
        embed_scale_rounded=rounded,
        embed_scaled_in_module=scaled_in_module,
        embed_scaled_in_place=in_place,
        final_norm_after_blocks=final_norm is not None and once_after_blocks(rec, final_norm),
        logit_scale=logit_scale,
        unserved_weights=unserved,
        heads=first.heads if first else None,
        kv_heads=first.kv_heads if first else None,
        d_head=first.d_head if first else None,
        missing=missing,
        description=description,
        own_attention=own if description is not None else {},
    )
