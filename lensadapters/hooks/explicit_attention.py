"""Attention written out, for the layers whose scores or patterns are hooked.

:func:`explicit_attention` computes what transformers' attention functions compute — scores, softcap, mask, softmax,
values — with ``hook_attn_scores`` and ``hook_pattern`` applied between the steps. It honours every argument the
model passes or refuses it by name (``IRRELEVANT_ARGUMENTS``), and turns whatever mask transformers built into a
boolean mask and an additive bias once per forward (``_mask_info``). :mod:`lensadapters.hooks.attention` routes the
hooked layers here; plugins with their own attention call it directly (``lensadapters.plugin_api``), bound to a
pattern site's points by :func:`site_attention`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.errors import UnsupportedModelError
from lensadapters.hooks.hook_point import HookPoint

Tensor = torch.Tensor


class _MaskInfo:
    """What explicit attention needs from a mask: where to put ``-inf``, an additive bias, empty rows (tensors
    derived from the mask, never the mask itself)."""

    __slots__ = ("blocked", "bias", "empty_rows")

    def __init__(self, blocked: Optional[Tensor], bias: Optional[Tensor], empty_rows: Optional[Tensor]) -> None:
        self.blocked, self.bias, self.empty_rows = blocked, bias, empty_rows


# mask id -> (key, what was derived from it): every layer of one forward gets the same mask object, so it is
# converted once per forward, not once per layer. An entry lives exactly as long as its mask (a finalizer removes
# it), so nothing here keeps a mask, or what was derived from it, alive after the forward that made it.
_MASK_INFOS: dict[int, tuple[Any, _MaskInfo]] = {}


# (q_len, k_len, device, causal, window) -> what is blocked without a mask (sdpa's causal fast path): it depends on
# the shape alone, so it is derived once per shape rather than in every layer of every forward (each derivation asks
# the device whether anything is blocked, a wait on a GPU). Bounded: generation meets a new key length every step.
_MASKLESS_INFOS: OrderedDict[tuple[Any, ...], _MaskInfo] = OrderedDict()
_MASKLESS_INFOS_KEPT = 8


def _mask_info(
    mask: Optional[Tensor], q_len: int, k_len: int, device: torch.device, causal: bool, window: Optional[int] = None
) -> _MaskInfo:
    if mask is None:
        # inference-mode tensors cannot be saved for a later backward pass: kept apart from the others
        shape_key = (q_len, k_len, str(device), causal, window, torch.is_inference_mode_enabled())
        info = _MASKLESS_INFOS.get(shape_key)
        if info is None:
            info = _MaskInfo(*_allowed_and_bias_info(mask, q_len, k_len, device, causal, window))
            _MASKLESS_INFOS[shape_key] = info
            while len(_MASKLESS_INFOS) > _MASKLESS_INFOS_KEPT:
                _MASKLESS_INFOS.popitem(last=False)
        else:
            _MASKLESS_INFOS.move_to_end(shape_key)
        return info
    key = (q_len, k_len, str(device), causal, window, _version(mask), mask.dtype)
    cached = _MASK_INFOS.get(id(mask))
    if cached is not None and cached[0] == key:
        return cached[1]
    info = _MaskInfo(*_allowed_and_bias_info(mask, q_len, k_len, device, causal, window))
    if cached is None:
        weakref.finalize(mask, _MASK_INFOS.pop, id(mask), None)
    _MASK_INFOS[id(mask)] = (key, info)
    return info


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _allowed_and_bias_info(
    mask: Optional[Tensor], q_len: int, k_len: int, device: torch.device, causal: bool, window: Optional[int] = None
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    allowed, bias = _allowed_and_bias(mask, q_len, k_len, device, causal, window)
    blocked = ~allowed
    if not bool(blocked.any()):
        return None, bias, None
    empty_rows = blocked.all(-1, keepdim=True)
    return blocked, bias, empty_rows if bool(empty_rows.any()) else None


def _allowed_and_bias(
    mask: Optional[Tensor], q_len: int, k_len: int, device: torch.device, causal: bool, window: Optional[int] = None
) -> tuple[Tensor, Optional[Tensor]]:
    """Turn whatever mask transformers built into a boolean "may attend" mask and an additive bias.

    A mask transformers materialized already holds the layer's sliding window (its mask functions build it in; eager
    and sdpa attention read only the mask). Without a mask (sdpa's causal fast path, which transformers takes only
    while the window cannot bind) the queries are the last ``q_len`` of ``k_len`` positions and the window is applied
    here as transformers' ``sliding_window_overlay`` does: a query at ``i`` sees keys ``j`` with ``i - window < j``.
    """
    if mask is not None and not isinstance(mask, Tensor):
        raise UnsupportedModelError(
            f"explicit attention (hook_attn_scores/hook_pattern) got a {type(mask).__name__} attention mask; it reads "
            f"the tensor masks of eager and sdpa attention: call model.set_attn_implementation('sdpa')"
        )
    causal_allowed = (
        torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
        if causal
        else torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    )
    if mask is None:
        if window is not None:
            q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
            causal_allowed = causal_allowed & (torch.arange(k_len, device=device)[None, :] > q_pos - window)
        return causal_allowed, None
    if mask.dim() == 2:  # a [batch, keys] padding mask (1 = attend), as flash-style implementations receive
        keep = mask[:, :k_len].bool()
        return causal_allowed & keep[:, None, None, :], None
    mask = mask[..., :k_len]
    if mask.dtype == torch.bool:
        return mask, None
    allowed = mask > torch.finfo(mask.dtype).min / 2
    bias = torch.where(allowed, mask, torch.zeros((), dtype=mask.dtype, device=mask.device))
    return allowed, bias


#: arguments transformers passes to attention functions that do not change what attention computes (bookkeeping of
#: the caller); every other argument is either honoured by explicit attention or refused by name
IRRELEVANT_ARGUMENTS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "past_key_value",
        "past_key_values",
        "position_embeddings",
        "output_router_logits",
        # flash attention's choice of a deterministic backward pass (ModernBERT passes it to every implementation):
        # the same values either way
        "deterministic",
        # how many final positions the language-model head computes logits for (GOT-OCR2 passes its keywords down
        # to the layers): nothing of attention
        "logits_to_keep",
    }
)


def site_attention(
    site: Any, module: nn.Module, scores_fn: Callable[..., Tensor]
) -> Callable[..., tuple[Tensor, Tensor]]:
    """``attend(query, key, value, attention_mask, **kwargs)``: :func:`explicit_attention` of ``module`` with
    ``scores_fn``, through the pattern site's points (``site.scores``, ``site.pattern``, read now). What a plugin's
    own attention backend binds in ``activate(layer, site)`` and its forward calls with the tensors and the
    arguments of the call (``implementation``, ``dropout``...)."""
    scores_point, pattern_point = site.scores, site.pattern

    def attend(
        query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        return explicit_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            scores_fn=scores_fn,
            scores_point=scores_point,
            pattern_point=pattern_point,
            **kwargs,
        )

    return attend


def _refuse_arguments(module: nn.Module, kwargs: dict, softcap: Optional[float], implementation: str) -> None:
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in IRRELEVANT_ARGUMENTS)
    if unknown:
        raise UnsupportedModelError(
            f"{type(module).__name__} passes {', '.join(map(repr, unknown))} to the attention function; lensadapters' "
            f"explicit attention (which computes hook_attn_scores/hook_pattern in the layers they are hooked in) does "
            f"not know how {'this argument changes' if len(unknown) == 1 else 'these arguments change'} attention, "
            f"so it refuses rather than compute different numbers than the model. Leave the pattern and score "
            f"points out (every other hook point works), or ask for support naming the argument"
        )
    if softcap is not None and implementation == "sdpa":
        raise UnsupportedModelError(
            f"{type(module).__name__} passes softcap={softcap} (attention-logit softcapping) to the attention "
            f"function, but the model runs 'sdpa' attention, which does not apply it (transformers 4.x ignores it): "
            f"the model's own attention is not the softcapped attention hook_attn_scores/hook_pattern describe. Call "
            f"model.set_attn_implementation('eager') to hook patterns (eager applies the softcap)"
        )


def explicit_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    *,
    scores_fn: Callable[..., Tensor],
    scores_point: HookPoint,
    pattern_point: HookPoint,
    implementation: str = "sdpa",
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    head_mask: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    sliding_window: Optional[int] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Attention written out: scores → softcap → mask → ``hook_attn_scores`` → softmax → ``hook_pattern`` → mix values.

    ``query`` is ``[b, h, q, d]``, ``key``/``value`` ``[b, hkv, k, d]`` (grouped heads are repeated
    here). Every argument the model passes to the attention function is honoured or refused by name
    (``IRRELEVANT_ARGUMENTS`` lists those that change nothing; an argument set to ``None`` asks for nothing):
    ``scaling``, ``dropout``, ``head_mask``; ``softcap`` (``tanh(s / cap) * cap`` before the mask, as eager
    attention and TransformerLens apply it: ``hook_attn_scores`` is softcapped, then masked); ``sliding_window``
    (see ``_allowed_and_bias``); ``is_causal`` (as sdpa reads it, when no mask was built). Masked scores are
    ``-inf``; a query row the mask leaves empty gets what the configured implementation gives it (``_fill_empty_rows``).
    Returns ``([b, q, h, d], pattern)`` like transformers' attention functions.
    """
    _refuse_arguments(module, kwargs, softcap, implementation)
    n_heads, n_kv = query.shape[1], key.shape[1]
    if n_kv != n_heads:
        key = key.repeat_interleave(n_heads // n_kv, dim=1)
        value = value.repeat_interleave(n_heads // n_kv, dim=1)
    raw = scores_fn(module, query, key, scaling)
    if softcap is not None:  # the operations of transformers' eager attention, in its order
        raw = raw / softcap
        raw = torch.tanh(raw)
        raw = raw * softcap
    q_len, k_len = raw.shape[-2], raw.shape[-1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    info = _mask_info(attention_mask, q_len, k_len, raw.device, causal, sliding_window)
    scores = raw
    if info.bias is not None:
        scores = scores + info.bias
    if info.blocked is not None:
        scores = scores.masked_fill(info.blocked, float("-inf"))
    scores, scores_changed = scores_point.apply(scores)
    if s_aux is not None:
        pattern = _sink_softmax(scores, s_aux)
    else:
        pattern = _softmax(scores)
        if info.empty_rows is not None or scores_changed or scores_point.may_edit:
            pattern = _fill_empty_rows(pattern, raw, attention_mask, info)
    pattern = pattern.to(value.dtype)
    pattern, _ = pattern_point.apply(pattern)
    if head_mask is not None:
        pattern = pattern * head_mask
    if dropout and module.training:
        pattern = nn.functional.dropout(pattern, p=dropout, training=True)
    out = torch.matmul(pattern, value)
    return out.transpose(1, 2).contiguous(), pattern


def _softmax(scores: Tensor) -> Tensor:
    """``softmax(scores)`` in float32 (at least); under autograd, a row without a finite score (softmax: nan, whose
    backward is nan even where the row is replaced afterwards) is softmaxed as zeros and set to nan again off the
    graph: the same values, a zero gradient."""
    if not (scores.requires_grad and torch.is_grad_enabled()):
        return torch.softmax(scores.float(), dim=-1)
    empty = ~torch.isfinite(scores).any(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(empty, 0).float(), dim=-1).masked_fill(empty, float("nan"))


def _sink_softmax(scores: Tensor, sinks: Tensor) -> Tensor:
    """The probabilities of the real keys when a learned per-head logit (an attention sink, transformers' ``s_aux``)
    joins the softmax: ``sinks[h]`` is appended to every query row of head ``h`` as an extra column, the row's
    maximum is subtracted, the softmax is taken in the dtype of the concatenation and the sink's column is dropped — the
    operations of transformers' eager attention with sinks, in its order. The returned pattern sums to less than
    one over the keys: the sink takes the rest and contributes no value. A row whose keys are all masked gives all
    its probability to the sink (zeros over the keys), as eager attention's additive mask does."""
    column = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[-2], -1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


def _fill_empty_rows(pattern: Tensor, raw: Tensor, mask: Optional[Tensor], info: _MaskInfo) -> Tensor:
    """Rows without a finite score (softmax of all ``-inf`` is nan) as the model's own attention computes them.

    A row the *mask* leaves empty (a padding position's query under left padding) gets what the configured
    implementation gives it: eager attention adds its float mask (the dtype's minimum where blocked) to the
    scores and softmaxes the sum, so the row is ``softmax(scores + mask)`` — a spread over the blocked keys,
    which the model's later layers then use; sdpa (a boolean mask) gives such a row no attention at all (zeros).
    A row that an edit of ``hook_attn_scores`` left without a finite score attends to nothing (zeros).
    """
    nan = pattern.isnan()
    if info.empty_rows is not None and mask is not None and mask.dim() == 4 and mask.dtype != torch.bool:
        eager = _softmax(raw + mask[..., : raw.shape[-1]])
        pattern = torch.where(nan & info.empty_rows, eager, pattern)
        nan = pattern.isnan()
    return torch.where(nan, torch.zeros((), dtype=pattern.dtype, device=pattern.device), pattern)


def default_scores(module: nn.Module, query: Tensor, key: Tensor, scaling: Optional[float]) -> Tensor:
    """``q @ k^T * scaling``; without a scaling from the model, ``1/sqrt(d_head)`` as sdpa and eager default to."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return torch.matmul(query, key.transpose(-1, -2)) * scaling
