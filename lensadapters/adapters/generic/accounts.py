"""Where each point of an automatically described model was verified, in words, for ``lensadapters hooks``.

The wrap-time verification (:mod:`.verify`) checks a point's value, and the effect of its edit on the logits,
against an independent place in plain PyTorch (:func:`.references.reference`): the output or input of one of the
model's modules, an argument of its attention function, a norm's scale. A point that failed is not served. This
module names that place for every point served, so a user can see what "verified" meant for each one.
"""

from __future__ import annotations

from typing import Any, Optional

from lensadapters.adapters.generic.references import Reference, reference

__all__ = ["verified_against"]

_ATTENTION_PARTS = {
    "query": "the queries",
    "key": "the keys",
    "weights": "the attention weights",
    "scores": "the masked scores whose softmax is the weights",
    "output": "the output",
}


def verified_against(hooked: Any, name: str) -> Optional[str]:
    """The plain-PyTorch place the point ``name`` of ``hooked`` (a wiring of the generic adapter) was verified
    against, in words; ``None`` where the point has no such reference (it is then served by the probe's structural
    proof, as the residual points of an opaque layer are, or by a check of its own, and has no account here)."""
    ref = reference(hooked, name)
    if ref is None:
        return None
    names = {id(m): n for n, m in hooked.hf_model.named_modules()}
    text = _account(ref, names)
    if name.endswith("hook_normalized") and ref.kind == "out" and ref.module is not None:
        spec = hooked.norm_spec(ref.module)  # an RMSNorm's hook_normalized is before its weight, as in TransformerLens
        if spec.kind != "LN" and spec.weight is not None:
            text += " over its weight" if not spec.weight_offset else f" over {spec.weight_offset:g} + its weight"
    return text


def _module(ref: Reference, names: dict[int, str]) -> str:
    if ref.module is None:
        return "the model"
    if id(ref.module) not in names:
        return type(ref.module).__name__
    return names[id(ref.module)] or "the model"  # the root module's name is ""


#: a reference's kind -> the place it names (``where``: the module's name, ``part``: of the attention function)
_PLACES = {
    "out": "the output of {where}",
    "attn": "{part} of layer {layer}'s attention function",
    "softmax": "{part} of the softmax {where} computes in its own code",
    "operand": "{part} the sdpa call in {where}'s own code gets",
    "scale": "the scale the norm {where} divides by",
    "result": "the per-head terms of {where}'s output (its input times its weight, head by head)",
    "arg": "argument {spec} of {where}",
    "scores": "the scores {where} returns, at the top-k of the logits it returns with them",
    "grouped_weights": "the weights of the rows {where} returns grouped by expert, in top-k order",
    "router_input": "the logits {where} computes from its input (an edit made by moving that input)",
    "head_input": "the input of {where}, given per head",
}


def _account(ref: Reference, names: dict[int, str]) -> str:
    where = _module(ref, names)
    if ref.kind == "in":
        text = f"the input of {where}" + (f" (its call {ref.spec} in a forward)" if isinstance(ref.spec, int) else "")
    elif ref.kind in _PLACES:
        part = _ATTENTION_PARTS.get(ref.part, ref.part)
        text = _PLACES[ref.kind].format(where=where, part=part, layer=ref.layer, spec=ref.spec)
    else:  # plain hooks of the reference's own on several modules
        modules = getattr(ref.spec, "modules", None)
        listed = ", ".join(names.get(id(m), type(m).__name__) for m in modules) if modules else where
        text = f"plain hooks on {listed}"
    if ref.also is not None:
        text += f", an edit reaching {_account(ref.also, names)} too"
    return text
