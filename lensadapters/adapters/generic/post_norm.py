"""The automatic description of a post-LN block (original Transformer, BERT and its copies)::

    mid = ln1(x + attn_out(x));  out = ln2(mid + mlp(mid))

with the core's ``BlockLayout(post_norm=True, resid_post_before_norm=True)``: TransformerLens' ``HookedEncoder``
(``BertBlock``) points, as the bert plugin declares them by hand (``hook_resid_mid`` = ``ln1``'s input,
``hook_mlp_in`` = the MLP's input, ``hook_resid_post`` = ``ln2``'s input, ``hook_normalized_resid_post`` = the block
output). Nothing is taken from module names or classes: every claim is read from the probe's values, in the layer's
modules at any depth (BERT keeps the output projection, the residual add and ``ln1`` in a ``*SelfOutput`` module
beside its self-attention module, and the MLP's down projection, residual add and ``ln2`` in an ``*Output`` module
beside its ``*Intermediate`` one):

* **attention**: the layer calls transformers' attention interface once, with a module of the layer; the output
  projection is the one linear module whose input is that call's output (heads merged); ``hook_attn_out`` is the
  last module of the layer, run after it, whose output is still its output (a dropout, the identity in eval mode),
  or the projection itself; queries, keys and values are the projections of the *layer's input* (no pre-norm) that
  the attention function gets (:func:`.describe._describe_attention`, over the smallest module holding both the
  attention module and the output projection);
* **ln1**: the one LayerNorm/RMSNorm module (its own weight and eps) whose input is ``resid_pre + attn_out``;
* **MLP**: the one linear module reading ``ln1``'s output (the up projection) and the one whose output is
  ``ln2``'s input minus ``ln1``'s output (the down projection), with an activation named by the config or the up
  projection's parent module reproducing the down projection's input from the up projection's output;
* **ln2**: the one norm module (other than ``ln1``) whose output is the layer's output.

The mask is the model's own: the attention function gets it (bidirectional for an encoder, causal for a decoder),
and the core's patterns apply what it gets. Each served point is then verified at wrap time (:mod:`.verify`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lensadapters.adapters.generic.describe import (
    LayerDescription,
    NotDescribed,
    _activation,
    _close,
    _describe_attention,
    _is_linear,
    text_config,
)
from lensadapters.adapters.generic.norms import NormBehaviour, norm_behaviour
from lensadapters.adapters.generic.probe import Recording
from lensadapters.hooks.specs import BlockLayout, MLPLayout, RotarySpec

Tensor = torch.Tensor


class NotPostNorm(NotDescribed):
    """The layer is not post-LN shaped (no norm reads its input plus the attention output)."""


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


def _one(found: list[str], why: str, exc: type[NotDescribed] = NotDescribed) -> str:
    if len(found) != 1:
        raise exc(why)
    return found[0]


def describe_post_norm_layer(
    model: nn.Module, layer: nn.Module, i: int, rec: Recording, rotary: tuple[list[Optional[RotarySpec]], Any]
) -> LayerDescription:
    """The post-LN description of layer ``i`` (see the module docstring; ``rotary``: the candidate rotary specs and
    the ``(cos, sin)`` they are tried with); :class:`NotPostNorm` where the layer has no norm of its input plus its
    attention output, :class:`NotDescribed` where another claim fails."""
    calls = [c for c in rec.calls if c.layer == i]
    if len(calls) != 1 or calls[0].query is None:
        raise NotPostNorm("the layer does not call transformers' attention interface exactly once")
    call = calls[0]
    attn = next((name for name, m in layer.named_modules() if name and m is call.module), None)
    if attn is None:
        raise NotPostNorm("the attention function is called with no module of the layer")
    get = layer.get_submodule
    resid_pre, resid_post = rec.layer_in[i].value, rec.layer_out[i].value
    order = [path for (j, path) in rec.inner if j == i]
    seen: dict[str, tuple[Tensor, Tensor]] = {
        path: (x, y) for (j, path), (x, y) in rec.inner.items() if j == i and x is not None and y is not None
    }
    linears = [p for p in seen if _is_linear(get(p))]
    z = call.output.value.flatten(-2)
    o_proj = _one(
        [p for p in linears if _close(seen[p][0], z)],
        "no single linear module reads the attention function's output",
        NotPostNorm,
    )
    attn_out = seen[o_proj][1]
    norms: dict[str, NormBehaviour] = {}
    for path, (x, y) in seen.items():
        behaviour = norm_behaviour(get(path), x, y)
        if behaviour is not None and behaviour.eps is not None:
            norms[path] = behaviour
    ln1 = _one(
        [p for p in norms if _close(seen[p][0], resid_pre + attn_out)],
        "no single norm module normalizes the layer's input plus the attention output",
        NotPostNorm,
    )
    mid = seen[ln1][1]
    ln2 = _one(
        [p for p in norms if p != ln1 and _close(seen[p][1], resid_post)],
        "a post-LN layer's output is not the output of a norm module of its own",
    )
    mlp_out = seen[ln2][0] - mid
    down = _one(
        [p for p in linears if _close(seen[p][1], mlp_out)],
        "no single linear module's output is the second norm's input minus the first norm's output",
    )
    up = _one(
        [p for p in linears if p != down and _close(seen[p][0], mid)],
        "no single linear module reads the first norm's output (the MLP's up projection)",
    )
    act_fn: Optional[str] = None
    for name, act in _activation(get(_parent(up)) if _parent(up) else layer, text_config(model)):
        if _close(act(seen[up][1]), seen[down][0]):
            act_fn = name or act_fn
            break
    else:
        raise NotDescribed("no activation named by the config or the MLP module reproduces the down projection's input")
    container = _common(attn, o_proj)
    if not container:
        raise NotDescribed("the attention module and the output projection share no module below the layer")
    qkv, _, qk_norms = _describe_attention(layer, i, container, call, rec, *rotary, resid_pre, attn_out)
    # what the layer adds to the residual: the last module after the output projection that passes its output on
    # unchanged (its dropout), where an edit of attn.hook_result (on the projection's output) is included
    after = [p for p in order[order.index(o_proj) + 1 :] if p in seen and p.startswith(container + ".")]
    attn_out_path = next((p for p in reversed(after) if _close(seen[p][1], attn_out) and p != ln1), o_proj)
    norms = {ln1: norms[ln1], ln2: norms[ln2], **qk_norms}
    block = BlockLayout(
        ln1=ln1, attn=attn, o_proj=o_proj, ln2=ln2, mlp=None, post_norm=True, resid_post_before_norm=True
    )
    return LayerDescription(block, qkv, MLPLayout(up, down), norms, False, act_fn, attn_out=attn_out_path)
