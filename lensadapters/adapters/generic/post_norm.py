"""The automatic description of layers whose parts are not one attention and one MLP child of the layer, read from
the probe's values in the layer's modules at any depth (nothing is taken from module names or classes):

* **post-LN** blocks (original Transformer, BERT and its copies)::

      mid = ln1(x + attn_out(x));  out = ln2(mid + mlp(mid))

  with the core's ``BlockLayout(post_norm=True, resid_post_before_norm=True)``: TransformerLens' ``HookedEncoder``
  (``BertBlock``) points, as the bert plugin declares them by hand (``hook_resid_mid`` = ``ln1``'s input,
  ``hook_mlp_in`` = the MLP's input, ``hook_resid_post`` = ``ln2``'s input, ``hook_normalized_resid_post`` = the
  block output). BERT keeps the output projection, the residual add and ``ln1`` in a ``*SelfOutput`` module beside
  its self-attention module, and the MLP's down projection, residual add and ``ln2`` in an ``*Output`` module beside
  its ``*Intermediate`` one;
* **nested pre-LN** blocks (``mid = x + attn_out(ln1(x))``, ``out = mid + mlp(ln2(mid))``) whose MLP projections are
  the layer's own children (BioGPT) or whose residual adds sit inside ``*Output`` modules (XLM-RoBERTa-XL,
  RoBERTa-PreLayerNorm), with the pre-norm ``BlockLayout`` (no MLP module: ``hook_mlp_out`` is the down projection's
  output).

The claims, each checked on the probe:

* **attention**: the layer calls transformers' attention interface once, with a module of the layer; the output
  projection is the one linear module whose input is that call's output (heads merged); ``hook_attn_out`` is the
  attention module's output where it holds the projection and returns its output, else the last module of the
  layer, run after the projection, whose output is still the projection's (a dropout, the identity in eval mode),
  or the projection itself; queries, keys and values are the projections of the attention input (the layer's input
  in a post-LN block, ``ln1``'s output in a pre-LN one) that the attention function gets
  (:func:`.describe._describe_attention`, over the smallest module holding both the attention module and the output
  projection, ``ln1`` and ``ln2`` left out);
* **post-LN**: the attention module reads the layer's input and no norm does; ``ln1`` is the one LayerNorm/RMSNorm
  module (its own weight and eps) whose input is ``x + attn_out``, ``ln2`` the one other norm whose output is the
  layer's output, and the MLP is between ``ln1``'s output and ``ln2``'s input minus it;
* **pre-LN**: ``ln1`` is the one norm of the layer's input whose output the attention module reads, ``ln2`` the one
  other norm of ``x + attn_out``, and the MLP is between ``ln2``'s output and the layer's output minus ``x +
  attn_out``;
* **MLP**: the one linear module reading the MLP's input (the up projection), the one whose output is what the
  layer adds (the down projection), and an activation named by the config or the up projection's parent module
  reproducing the down projection's input from the up projection's output.

The mask is the model's own: the attention function gets it (bidirectional for an encoder, causal for a decoder),
and the core's patterns apply what it gets. Each served point is then verified at wrap time (:mod:`.verify`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.describe import (
    LayerDescription,
    NotDescribed,
    NotThisShape,
    _close,
    _describe_attention,
    _is_linear,
)
from lensadapters.adapters.generic.describe_mlp import _activation
from lensadapters.adapters.generic.norms import NormBehaviour, norm_behaviour
from lensadapters.adapters.generic.probe import Recording, flattened
from lensadapters.adapters.vlm import text_config
from lensadapters.hooks.specs import BlockLayout, MLPLayout, RotarySpec

Tensor = torch.Tensor


@dataclass
class _Layer:
    """What the probe saw of one layer: its modules' inputs and outputs (at any depth), the attention call, the
    output projection and what it adds to the residual."""

    module: nn.Module
    i: int
    call: Any
    attn: str  # the module the attention function is called with
    seen: dict[str, tuple[Tensor, Tensor]]
    order: list[str]
    linears: list[str]
    norms: dict[str, NormBehaviour]
    resid_pre: Tensor
    resid_post: Tensor
    o_proj: str
    attn_out: Tensor


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _common(a: str, b: str) -> str:
    """The path of the smallest module holding both ``a`` and ``b`` (``""``: the layer itself)."""
    parts = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts)


def _as(t: Tensor, like: Tensor) -> Tensor:
    """``t`` in ``like``'s shape where it is that with the leading dimensions merged (:func:`.probe.flattened`)."""
    return t.reshape(like.shape) if flattened(t, like) else t


def _one(found: list[str], why: str, exc: type[NotDescribed] = NotDescribed) -> str:
    if len(found) != 1:
        raise exc(why)
    return found[0]


def _read(layer: nn.Module, i: int, rec: Recording) -> _Layer:
    calls = [c for c in rec.calls if c.layer == i] or [c for c in rec.own_calls if c.layer == i]
    if len(calls) != 1 or calls[0].query is None:
        raise NotThisShape("the layer does not call transformers' attention interface exactly once")
    call = calls[0]
    attn = next((name for name, m in layer.named_modules() if name and m is call.module), None)
    if attn is None:
        raise NotThisShape("the attention function is called with no module of the layer")
    get = layer.get_submodule
    seen: dict[str, tuple[Tensor, Tensor]] = {
        path: (x, y) for (j, path), (x, y) in rec.inner.items() if j == i and x is not None and y is not None
    }
    if attn not in seen:
        raise NotThisShape("the probe saw no input of the attention module")
    linears = [p for p in seen if _is_linear(get(p))]
    z = call.output.value.flatten(-2)
    readers = [p for p in linears if _close(seen[p][0], z)]
    o_proj = _one(readers, "no single linear module reads the attention function's output", NotThisShape)
    norms: dict[str, NormBehaviour] = {}
    for path, (x, y) in seen.items():
        behaviour = norm_behaviour(get(path), x, y)
        if behaviour is not None and behaviour.eps is not None:
            norms[path] = behaviour
    order = [path for (j, path) in rec.inner if j == i]
    pre, post = rec.layer_in[i].value, rec.layer_out[i].value
    return _Layer(layer, i, call, attn, seen, order, linears, norms, pre, post, o_proj, seen[o_proj][1])


def _mlp(model: nn.Module, x: _Layer, mlp_in: Tensor, mlp_out: Tensor) -> tuple[MLPLayout, Optional[str]]:
    """The MLP between ``mlp_in`` and ``mlp_out``: one up projection reading it, one down projection giving it, and
    an activation (named by the config or the up projection's parent module) between them."""
    down = _one(
        [p for p in x.linears if _close(x.seen[p][1], mlp_out)],
        "no single linear module's output is what the layer adds to the residual after its attention",
    )
    up = _one(
        [p for p in x.linears if p != down and _close(x.seen[p][0], mlp_in)],
        "no single linear module reads the MLP's input (its up projection)",
    )
    parent = x.module.get_submodule(_parent(up)) if _parent(up) else x.module
    for name, act in _activation(parent, text_config(model)):
        if _close(act(x.seen[up][1]), x.seen[down][0]):
            return MLPLayout(up, down), name
    raise NotDescribed("no activation named by the config or the MLP module reproduces the down projection's input")


def _attention(
    x: _Layer, rec: Recording, rotary: tuple[list[Optional[RotarySpec]], Any], attn_in: Tensor, block_norms: set[str]
) -> tuple[Any, dict[str, NormBehaviour], Optional[str]]:
    """``(qkv, q/k norms, the module whose output is hook_attn_out where it is not the attention module's)``.
    ``block_norms`` (``ln1``, ``ln2``) are no projections: a module holding both attention and output projection may
    hold one (XLM-RoBERTa-XL's pre-norm), whose output is close to its input where that is normalized already."""
    container = _common(x.attn, x.o_proj)
    if not container:
        raise NotDescribed("the attention module and the output projection share no module below the layer")
    rec = dataclasses.replace(rec, inner={k: v for k, v in rec.inner.items() if k[0] != x.i or k[1] not in block_norms})
    qkv, _, qk_norms = _describe_attention(x.module, x.i, container, x.call, rec, *rotary, attn_in, x.attn_out)
    if x.o_proj.startswith(x.attn + ".") and _close(x.seen[x.attn][1], x.attn_out):
        return qkv, qk_norms, None
    # what the layer adds to the residual: the last module after the output projection that passes its output on
    # unchanged (its dropout), where an edit of attn.hook_result (on the projection's output) is included
    after = [p for p in x.order[x.order.index(x.o_proj) + 1 :] if p in x.seen and p.startswith(container + ".")]
    return qkv, qk_norms, next((p for p in reversed(after) if _close(x.seen[p][1], x.attn_out)), x.o_proj)


def describe_post_norm_layer(
    model: nn.Module, layer: nn.Module, i: int, rec: Recording, rotary: tuple[list[Optional[RotarySpec]], Any]
) -> LayerDescription:
    """The post-LN description of layer ``i`` (see the module docstring; ``rotary``: the candidate rotary specs and
    the ``(cos, sin)`` they are tried with); :class:`NotThisShape` where the attention does not read the layer's
    input or no norm reads that input plus the attention output, :class:`NotDescribed` where another claim fails."""
    x = _read(layer, i, rec)
    if not _close(x.seen[x.attn][0], x.resid_pre) or any(_close(x.seen[p][0], x.resid_pre) for p in x.norms):
        # (a norm of a normalized input is close to it: the first layer of a pre-norm block after a norm)
        raise NotThisShape("the attention module does not read the layer's input, or a norm reads it (pre-norm)")
    ln1 = _one(
        [p for p in x.norms if _close(x.seen[p][0], x.resid_pre + x.attn_out)],
        "no single norm module normalizes the layer's input plus the attention output",
        NotThisShape,
    )
    mid = x.seen[ln1][1]
    ln2 = _one(
        [p for p in x.norms if p != ln1 and _close(x.seen[p][1], x.resid_post)],
        "a post-LN layer's output is not the output of a norm module of its own",
    )
    mlp, act_fn = _mlp(model, x, mid, x.seen[ln2][0] - mid)
    qkv, qk_norms, attn_out = _attention(x, rec, rotary, x.resid_pre, {ln1, ln2})
    block = BlockLayout(
        ln1=ln1, attn=x.attn, o_proj=x.o_proj, ln2=ln2, mlp=None, post_norm=True, resid_post_before_norm=True
    )
    norms = {ln1: x.norms[ln1], ln2: x.norms[ln2], **qk_norms}
    return LayerDescription(block, qkv, mlp, norms, False, act_fn, attn_out=attn_out)


def describe_nested_pre_norm_layer(
    model: nn.Module, layer: nn.Module, i: int, rec: Recording, rotary: tuple[list[Optional[RotarySpec]], Any]
) -> LayerDescription:
    """A pre-LN layer (``mid = x + attn_out(ln1(x))``, ``out = mid + mlp(ln2(mid))``) whose parts are not one
    attention and one MLP child of the layer: the MLP's projections are the layer's own children (BioGPT, Whisper's
    decoder), or the residual adds sit inside ``*SelfOutput``/``*Output`` modules (XLM-RoBERTa-XL, RoBERTa-PreLN).
    Read as the post-LN shape is: ``ln1`` the one norm of the layer's input whose output the attention module reads,
    ``ln2`` the one other norm of ``x + attn_out``, the MLP between ``ln2``'s output and ``out - mid``."""
    x = _read(layer, i, rec)
    ln1 = _one(
        [p for p in x.norms if _close(x.seen[p][0], x.resid_pre) and _close(x.seen[p][1], x.seen[x.attn][0])],
        "no single norm module of the layer's input gives what the attention module reads",
        NotThisShape,
    )
    mid = x.resid_pre + x.attn_out
    ln2 = _one(
        [p for p in x.norms if p != ln1 and _close(x.seen[p][0], mid)],
        "no single norm module normalizes the layer's input plus the attention output",
        NotThisShape,
    )
    children = [p for p in x.seen if "." not in p and p not in (x.attn, ln1, ln2)]
    added = x.resid_post - mid  # a child may return it [b * p, d]
    if any(_close(x.seen[p][0], x.seen[ln2][1]) and _close(_as(x.seen[p][1], added), added) for p in children):
        raise NotThisShape("the MLP is one child of the layer: not nested (the usual describer's reason stands)")
    mlp, act_fn = _mlp(model, x, x.seen[ln2][1], x.resid_post - mid)
    qkv, qk_norms, attn_out = _attention(x, rec, rotary, x.seen[ln1][1], {ln1, ln2})
    block = BlockLayout(ln1=ln1, attn=x.attn, o_proj=x.o_proj, ln2=ln2, mlp=None)
    norms = {ln1: x.norms[ln1], ln2: x.norms[ln2], **qk_norms}
    return LayerDescription(block, qkv, mlp, norms, False, act_fn, attn_out=attn_out)


#: the describers :func:`.describe.describe` tries where a layer is not one attention and one MLP child
DESCRIBERS = (describe_post_norm_layer, describe_nested_pre_norm_layer)
