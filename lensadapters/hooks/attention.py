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
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lensadapters.errors import LensAdaptersError, UnsupportedModelError
from lensadapters.hooks.copying import RoutedImplementation, detachable, original_value
from lensadapters.hooks.hook_point import HookPoint

Tensor = torch.Tensor
KEY_PREFIX = "lensadapters:"

# attention module -> weak reference to (backend, layer, site) for the layers whose patterns are hooked right now
# (weak: the backend holds the entry, so nothing here keeps a model alive)
_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[_Route]]" = weakref.WeakKeyDictionary()
_REGISTERED: set[str] = set()
# attention module -> weak reference to its backend while the backend routes the model (the function transformers
# would run for an unhooked layer when that is not the interface's: see the hookspec lensadapters_attn_original)
_ROUTED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[InterfacePatternBackend]]" = weakref.WeakKeyDictionary()


class _Route:
    """One hooked layer: the backend serving it and its site."""

    __slots__ = ("backend", "layer", "site", "__weakref__")

    def __init__(self, backend: "InterfacePatternBackend", layer: int, site: Any) -> None:
        self.backend, self.layer, self.site = backend, layer, site


def _route(module: nn.Module) -> Optional[_Route]:
    ref = _ACTIVE.get(module)
    return ref() if ref is not None else None


def _delegate(module: nn.Module) -> Optional[Callable[..., Any]]:
    ref = _ROUTED.get(module)
    backend = ref() if ref is not None else None
    return backend.delegates.get(module) if backend is not None else None


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


def _key_editor(module: nn.Module) -> Optional[Callable[[Tensor], Tensor]]:
    ref = _ROUTED.get(module)
    backend = ref() if ref is not None else None
    return backend.key_editors.get(module) if backend is not None else None


def attention_key(original: str) -> str:
    """Register (once per process) the lensadapters attention and mask functions for ``original``."""
    key = KEY_PREFIX + original
    if key in _REGISTERED:
        return key
    attn_interface, mask_interface = _interfaces()

    def lensadapters_attention(
        module: nn.Module,
        query: Tensor,
        key_: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        editor = _key_editor(module)
        if editor is not None:  # a site's edit of the keys this function gets (multi-head latent attention's)
            key_ = editor(key_)
        entry = _route(module)
        # a layer whose pattern points have no hook for this forward (another thread's, or an outer call's while
        # this is a nested one) keeps the original implementation's exact numbers
        if entry is None or not _site_is_live(entry.site):
            fn = _delegate(module) or _original_function(original, module)
            return fn(module, query, key_, value, attention_mask, *args, **kwargs)
        return entry.backend.attend(entry.layer, entry.site, module, query, key_, value, attention_mask, **kwargs)

    attn_interface.register(key, lensadapters_attention)
    mask_fn = mask_interface._global_mapping.get(original)
    if mask_fn is not None:
        mask_interface.register(key, mask_fn)
    _REGISTERED.add(key)
    return key


def _site_is_live(site: Any) -> bool:
    """Whether a hooked layer's site has a hook that runs in the forward executing now: its own ``is_live()`` when
    it has one (a site serving more than scores and patterns through the attention function), else its score or
    pattern point's."""
    is_live = getattr(site, "is_live", None)
    if is_live is not None:
        return bool(is_live())
    return site.scores.has_live_hooks() or site.pattern.has_live_hooks()


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


class InterfacePatternBackend:
    """The core's pattern backend for models that call transformers' attention interface."""

    def __init__(
        self,
        config: Any,
        attention_modules: list[nn.Module],
        scores_fn: Callable[[nn.Module, Tensor, Tensor, Optional[float], str], Optional[Tensor]],
        original_fn: Optional[Callable[[nn.Module, str], Optional[Callable[..., Any]]]] = None,
    ) -> None:
        self.config = config
        self.modules = attention_modules
        self.scores_fn = scores_fn
        self.original_fn = original_fn
        self.active: set[int] = set()
        self.original: Optional[str] = None
        self.routes: dict[int, _Route] = {}  # the hooked layers (_ACTIVE refers to these weakly)
        self.delegates: dict[nn.Module, Callable[..., Any]] = {}
        # attention module -> the edit of the keys it hands the attention function (route_keys)
        self.key_editors: dict[nn.Module, Callable[[Tensor], Tensor]] = {}

    def _scores(self, module: nn.Module, query: Tensor, key: Tensor, scaling: Optional[float]) -> Tensor:
        scores = self.scores_fn(module, query, key, scaling, self.original or "sdpa")
        return scores if scores is not None else default_scores(module, query, key, scaling)

    def activate(self, layer: int, site: Any) -> RemovableHandle:
        if not self._engaged():
            self._engage()
        self.active.add(layer)
        module = self.modules[layer]
        route = self.routes[layer] = _Route(self, layer, site)
        _ACTIVE[module] = weakref.ref(route)
        guard = detachable(module.register_forward_pre_hook(self._still_selected(layer)))
        return _Deactivate(self, layer, guard)  # type: ignore[return-value]

    def route_keys(self, layer: int, editor: Callable[[Tensor], Tensor]) -> RemovableHandle:
        """Route layer ``layer`` through the lensadapters attention function with ``editor`` applied to the keys
        it gets (``[b, h, k, d]``; the patterns of the layer, when hooked, see the edited keys). ``remove()`` on
        the handle ends it."""
        if not self._engaged():
            self._engage()
        module = self.modules[layer]
        self.key_editors[module] = editor
        guard = detachable(module.register_forward_pre_hook(self._still_selected(layer)))
        return _KeysRouted(self, module, guard)  # type: ignore[return-value]

    def unroute_keys(self, module: nn.Module) -> None:
        if self.key_editors.pop(module, None) is not None:
            self._release_if_idle()

    def _engaged(self) -> bool:
        return bool(self.active or self.key_editors)

    def _engage(self) -> None:
        self.original = str(original_value(self.config._attn_implementation))
        if self.original.startswith(KEY_PREFIX):  # another wrapper of the same config is active
            self.original = self.original[len(KEY_PREFIX) :]
        # copies and pickles of the config see the user's implementation (lensadapters.copying)
        self.config._attn_implementation = RoutedImplementation(attention_key(self.original), self.original)
        self.delegates = {}
        for module in self.modules if self.original_fn is not None else ():
            fn = self.original_fn(module, self.original)
            if fn is not None:
                self.delegates[module] = fn
        for module in self.modules:
            _ROUTED[module] = weakref.ref(self)

    def _still_selected(self, layer: int) -> Callable[..., None]:
        def check(module: nn.Module, args: tuple) -> None:
            impl = self.config._attn_implementation
            if not (isinstance(impl, str) and impl.startswith(KEY_PREFIX)):
                raise LensAdaptersError(
                    f"layer {layer}: the model's attention implementation was set to {impl!r} while a "
                    f"hook_attn_scores/hook_pattern hook was attached (or a hook on the keys it gets), so transformers "
                    f"would no longer call the function that runs it. Remove those hooks before switching "
                    f"(set_attn_implementation), or switch first and add them after"
                )

        return check

    def deactivate(self, layer: int) -> None:
        if layer not in self.active:
            return
        self.active.discard(layer)
        self.routes.pop(layer, None)
        _ACTIVE.pop(self.modules[layer], None)
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if not self._engaged() and self.original is not None:
            if self.config._attn_implementation == KEY_PREFIX + self.original:  # not switched by the user meanwhile
                self.config._attn_implementation = self.original
            self.original = None
            self.delegates = {}
            for module in self.modules:
                _ROUTED.pop(module, None)

    def attend(
        self,
        layer: int,
        site: Any,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        return explicit_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            scores_fn=self._scores,
            scores_point=site.scores,
            pattern_point=site.pattern,
            implementation=self.original or "sdpa",
            **kwargs,
        )


class _KeysRouted:
    """A handle (``.remove()``) that ends one layer's edit of its keys (:meth:`InterfacePatternBackend.route_keys`)."""

    def __init__(self, backend: InterfacePatternBackend, module: nn.Module, guard: RemovableHandle) -> None:
        self.backend, self.module, self.guard = backend, module, guard

    def remove(self) -> None:
        self.guard.remove()
        self.backend.unroute_keys(self.module)


class _Deactivate:
    """A handle (``.remove()``) that switches one layer back to the original attention."""

    def __init__(self, backend: InterfacePatternBackend, layer: int, guard: RemovableHandle) -> None:
        self.backend, self.layer, self.guard = backend, layer, guard

    def remove(self) -> None:
        self.guard.remove()
        self.backend.deactivate(self.layer)
