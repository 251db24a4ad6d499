"""The model's own eager attention function, run with an edit: the plain-PyTorch reference of the attention points
of the verification (:mod:`.verify`). Registered under :data:`VERIFY_KEY` in transformers' attention interface while
a check runs; it computes what the model's eager attention computes (scores, softcap, sinks, mask, softmax, values),
with the edit of the point being checked applied where the point's name says, in its batch row only.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Optional, cast

import torch
from torch import nn

from lensadapters.adapters.generic.probe import _unusual_arguments
from lensadapters.adapters.generic.references import Unchecked

Tensor = torch.Tensor


VERIFY_KEY = "lensadapters-verify:eager"


_plan = threading.local()


_registered: list[bool] = []


def _repeat(t: Tensor, heads: int) -> Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] != heads else t


def _in_row(row: Optional[int], edited: Tensor, original: Tensor) -> Tensor:
    """``edited`` in batch row ``row`` and ``original`` elsewhere (``row`` ``None``: ``edited`` everywhere): an edit
    that recomputes a tensor leaves the other rows of a batched check bit for bit as they were."""
    if row is None:
        return edited
    keep = torch.zeros(edited.shape[0], dtype=torch.bool, device=edited.device)
    keep[row] = True
    return torch.where(keep.view(-1, *([1] * (edited.dim() - 1))), edited, original)


def _verify_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor] = None,
    *args: Any,
    **kwargs: Any,
) -> tuple[Tensor, Any]:
    mask = attention_mask
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    plan = getattr(_plan, "current", None)
    layer = plan["owner"].get(id(module)) if plan else None
    mine = plan["layers"].get(layer) if plan and layer is not None else None
    part, delta, seen, row = (
        (mine["part"], mine["delta"], mine["seen"], mine["row"]) if mine is not None else ("", None, None, None)
    )
    if eager is None:
        raise RuntimeError("no eager attention function in the model's modeling file")
    if seen is not None and (args or _unusual_arguments(module, kwargs, mask)):
        raise Unchecked("the attention function gets arguments plain softmax attention does not account for")
    if seen is not None and part in ("weights", "scores") and kwargs.get("softcap") is not None:
        if getattr(_plan, "implementation", None) == "sdpa":  # the scores would be capped, the model's are not
            raise Unchecked("the model runs sdpa attention, which does not apply the softcap it passes")
    if part == "query" and seen is not None:  # the value before the edit
        seen.append(query.transpose(1, 2).clone())
        query = query + delta.transpose(1, 2).to(query.dtype) if delta is not None else query
    if part == "key" and seen is not None:
        seen.append(key.transpose(1, 2).clone())
        if delta is not None:  # ``unview``: the delta as one of the keys (the identity but for MLA's hook_k)
            assert mine is not None  # a delta comes only with this layer's plan
            key = key + mine["unview"](delta, key.transpose(1, 2)).transpose(1, 2).to(key.dtype)
    output, weights = eager(module, query, key, value, mask, *args, **kwargs)
    if seen is not None and part == "output":
        seen.append(output.clone())
        if delta is not None:
            output = output + delta.to(output.dtype)
    elif seen is not None and part in ("weights", "scores"):
        scaling = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
        scores = torch.matmul(query, _repeat(key, query.shape[1]).transpose(2, 3)) * scaling
        softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
        if softcap is not None:  # eager attention's order: cap, then mask
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores + mask[:, :, :, : key.shape[-2]]
        if part == "weights" and sinks is not None:
            weights = _mixing_weights(weights, _softmax_with_sinks(scores, sinks).to(weights.dtype), value, output)
        seen.append(scores if part == "scores" else weights.clone())
        if part == "scores" and delta is not None:
            weights = _softmax_with_sinks(scores + delta, sinks).to(query.dtype)
        elif part == "weights" and delta is not None:
            weights = weights + delta.to(weights.dtype)
        if delta is not None:
            edited = torch.matmul(weights, _repeat(value, query.shape[1])).transpose(1, 2).contiguous()
            output = _in_row(row, edited.to(output.dtype), output)
    return output, weights


def _mixing_weights(returned: Tensor, sinked: Tensor, value: Tensor, output: Tensor) -> Tensor:
    """The attention weights that mix the values into ``output``, of an attention function given sinks: the weights
    it returns (the sink's column dropped after the softmax), or, where it returns the softmax before it applies the
    sinks (a rescaling of its output by ``sigmoid(logsumexp(scores) - sink)``), the softmax with the sinks as one
    more column; which one is told by the output it computed, and neither is taken when neither gives it."""
    scale = float(output.float().abs().max())
    tolerance = 256 * torch.finfo(output.dtype).eps * max(scale, 1.0)
    for weights in (returned, sinked):
        mixed = torch.matmul(weights.to(value.dtype), _repeat(value, weights.shape[1])).transpose(1, 2)
        if mixed.shape == output.shape and float((mixed.float() - output.float()).abs().max()) <= tolerance:
            return weights
    raise Unchecked("neither the attention function's weights nor the softmax with its sinks give its output")


def _softmax_with_sinks(scores: Tensor, sinks: Optional[Tensor]) -> Tensor:
    """``softmax(scores)`` over the keys; with a sink logit per head (``s_aux``) as one more column of every row,
    dropped after the softmax (it takes probability and adds no value)."""
    if sinks is None:
        return torch.softmax(scores.float(), dim=-1)
    column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
    return torch.softmax(torch.cat([scores, column], dim=-1).float(), dim=-1)[..., :-1]


def _verify_key() -> str:
    if not _registered:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(VERIFY_KEY, cast(Any, _verify_attention))
        AttentionMaskInterface.register(VERIFY_KEY, cast(Any, AttentionMaskInterface._global_mapping["eager"]))
        _registered.append(True)
    return VERIFY_KEY


@contextlib.contextmanager
def _attention(model: nn.Module, key: str):
    config: Any = model.config
    implementation = getattr(config, "_attn_implementation", None)
    config._attn_implementation = key
    try:
        yield
    finally:
        config._attn_implementation = implementation
