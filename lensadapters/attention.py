"""Attention scores and patterns through transformers' attention interface.

While a score or pattern hook exists on some layer, the wrapped model's config selects a
lensadapters attention function (registered under ``lensadapters:<original>``, with the original
implementation's mask function under the same key). That function computes attention explicitly
— and runs the hooks — only for the modules of hooked layers; every other layer is handed to the
original implementation (sdpa, eager, flash...) with the same arguments. When the last pattern
hook goes, the config gets its original implementation back.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .errors import LensAdaptersError, UnsupportedModelError
from .hook_point import HookPoint

Tensor = torch.Tensor
KEY_PREFIX = "lensadapters:"

# attention module -> (backend, layer, site) for the layers whose patterns are hooked right now
_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, tuple[Any, int, Any]]" = weakref.WeakKeyDictionary()
_REGISTERED: set[str] = set()
# attention module -> the function transformers would run for it when that is not the interface's (see
# the hookspec lensadapters_attn_original), for the unhooked layers of a model whose patterns are hooked
_DELEGATES: "weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]]" = weakref.WeakKeyDictionary()


def _interfaces() -> tuple[Any, Any]:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface, AttentionMaskInterface


def _original_function(original: str, module: nn.Module) -> Callable[..., Any]:
    if original == "eager":
        # each model file defines its own eager function; use the attention module's
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to delegate to")
        return fn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[original]


def attention_key(original: str) -> str:
    """Register (once per process) the lensadapters attention and mask functions for ``original``."""
    key = KEY_PREFIX + original
    if key in _REGISTERED:
        return key
    attn_interface, mask_interface = _interfaces()

    def lensadapters_attention(module: nn.Module, query: Tensor, key_: Tensor, value: Tensor,
                               attention_mask: Optional[Tensor], *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        entry = _ACTIVE.get(module)
        if entry is None:
            fn = _DELEGATES.get(module) or _original_function(original, module)
            return fn(module, query, key_, value, attention_mask, *args, **kwargs)
        backend, layer, site = entry
        return backend.attend(layer, site, module, query, key_, value, attention_mask, **kwargs)

    attn_interface.register(key, lensadapters_attention)
    mask_fn = mask_interface._global_mapping.get(original)
    if mask_fn is not None:
        mask_interface.register(key, mask_fn)
    _REGISTERED.add(key)
    return key


class _MaskInfo:
    """What explicit attention needs from a mask: where to put ``-inf``, an additive bias, empty rows."""

    __slots__ = ("blocked", "bias", "empty_rows")

    def __init__(self, blocked: Optional[Tensor], bias: Optional[Tensor], empty_rows: Optional[Tensor]) -> None:
        self.blocked, self.bias, self.empty_rows = blocked, bias, empty_rows


# the last mask seen and what was derived from it: every layer of one forward gets the same mask object,
# so it is converted once per forward, not once per layer (a weak reference: a freed mask never matches)
_last_mask: list[Any] = [None, None, None]  # [key, weakref to the mask or None, _MaskInfo]


def _mask_info(mask: Optional[Tensor], q_len: int, k_len: int, device: torch.device, causal: bool,
               window: Optional[int] = None) -> _MaskInfo:
    key = (q_len, k_len, str(device), causal, window,
           None if mask is None else (id(mask), _version(mask), mask.dtype))
    cached_key, ref, info = _last_mask
    if cached_key == key and (mask is None or (ref is not None and ref() is mask)):
        return info
    info = _MaskInfo(*_allowed_and_bias_info(mask, q_len, k_len, device, causal, window))
    _last_mask[:] = [key, None if mask is None else weakref.ref(mask), info]
    return info


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _allowed_and_bias_info(mask: Optional[Tensor], q_len: int, k_len: int, device: torch.device, causal: bool,
                           window: Optional[int] = None) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    allowed, bias = _allowed_and_bias(mask, q_len, k_len, device, causal, window)
    blocked = ~allowed
    if not bool(blocked.any()):
        return None, bias, None
    empty_rows = blocked.all(-1, keepdim=True)
    return blocked, bias, empty_rows if bool(empty_rows.any()) else None


def _allowed_and_bias(mask: Optional[Tensor], q_len: int, k_len: int, device: torch.device, causal: bool,
                      window: Optional[int] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Turn whatever mask transformers built into a boolean "may attend" mask and an additive bias.

    A mask transformers materialized already holds the layer's sliding window (its mask functions build it in; eager
    and sdpa attention read only the mask). Without a mask (sdpa's causal fast path, which transformers takes only
    while the window cannot bind) the queries are the last ``q_len`` of ``k_len`` positions and the window is applied
    here as transformers' ``sliding_window_overlay`` does: a query at ``i`` sees keys ``j`` with ``i - window < j``.
    """
    if mask is not None and not isinstance(mask, Tensor):
        raise UnsupportedModelError(
            f"explicit attention (hook_attn_scores/hook_pattern) got a {type(mask).__name__} attention mask; it reads "
            f"the tensor masks of eager and sdpa attention: call model.set_attn_implementation('sdpa')")
    causal_allowed = (torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len) if causal
                      else torch.ones(q_len, k_len, dtype=torch.bool, device=device))
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
IRRELEVANT_ARGUMENTS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "past_key_value", "past_key_values", "position_embeddings",
})


def _refuse_arguments(module: nn.Module, kwargs: dict, softcap: Optional[float], implementation: str) -> None:
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in IRRELEVANT_ARGUMENTS)
    if unknown:
        raise UnsupportedModelError(
            f"{type(module).__name__} passes {', '.join(map(repr, unknown))} to the attention function; lensadapters' "
            f"explicit attention (which computes hook_attn_scores/hook_pattern in the layers they are hooked in) does "
            f"not know how {'this argument changes' if len(unknown) == 1 else 'these arguments change'} attention, "
            f"so it refuses rather than compute different numbers than the model. Leave the pattern and score "
            f"points out (every other hook point works), or ask for support naming the argument")
    if softcap is not None and implementation == "sdpa":
        raise UnsupportedModelError(
            f"{type(module).__name__} passes softcap={softcap} (attention-logit softcapping) to the attention "
            f"function, but the model runs 'sdpa' attention, which does not apply it (transformers 4.x ignores it): "
            f"the model's own attention is not the softcapped attention hook_attn_scores/hook_pattern describe. Call "
            f"model.set_attn_implementation('eager') to hook patterns (eager applies the softcap)")


def explicit_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Optional[Tensor], *, scores_fn: Callable[..., Tensor],
                       scores_point: HookPoint, pattern_point: HookPoint, implementation: str = "sdpa",
                       dropout: float = 0.0, scaling: Optional[float] = None, head_mask: Optional[Tensor] = None,
                       softcap: Optional[float] = None, sliding_window: Optional[int] = None,
                       is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """Attention written out: scores → softcap → mask → ``hook_attn_scores`` → softmax → ``hook_pattern`` → mix values.

    ``query`` is ``[b, h, q, d]``, ``key``/``value`` ``[b, hkv, k, d]`` (grouped heads are repeated
    here). Every argument the model passes to the attention function is honoured or refused by name
    (``IRRELEVANT_ARGUMENTS`` lists those that change nothing; an argument set to ``None`` asks for nothing):
    ``scaling``, ``dropout``, ``head_mask``; ``softcap`` (``tanh(s / cap) * cap`` before the mask, as eager
    attention and TransformerLens apply it: ``hook_attn_scores`` is softcapped, then masked); ``sliding_window``
    (see ``_allowed_and_bias``); ``is_causal`` (as sdpa reads it, when no mask was built). Masked scores are
    ``-inf``; a query row with nothing to attend to gets a zero pattern.
    Returns ``([b, q, h, d], pattern)`` like transformers' attention functions.
    """
    _refuse_arguments(module, kwargs, softcap, implementation)
    n_heads, n_kv = query.shape[1], key.shape[1]
    if n_kv != n_heads:
        key = key.repeat_interleave(n_heads // n_kv, dim=1)
        value = value.repeat_interleave(n_heads // n_kv, dim=1)
    scores = scores_fn(module, query, key, scaling)
    if softcap is not None:  # the operations of transformers' eager attention, in its order
        scores = scores / softcap
        scores = torch.tanh(scores)
        scores = scores * softcap
    q_len, k_len = scores.shape[-2], scores.shape[-1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    info = _mask_info(attention_mask, q_len, k_len, scores.device, causal, sliding_window)
    if info.bias is not None:
        scores = scores + info.bias
    if info.blocked is not None:
        scores = scores.masked_fill(info.blocked, float("-inf"))
    scores, scores_changed = scores_point.apply(scores)
    pattern = torch.softmax(scores.float(), dim=-1)
    if scores_changed or scores_point.may_edit:  # an edit (in place too) may leave any row without a finite score
        pattern = torch.where(pattern.isnan(), torch.zeros((), dtype=pattern.dtype, device=pattern.device), pattern)
    elif info.empty_rows is not None:  # rows the mask left empty: softmax of all -inf is nan
        pattern = pattern.masked_fill(info.empty_rows, 0.0)
    pattern = pattern.to(value.dtype)
    pattern, _ = pattern_point.apply(pattern)
    if head_mask is not None:
        pattern = pattern * head_mask
    if dropout and module.training:
        pattern = nn.functional.dropout(pattern, p=dropout, training=True)
    out = torch.matmul(pattern, value)
    return out.transpose(1, 2).contiguous(), pattern


def default_scores(module: nn.Module, query: Tensor, key: Tensor, scaling: Optional[float]) -> Tensor:
    """``q @ k^T * scaling``; without a scaling from the model, ``1/sqrt(d_head)`` as sdpa and eager default to."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return torch.matmul(query, key.transpose(-1, -2)) * scaling


class InterfacePatternBackend:
    """The core's pattern backend for models that call transformers' attention interface."""

    def __init__(self, config: Any, attention_modules: list[nn.Module],
                 scores_fn: Callable[[nn.Module, Tensor, Tensor, Optional[float], str], Optional[Tensor]],
                 original_fn: Optional[Callable[[nn.Module, str], Optional[Callable[..., Any]]]] = None) -> None:
        self.config = config
        self.modules = attention_modules
        self.scores_fn = scores_fn
        self.original_fn = original_fn
        self.active: set[int] = set()
        self.original: Optional[str] = None

    def _scores(self, module: nn.Module, query: Tensor, key: Tensor, scaling: Optional[float]) -> Tensor:
        scores = self.scores_fn(module, query, key, scaling, self.original or "sdpa")
        return scores if scores is not None else default_scores(module, query, key, scaling)

    def activate(self, layer: int, site: Any) -> RemovableHandle:
        if not self.active:
            self.original = self.config._attn_implementation
            if self.original.startswith(KEY_PREFIX):  # another wrapper of the same config is active
                self.original = self.original[len(KEY_PREFIX):]
            self.config._attn_implementation = attention_key(self.original)
            for module in self.modules if self.original_fn is not None else ():
                fn = self.original_fn(module, self.original)
                if fn is not None:
                    _DELEGATES[module] = fn
        self.active.add(layer)
        module = self.modules[layer]
        _ACTIVE[module] = (self, layer, site)
        guard = module.register_forward_pre_hook(self._still_selected(layer))
        return _Deactivate(self, layer, guard)  # type: ignore[return-value]

    def _still_selected(self, layer: int) -> Callable[..., None]:
        def check(module: nn.Module, args: tuple) -> None:
            impl = self.config._attn_implementation
            if not (isinstance(impl, str) and impl.startswith(KEY_PREFIX)):
                raise LensAdaptersError(
                    f"layer {layer}: the model's attention implementation was set to {impl!r} while a "
                    f"hook_attn_scores/hook_pattern hook was attached, so transformers would no longer call the "
                    f"function that runs it. Remove the pattern hooks before switching (set_attn_implementation), "
                    f"or switch first and add them after")

        return check

    def deactivate(self, layer: int) -> None:
        if layer not in self.active:
            return
        self.active.discard(layer)
        _ACTIVE.pop(self.modules[layer], None)
        if not self.active and self.original is not None:
            if self.config._attn_implementation == KEY_PREFIX + self.original:  # not switched by the user meanwhile
                self.config._attn_implementation = self.original
            self.original = None
            for module in self.modules:
                _DELEGATES.pop(module, None)

    def attend(self, layer: int, site: Any, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Optional[Tensor], **kwargs: Any) -> tuple[Tensor, Tensor]:
        return explicit_attention(module, query, key, value, attention_mask, scores_fn=self._scores,
                                  scores_point=site.scores, pattern_point=site.pattern,
                                  implementation=self.original or "sdpa", **kwargs)


class _Deactivate:
    """A handle (``.remove()``) that switches one layer back to the original attention."""

    def __init__(self, backend: InterfacePatternBackend, layer: int, guard: RemovableHandle) -> None:
        self.backend, self.layer, self.guard = backend, layer, guard

    def remove(self) -> None:
        self.guard.remove()
        self.backend.deactivate(self.layer)
