"""The census: which of the 17 canonical layer-0 hook points every causal-LM ``model_type`` of the installed
transformers gets, as a tiny model built from its default config (:mod:`.every_model_type`) and wrapped.

For each model type: the adapter that wrapped it (a plugin, or the core's generic adapter), the canonical points it
has of those its architecture has, ``FULL`` (all of them) or ``PARTIAL``, why not more (the generic adapter's own
account), and the points whose value or edit an independent check found wrong (always none, or the census fails).
A served point whose edit the adapter refuses by name (a ``HookReturnError``: readable, not editable there) is not
wrong, and not served whole either: the row is ``PARTIAL`` and says so.

Which points an architecture *has* is read from its first layer's modules (a census needs no plugin): attention
points where the layer has a module whose class name ends in ``Attention``; ``hook_mlp_out`` where it has another
child with matrix parameters; ``mlp.hook_pre``/``hook_post`` where that child is dense (no module named or of a
class named with ``expert``); ``ln1``/``ln2.hook_scale`` where the layer has one or two norm children (a class name
with ``Norm``), ``hook_resid_mid`` where it has two (one pre-norm shared by both branches: a parallel block has no
``hook_resid_mid``).
A *token mixer* that is not softmax attention (a state-space, linear-attention, convolution or recurrent layer)
takes the attention slot: in a layer without an ``...Attention`` child, a child with matrix parameters whose class
name names no MLP (``MLP``, ``FeedForward``, ``FFN``, ``MoE``, ``Expert``, ``Sparse``) is the mixer, and the layer
has ``hook_attn_out`` but no ``attn.*`` point (no softmax pattern, queries or keys); the other children with matrix
parameters are its MLP as above (a layer that is a mixer alone, Mamba's, has no MLP point).
``ln_final.hook_scale`` where the module holding the layers (or the one above it) has a norm child (an encoder
without a final norm, as TransformerLens' ``HookedEncoder``, has none) and a forward does not prove the model has
none: the unembedding reading the last layer's output exactly as it is (a norm child that normalizes the embeddings
alone, as TrOCR's and BART's ``layernorm_embedding``, is no final norm).

Run ``python -m lensadapters.testing.census [MODEL_TYPE ...]`` (``scripts/census.py``), ``--markdown`` for a table.
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from lensadapters.analysis.threads import single_thread

CANONICAL = (
    "hook_embed",
    "blocks.0.hook_resid_pre",
    "blocks.0.hook_resid_mid",
    "blocks.0.hook_resid_post",
    "blocks.0.hook_attn_out",
    "blocks.0.hook_mlp_out",
    "blocks.0.attn.hook_q",
    "blocks.0.attn.hook_k",
    "blocks.0.attn.hook_v",
    "blocks.0.attn.hook_attn_scores",
    "blocks.0.attn.hook_pattern",
    "blocks.0.attn.hook_z",
    "blocks.0.mlp.hook_pre",
    "blocks.0.mlp.hook_post",
    "blocks.0.ln1.hook_scale",
    "blocks.0.ln2.hook_scale",
    "ln_final.hook_scale",
)
ATTENTION = tuple(p for p in CANONICAL if ".attn." in p)


@dataclass
class Entry:
    """One model type's line of the census."""

    model_type: str
    adapter: str = ""  # the plugin's name, "generic", "refused" or "not buildable"
    served: tuple[str, ...] = ()
    applicable: tuple[str, ...] = ()
    why: str = ""
    wrong: dict[str, str] = field(default_factory=dict)
    unchecked: list[str] = field(default_factory=list)  # served points the check has no reference for
    refused: dict[str, str] = field(default_factory=dict)  # served points whose edit the adapter refuses by name
    seconds: float = 0.0

    @property
    def full(self) -> bool:
        return bool(self.applicable) and set(self.applicable) <= set(self.served) - set(self.refused) and not self.wrong

    @property
    def status(self) -> str:
        if self.adapter in ("refused", "not buildable"):
            return self.adapter.upper()
        return "FULL" if self.full else "PARTIAL"

    @property
    def points(self) -> str:
        """``served/applicable``: how many of the points the architecture has are served whole (editable too)."""
        whole = (set(self.served) - set(self.refused)) & set(self.applicable)
        return f"{len(whole)}/{len(self.applicable)}" if self.applicable else "-"

    @property
    def missing(self) -> list[str]:
        return [p for p in self.applicable if p not in self.served or p in self.refused]


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


#: what the class name of a layer's MLP child (dense or a mixture of experts) has, and a token mixer's has not
MLP_CLASS_WORDS = ("mlp", "feedforward", "ffn", "moe", "expert", "sparse")


def _is_mlp(module: nn.Module) -> bool:
    return any(word in type(module).__name__.lower() for word in MLP_CLASS_WORDS)


def has_final_norm(model: nn.Module, blocks: str) -> bool:
    """Whether the module holding the layer list at ``blocks`` (or the one above it) has a norm child: the final
    norm of a decoder (``model.norm``, ``transformer.ln_f``). A BERT-style encoder has none (TransformerLens'
    ``HookedEncoder`` has no ``ln_final`` either). A norm of the embeddings (a child named ``*embed*``, as BART's
    ``layernorm_embedding``) is not a final norm, unless it runs after the last layer (one forward of the census's
    tokens: BigBird-Pegasus' decoder calls its final norm ``layernorm_embedding``)."""
    path = blocks.rsplit(".", 1)[0] if "." in blocks else ""
    holders = [model.get_submodule(path)]
    if path:
        holders.append(model.get_submodule(path.rsplit(".", 1)[0] if "." in path else ""))
    norms = [(name, child) for holder in holders for name, child in holder.named_children() if _is_norm(child)]
    if any("embed" not in name for name, _ in norms):
        return True
    return any(_runs_after_the_last_layer(model, model.get_submodule(blocks), norm) for _, norm in norms)


def _runs_after_the_last_layer(model: nn.Module, layers: nn.Module, norm: nn.Module) -> bool:
    """Whether ``norm`` is the last of (the last layer, ``norm``) to run in one forward of the census's tokens."""
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return False
    order: list[str] = []
    hooks = [
        layers[-1].register_forward_hook(lambda *args: order.append("last")),
        norm.register_forward_hook(lambda *args: order.append("norm")),
    ]
    return _runs_with(model, hooks) and "last" in order and order[-1] == "norm"


def _runs_with(model: nn.Module, hooks: list[Any]) -> bool:
    """Whether one forward of the census's tokens runs with ``hooks`` (their handles, removed after)."""
    from lensadapters.testing.every_model_type import input_ids

    try:
        with torch.no_grad():
            model(input_ids())
    except Exception:  # nothing proven
        return False
    finally:
        for hook in hooks:
            hook.remove()
    return True


def unembeds_the_last_layer_as_it_is(model: nn.Module, blocks: str) -> bool:
    """Whether the unembedding reads the last layer's output exactly as it is (one forward of the census's tokens):
    the model has no final norm, whatever norm children it has."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    layers = model.get_submodule(blocks)
    if not isinstance(head, nn.Module) or not isinstance(layers, nn.ModuleList) or not len(layers):
        return False
    seen: dict[str, Any] = {}

    def keep(key: str) -> Callable[..., None]:
        def hook(module: nn.Module, *values: Any) -> None:  # reads only: returns nothing, changes nothing
            seen.setdefault(key, _copy(values[-1]))

        return hook

    hooks = [layers[-1].register_forward_hook(keep("last")), head.register_forward_pre_hook(keep("head"))]
    if not _runs_with(model, hooks):
        return False
    last, x = seen.get("last"), seen.get("head")
    return isinstance(last, Tensor) and isinstance(x, Tensor) and x.shape == last.shape and torch.equal(x, last)


def _copy(value: Any) -> Any:
    """The first tensor of a module's output or arguments, copied (a later in-place change does not reach it)."""
    value = value[0] if isinstance(value, tuple) and value else value
    return value.detach().clone() if isinstance(value, Tensor) else None


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def _layer_parts(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """A layer's children, where a child wraps the attention module (DBRX's norm-attention-norm block: the two norms
    and the attention of the layer in one child) its own children in its place: the parts the layer has either way."""
    parts: list[tuple[str, nn.Module]] = []
    for name, child in layer.named_children():
        inner = list(child.named_children())
        wraps_attention = not _is_attention(child) and any(_is_attention(c) for _, c in inner)
        parts += inner if wraps_attention else [(name, child)]
    return parts


def applicable_points(layer: nn.Module, layout: Any = None, final_norm: bool = True) -> tuple[str, ...]:
    """The canonical points the architecture of ``layer`` (a first decoder layer) has (see the module docstring);
    with its (verified) ``BlockLayout``, the pre-norms and ``hook_resid_mid`` are the ones the layout has;
    ``ln_final.hook_scale`` where the model has a final norm (``final_norm``, :func:`has_final_norm`)."""
    children = _layer_parts(layer)
    attention = [c for _, c in children if _is_attention(c)]
    norms = [c for _, c in children if _is_norm(c)]
    others = [
        c
        for _, c in children
        if not _is_norm(c) and all(c is not a for a in attention) and any(p.dim() >= 2 for p in c.parameters())
    ]
    mixers = [] if attention else [c for c in others if not _is_mlp(c)][:1]
    others = [c for c in others if all(c is not m for m in mixers)]
    points = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.0.hook_resid_post"]
    points += ["ln_final.hook_scale"] if final_norm else []
    if attention:
        points += ["blocks.0.hook_attn_out", *ATTENTION]
    elif mixers:  # a token mixer of another kind: its output, no attention point
        points.append("blocks.0.hook_attn_out")
    if others:
        points.append("blocks.0.hook_mlp_out")
        experts = any("expert" in f"{n}.{type(m).__name__}".lower() for c in others for n, m in c.named_modules())
        if not experts:
            points += ["blocks.0.mlp.hook_pre", "blocks.0.mlp.hook_post"]
    if layout is not None:
        points += ["blocks.0.ln1.hook_scale"] if layout.ln1 is not None else []
        points += ["blocks.0.ln2.hook_scale"] if layout.ln2 is not None else []
        points += ["blocks.0.hook_resid_mid"] if not layout.parallel else []
        return tuple(p for p in CANONICAL if p in points)
    if norms:
        points.append("blocks.0.ln1.hook_scale")
    if len(norms) >= 2:
        points += ["blocks.0.ln2.hook_scale", "blocks.0.hook_resid_mid"]
    return tuple(p for p in CANONICAL if p in points)


def census_entry(model_type: str, check: bool = True) -> Entry:
    """Build, wrap and (``check``) verify one model type."""
    from lensadapters import HookedModel, UnsupportedModelError
    from lensadapters.adapters.generic import GenericAdapterWarning, findings
    from lensadapters.testing.every_model_type import NotBuildable, build, input_ids

    entry, start = Entry(model_type), time.perf_counter()
    try:
        model = build(model_type)
    except NotBuildable as why:
        entry.adapter, entry.why = "not buildable", str(why)[:200]
        return entry
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hm = HookedModel.wrap(model)
    except UnsupportedModelError as why:
        entry.adapter, entry.why = "refused", str(why)[:300]
        entry.seconds = time.perf_counter() - start
        return entry
    except Exception as why:  # a crash is a finding of the census, not a refusal
        entry.adapter, entry.why = "refused", f"wrap raised {type(why).__name__}: {str(why)[:200]}"
        return entry
    entry.adapter = hm.plugin.name
    blocks = hm.layout.blocks
    final_norm = has_final_norm(model, blocks) and not unembeds_the_last_layer_as_it_is(model, blocks)
    entry.applicable = applicable_points(hm.block_modules[0], hm.block_layouts[0], final_norm)
    entry.served = tuple(p for p in CANONICAL if p in hm.hook_dict)
    if hm.plugin.name == "generic":
        found = findings(model)
        entry.why = " | ".join(f"{k}: {v}" for k, v in found.missing.items())[:400]
    if check:
        from lensadapters.adapters.generic.verify import REFUSED, UNCHECKED, check_points

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GenericAdapterWarning)
            problems = check_points(hm.wiring, input_ids(), [p for p in entry.served if p in CANONICAL])
        entry.refused = {n: why for n, why in problems.items() if why is not None and why.startswith(REFUSED)}
        entry.wrong = {
            name: why
            for name, why in problems.items()
            if why is not None and not why.startswith(UNCHECKED) and name not in entry.refused
        }
        entry.unchecked = sorted(n for n, why in problems.items() if why is not None and why.startswith(UNCHECKED))
    hm.unwrap()
    entry.seconds = time.perf_counter() - start
    return entry


def causal_lm_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_census(model_types: Optional[Iterable[str]] = None, check: bool = True, verbose: bool = False) -> list[Entry]:
    entries = []
    for model_type in model_types or causal_lm_model_types():
        entry = census_entry(model_type, check)
        if verbose:
            print(f"{model_type:28s} {entry.status:14s} {entry.points}", flush=True)
        entries.append(entry)
    return entries


def summary(entries: list[Entry]) -> str:
    wrapped = [e for e in entries if e.adapter not in ("refused", "not buildable")]
    built = [e for e in entries if e.adapter != "not buildable"]
    full = [e for e in wrapped if e.full]
    wrong = sum(len(e.wrong) for e in entries)
    unchecked = sum(len(e.unchecked) for e in entries)
    generic = [e for e in wrapped if e.adapter == "generic"]
    generic_full = [e for e in generic if e.full]
    pct = 100.0 * len(full) / max(1, len(built))
    return (
        f"{len(entries)} causal-LM model types: {len(built)} buildable, {len(wrapped)} wrapped "
        f"({len(generic)} by the generic adapter), {len(built) - len(wrapped)} refused; FULL {len(full)}/{len(built)} "
        f"= {pct:.1f}% of the buildable ({len(generic_full)}/{len(generic)} of the generic ones); "
        f"wrong values or ignored edits: {wrong}; served points without an independent check (plugins): {unchecked}"
    )


def markdown(entries: list[Entry]) -> str:
    lines = ["| model_type | adapter | points | status | not served | why not more |", "|---|---|---|---|---|---|"]
    for e in entries:
        missing = ", ".join(p.replace("blocks.0.", "") for p in e.missing)
        wrong = "; ".join([f"WRONG {k}: {v}" for k, v in e.wrong.items()] + [f"{k}: {v}" for k, v in e.refused.items()])
        why = (wrong + " " + e.why).strip().replace("|", "/").replace("\n", " ")
        lines.append(f"| {e.model_type} | {e.adapter} | {e.points} | {e.status} | {missing} | {why[:300]} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="model types (default: every causal-LM model type)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--no-check", action="store_true", help="skip the independent check of the served points")
    args = parser.parse_args(argv)
    with single_thread():  # tiny models: more threads only add synchronization
        entries = run_census(args.model_types or None, check=not args.no_check, verbose=not args.markdown)
    if args.markdown:
        print(markdown(entries))
    print(summary(entries))
    return 1 if any(e.wrong for e in entries) else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
