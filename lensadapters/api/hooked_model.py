"""HookedModel: TransformerLens-style hook points on an unmodified Hugging Face model.

This module is the user-facing API (the TransformerLens surface: hooks, caches, weights). How hook points are
built from a plugin's description and realized as PyTorch hooks is :mod:`lensadapters.wiring`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch import nn

from lensadapters.adapters.plugin_calls import plugin_of
from lensadapters.adapters.registry import PluginLoadWarning, Registry, check_transformers_range, get_registry
from lensadapters.adapters.validation import describe_forced
from lensadapters.adapters.vlm import language_model_type
from lensadapters.api import tl_call  # analysis layer: TransformerLens call conventions
from lensadapters.api.arguments import check_hook, check_selector, hook_pairs, selector
from lensadapters.api.caching import DEFAULT_CACHE_EXCLUDES, CachingRuns  # noqa: F401  (old import path)
from lensadapters.api.tl_api import (
    TransformerLensAPI,  # analysis layer: tokenizer, circuits, hook namespace, nn.Module methods
)
from lensadapters.api.unfired import warn_unfired, watch_conditional_points
from lensadapters.errors import LensAdaptersError, NotCausalError, PluginError, UnsupportedModelError
from lensadapters.hooks.hook_point import HookFn, HookPoint
from lensadapters.wiring.core import Wiring
from lensadapters.wiring.names import PATTERN_POINTS
from lensadapters.wiring.vision_tower import PREFIX as VISION_PREFIX
from lensadapters.wiring.weights import WeightAccessors

Tensor = torch.Tensor
HookSpec = tuple[Union[str, Callable[[str], bool]], HookFn]

# user model -> its wrapper; also inner HF model -> wrapper, to refuse two wrappers on one model. Both weak: a
# model and its wrapper are garbage once the user drops them. While any hook is installed the model's own hooks
# keep the wrapper alive (model -> hook -> site -> wiring -> wrapper), so wrapping again finds it.
_WRAPPERS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[HookedModel]]" = weakref.WeakKeyDictionary()
_contexts = itertools.count(1)
#: values of ``HookedModel.call_semantics``
CALL_SEMANTICS = ("hf", "transformer_lens")


def _resolve_model(model: Any, registry: Registry, hooks: Any) -> nn.Module:
    inner = model
    for _ in range(8):
        peeled = _data_parallel_module(inner) or hooks.lensadapters_resolve_model(model=inner)
        if peeled is None or peeled is inner:
            break
        inner = peeled
    if not isinstance(inner, nn.Module) or not hasattr(inner, "config"):
        raise UnsupportedModelError(
            f"HookedModel.wrap expects a transformers PreTrainedModel (or a wrapper a plugin can open, such as a "
            f"PeftModel), got {type(model).__name__}. {registry.describe_installed()}"
        )
    return inner


def _data_parallel_module(model: Any) -> Optional[nn.Module]:
    """The module inside torch's data-parallel wrappers (``DistributedDataParallel``, ``DataParallel``): hook points
    go on it, and calls still go through the wrapper (``hm.model``), which synchronizes gradients."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    return None


def _wrapper_of(model: Any) -> Optional["HookedModel"]:
    """The live wrapper of ``model`` (or of the Hugging Face model inside it), if any."""
    ref = _WRAPPERS.get(model) if isinstance(model, nn.Module) else None
    return ref() if ref is not None else None


def _cross_cutting_culprit(exc: BaseException, registry: Registry, left_out: list[Any]) -> Optional[Any]:
    """The cross-cutting plugin whose own failure (not a refusal) ``exc`` is, when wrapping can go on without it."""
    if not isinstance(exc, PluginError):
        return None
    info = registry.infos.get(plugin_of(exc) or "")
    if info is None or info.architectures or any(info.plugin is p for p in left_out):
        return None
    return info.plugin


class HookedModel(CachingRuns, TransformerLensAPI, WeightAccessors):
    """Hook points, caches and weights for a Hugging Face model, without changing the model.

    Build with :meth:`wrap`; ``hm(...)`` is exactly ``model(...)`` (TransformerLens-style calls aside: see
    :mod:`lensadapters.tl_call`). ``hm.wiring`` is the description and
    the hook-point registry plugins see (:class:`lensadapters.protocol.Hooked`).
    """

    wiring: Wiring
    _tl_semantics = False  # see call_semantics

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def wrap(
        cls, model: Any, adapter: Optional[str] = None, *, registry: Optional[Registry] = None, tokenizer: Any = None
    ) -> "HookedModel":
        """Wrap ``model`` (a ``PreTrainedModel`` or a ``PeftModel``, also under ``DistributedDataParallel`` or FSDP2's
        ``fully_shard``, before or after it is placed there); ``adapter`` forces a plugin by name;
        ``tokenizer`` (a Hugging Face tokenizer) enables text inputs and ``hm.to_tokens``...

        Wrapping an already wrapped model returns the existing wrapper.
        """
        if isinstance(model, HookedModel):
            return model
        existing = _wrapper_of(model)
        if existing is not None:
            if adapter is not None and adapter not in (existing.arch.name, existing.plugin.name):
                raise LensAdaptersError(
                    f"this model is already wrapped with adapter {existing.arch.name!r}; call unwrap() first "
                    f"to wrap it with {adapter!r}"
                )
            existing._init_tl_api(tokenizer)  # analysis layer
            return existing
        registry = registry or get_registry()
        left_out: list[Any] = []  # cross-cutting plugins that failed on this model: it is wrapped without them
        while True:
            try:
                hm = cls._wrap(model, adapter, registry, left_out)
                hm._init_tl_api(tokenizer)  # analysis layer
                return hm
            except Exception as exc:
                culprit = _cross_cutting_culprit(exc, registry, left_out)
                if culprit is None:
                    raise
                warnings.warn(
                    f"{exc}. The model is wrapped without that plugin (what it adds, such as its hook points or "
                    f"weight formats, is missing); fix or uninstall it",
                    PluginLoadWarning,
                    stacklevel=2,
                )
                left_out.append(culprit)

    @classmethod
    def _wrap(cls, model: Any, adapter: Optional[str], registry: Registry, left_out: list[Any]) -> "HookedModel":
        hf_model = _resolve_model(model, registry, registry.all_hooks(left_out))
        other = _wrapper_of(hf_model)
        if other is not None:
            raise LensAdaptersError(
                f"the model inside this {type(model).__name__} is already wrapped (as {type(other.model).__name__}); "
                f"use that wrapper or unwrap() it first, so no hook runs twice"
            )
        model_type = getattr(hf_model.config, "model_type", None) or type(hf_model).__name__
        text_type = None if registry.claims(model_type) else language_model_type(hf_model)
        if text_type is not None and any(arch.vision_language for _, arch in registry.claims(text_type)):
            model_type = text_type  # a vision-language model: its language model's plugin describes it
        info, arch = registry.select(model_type, adapter)
        forced = describe_forced(adapter, model_type, arch, [o for o in registry.owners(model_type) if o != info.name])
        try:
            hooks = registry.hooks_for(info, left_out)
            try:  # a plugin's own refusal of the model comes first: it says what the model has that it cannot serve
                hooks.lensadapters_validate(arch=arch, model=hf_model)
            except UnsupportedModelError as exc:
                if info is not registry.generic:
                    raise
                raise UnsupportedModelError(f"{exc} {registry.describe_installed()}") from None
            registry.check_architecture_plugin(info)
            if not left_out:
                check_transformers_range(arch, info.name)
            hm = cls(Wiring(model, hf_model, arch, info, hooks))
        except LensAdaptersError as exc:
            if forced and exc.args and isinstance(exc.args[0], str):
                exc.args = (exc.args[0] + forced,) + exc.args[1:]
            raise
        if adapter is None and info is registry.generic:
            _warn_generic(hm, registry)
        hm.wiring.owner = hm  # kept alive by the model's hooks while any is installed (see _WRAPPERS)
        impl = hm.wiring.attention_implementation()
        if impl not in arch.attn_implementations:
            warnings.warn(
                f"{type(hf_model).__name__} uses the attention implementation {impl!r}: every hook point works but "
                f"hook_attn_scores and hook_pattern, which need {' or '.join(map(repr, arch.attn_implementations))} "
                f"(model.set_attn_implementation({arch.attn_implementations[-1]!r}))",
                stacklevel=3,
            )
        _WRAPPERS[model] = weakref.ref(hm)
        _WRAPPERS[hf_model] = weakref.ref(hm)
        return hm

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self._alive = True

    # --- the model and its description -------------------------------------------------------------

    model = property(lambda self: self.wiring.model, doc="The object that was wrapped (a PeftModel stays one).")
    hf_model = property(lambda self: self.wiring.hf_model, doc="The Hugging Face PreTrainedModel inside it.")
    arch = property(lambda self: self.wiring.arch, doc="The Architecture the plugin declared for this model.")
    plugin = property(lambda self: self.wiring.plugin, doc="The registry's PluginInfo of that plugin.")
    cfg = property(lambda self: self.wiring.cfg, doc="TransformerLens-style config (HookedConfig).")
    layout = property(lambda self: self.wiring.layout, doc="The plugin's ModelLayout.")
    block_modules = property(lambda self: self.wiring.block_modules, doc="The Hugging Face decoder layers.")
    block_layouts = property(lambda self: self.wiring.block_layouts, doc="The plugin's BlockLayout of each block.")
    qkv_layouts = property(lambda self: self.wiring.qkv_layouts, doc="The plugin's QKV layout of each block.")
    mlp_layouts = property(
        lambda self: self.wiring.mlp_layouts, doc="The plugin's MLPLayout (or FusedGateUp) of each block."
    )
    attention_modules = property(lambda self: self.wiring.attention_modules, doc="Each block's attention module.")

    def norm_spec(self, module: nn.Module) -> Any:
        """How ``module`` (one of the model's norms) normalizes: a ``NormSpec`` with live weights."""
        return self.wiring.norm_spec(module)

    def norm_module(self, prefix: str) -> nn.Module:
        """The norm module behind ``{prefix}.hook_scale`` (``"blocks.0.ln1"``, ``"ln_final"``...)."""
        return self.wiring.norm_module(prefix)

    def module_name(self, module: nn.Module) -> str:
        return self.wiring.module_name(module)

    def read_linear(self, module: nn.Module) -> Any:
        """The effective ``LinearWeight`` (``[d_in, d_out]`` and bias) of a linear-like module, through every plugin."""
        return self.wiring.read_linear(module)

    def attention_implementation(self) -> str:
        """The attention implementation the model is configured with (``config._attn_implementation``)."""
        return self.wiring.attention_implementation()

    @property
    def config(self) -> Any:
        return self.hf_model.config

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    # --- hook points -----------------------------------------------------------------------------------

    @property
    def hook_names(self) -> list[str]:
        """Every hook point of this model, in execution order."""
        return self.wiring.hook_names

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        return self.wiring.hook_dict

    def point(self, name: str) -> HookPoint:
        """The hook point ``name`` (``UnknownHookError`` with the closest names if the model has none)."""
        return self.wiring.point(name)

    @property
    def has_hooks(self) -> bool:
        """Whether any hook point has a hook attached (the core's own cache readers included); O(1)."""
        return self.wiring.has_hooks

    def _check_alive(self) -> None:
        if not self._alive:
            raise LensAdaptersError("this HookedModel was unwrapped; call HookedModel.wrap(model) again")

    def add_hook(
        self,
        name: Union[str, Callable[[str], bool]],
        hook: HookFn,
        dir: str = "fwd",
        is_permanent: bool = False,
        prepend: bool = False,
        *,
        _context: Optional[int] = None,
        _touched: Optional[list[HookPoint]] = None,
        _readonly: bool = False,
        _scope: tuple[Optional[int], Optional[int]] = (None, None),
    ) -> None:
        """Attach ``hook(tensor, hook) -> tensor | None`` to a hook point (or every point a filter accepts).

        Under gradient checkpointing a forward hook inside a checkpointed layer runs again when
        ``backward()`` recomputes that layer, and must return the same edit then. A read-only hook that
        should see each forward once checks ``hook.recomputing`` (:func:`lensadapters.is_recomputing`).
        """
        self._check_alive()
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', not {dir!r}")
        name = selector(name)  # a generator of names is read once
        check_selector(name)
        if not _readonly:
            check_hook(hook, repr(name) if isinstance(name, str) else "the hook points selected by a filter")
        points = self.wiring.select(name)
        # the language model's implementation; the vision tower's patterns (its own config) are its backend's to check
        if any(p.name.endswith(PATTERN_POINTS) and not p.name.startswith(VISION_PREFIX) for p in points):
            self.wiring.check_pattern_implementation()
        with self.wiring.batched():
            for point in points:
                point.add(
                    hook,
                    dir,
                    permanent=is_permanent,
                    context=_context,
                    prepend=prepend,
                    readonly=_readonly,
                    thread=_scope[0],
                    depth=_scope[1],
                )
                if _touched is not None:
                    _touched.append(point)

    def reset_hooks(
        self,
        clear_contexts: bool = True,
        direction: str = "both",
        including_permanent: bool = False,
        level: Optional[int] = None,
    ) -> None:
        """Remove user hooks (permanent ones too when ``including_permanent``), as TransformerLens' ``reset_hooks``:
        in ``direction`` (``"fwd"``, ``"bwd"``, ``"both"``), emptying every point's ``ctx`` when ``clear_contexts``.
        A module put in a hook point's place stays (as on TransformerLens, where it is a submodule)."""
        if clear_contexts:
            self.clear_contexts()
        if direction == "both" and level is None:
            self.wiring.remove_hooks(lambda e: including_permanent or not e.permanent)
        else:
            self.remove_all_hook_fns(direction, including_permanent, level)

    @contextlib.contextmanager
    def hooks(
        self,
        fwd_hooks: Iterable[HookSpec] = (),
        bwd_hooks: Iterable[HookSpec] = (),
        reset_hooks_end: bool = True,
        *,
        _readonly: bool = False,
        _watch: bool = False,
    ) -> Iterator["HookedModel"]:
        """Hooks that live only inside the ``with`` block (removed even when a hook raises).

        They apply to the forwards this thread runs inside the block, at the nesting depth of the block: another
        thread's forwards, and a model call made from inside a hook, do not run them (permanent hooks apply
        everywhere). With ``reset_hooks_end=False`` they stay after the block, for every forward.
        """
        self._check_alive()
        fwd_hooks, bwd_hooks = hook_pairs(fwd_hooks, "fwd_hooks"), hook_pairs(bwd_hooks, "bwd_hooks")
        fwd_hooks = [(selector(name), fn) for name, fn in fwd_hooks]  # a generator of names is read once
        bwd_hooks = [(selector(name), fn) for name, fn in bwd_hooks]
        if not _readonly:  # every hook checked before any is attached
            for argument, pairs in (("fwd_hooks", fwd_hooks), ("bwd_hooks", bwd_hooks)):
                for i, (name, fn) in enumerate(pairs):
                    check_selector(name, f"{argument}[{i}][0]")
                    check_hook(fn, repr(name) if isinstance(name, str) else f"{argument}[{i}]")
                    if isinstance(name, str):
                        self.wiring.point(name)  # an unknown name fails here, naming the closest ones
        self.wiring.sync()
        context = next(_contexts)
        touched: list[HookPoint] = []  # removal visits only these, not every hook point of the model
        frames = self.wiring.forward_state.open_frames
        scope = (threading.get_ident(), self.wiring.forward_state.open_frames) if reset_hooks_end else (None, None)
        kw = dict(_context=context, _touched=touched, _readonly=_readonly, _scope=scope)
        try:
            with self.wiring.batched():
                for name, fn in fwd_hooks:
                    self.add_hook(name, fn, "fwd", **kw)
                for name, fn in bwd_hooks:
                    self.add_hook(name, fn, "bwd", **kw)
                watch = reset_hooks_end and (_watch or not _readonly)  # run_with_cache: the names it was given
                fired = watch_conditional_points(touched, context, scope) if watch else {}
            yield self
            warn_unfired(fired)
        finally:
            # a forward of this block interrupted by a BaseException (KeyboardInterrupt...) left its frame open
            self.wiring.forward_state.unwind(frames)
            if reset_hooks_end:
                self.wiring.remove_hooks(lambda e: e.context == context, touched)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Exactly the wrapped model's forward, unless the call is TransformerLens-style (a TransformerLens keyword
        or text input: see :mod:`lensadapters.tl_call` for what it returns)."""
        self._check_alive()
        _refuse_hooks_as_model_arguments(kwargs)
        self.wiring.sync()
        state = self.wiring.forward_state
        frames = state.open_frames
        try:
            if self._tl_semantics or tl_call.wants_transformer_lens(args, kwargs):  # analysis layer
                return tl_call.forward(self, *args, **kwargs)
            if args and isinstance(args[0], Tensor) and args[0].dim() == 1 and not args[0].is_floating_point():
                args = (args[0][None],) + args[1:]  # one sequence of token ids: a batch of one, as TransformerLens
            elif isinstance(kwargs.get("input_ids"), Tensor) and kwargs["input_ids"].dim() == 1:
                kwargs["input_ids"] = kwargs["input_ids"][None]
            return self.model(*args, **kwargs)
        except BaseException:
            state.unwind(frames)  # KeyboardInterrupt, SystemExit...: PyTorch closes no frame for them
            raise

    @property
    def call_semantics(self) -> str:
        """How ``hm(...)``, ``run_with_hooks`` and ``run_with_cache`` treat a call without TransformerLens keywords:
        ``"hf"`` (what :meth:`wrap` gives): exactly the Hugging Face forward, its output object; ``"transformer_lens"``
        (what :meth:`from_pretrained` gives, the line a TransformerLens port changes): ``HookedTransformer.forward``'s
        conventions, ``return_type="logits"`` by default (see :mod:`lensadapters.tl_call`). Settable either way."""
        return "transformer_lens" if self._tl_semantics else "hf"

    @call_semantics.setter
    def call_semantics(self, value: str) -> None:
        if value not in CALL_SEMANTICS:
            raise ValueError(f"call_semantics must be one of {CALL_SEMANTICS}, not {value!r}")
        self.__dict__["_tl_semantics"] = value == "transformer_lens"

    forward = __call__

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """TransformerLens' ``generate`` (:func:`lensadapters.tl_call.generate`: text in, text out, hooks active)
        under ``call_semantics = "transformer_lens"`` or when the call is TransformerLens-style (text input or one
        of its keywords: ``stop_at_eos``, ``prepend_bos``, ``return_type``...); otherwise Hugging Face's
        ``model.generate`` (always reachable as ``hm.hf_model.generate``), whose forward is never compiled while
        hooks are attached (see ``hooks``)."""
        self._check_alive()
        encoder_decoder = bool(getattr(self.hf_model.config, "is_encoder_decoder", False))
        if not encoder_decoder:
            tl_call.refuse_bidirectional(self, "generate")
        self.wiring.sync()
        if self._tl_semantics or tl_call.wants_transformer_lens_generate(args, kwargs):
            if encoder_decoder:  # an encoder-decoder's generation is Hugging Face's (hooks active)
                raise NotCausalError(
                    f"TransformerLens-style generate (text in, a decoder-only sampling loop) is not defined for "
                    f"{type(self.hf_model).__name__}, an encoder-decoder: call hm.generate(input_ids=..., "
                    f"attention_mask=..., max_new_tokens=...) (Hugging Face's generate, every attached hook active)"
                )
            return tl_call.generate(self, *args, **kwargs)
        if self.wiring.installed:
            kwargs.setdefault("disable_compile", True)
        return self.model.generate(*args, **kwargs)

    def unwrap(self) -> Any:
        """Remove every hook and give back the model object, exactly as it was."""
        if self._alive:
            if self.__dict__.get("_sae_splices"):
                self.reset_saes()
            self.reset_hooks(including_permanent=True)
            self.wiring.uninstall()
            for key in (self.model, self.hf_model):
                if _wrapper_of(key) is self:
                    del _WRAPPERS[key]
            self._alive = False
        return self.model

    def __repr__(self) -> str:
        return (
            f"HookedModel({type(self.model).__name__}, adapter={self.arch.name!r}, layers={self.cfg.n_layers}, "
            f"hook_points={len(self.hook_names)})"
        )


def _warn_generic(hm: HookedModel, registry: Registry) -> None:
    from lensadapters.adapters.generic import GenericAdapterWarning, summary

    warnings.warn(GenericAdapterWarning(summary(hm.wiring) + registry.autoload_note()), stacklevel=4)


_HOOK_ARGUMENTS = ("fwd_hooks", "bwd_hooks")


def _refuse_hooks_as_model_arguments(kwargs: dict[str, Any]) -> None:
    """A forward does not take hooks: a Hugging Face model hands unknown keywords down to its layers, which ignore
    them, so ``hm(ids, fwd_hooks=...)`` or ``hm.run_with_cache(ids, fwd_hooks=...)`` would run without the edits."""
    given = [k for k in _HOOK_ARGUMENTS if k in kwargs]
    if given:
        raise TypeError(
            f"{' and '.join(given)} given to a forward pass, which would hand {'it' if len(given) == 1 else 'them'} "
            "to the model's layers and run without them; run hooks with hm.run_with_hooks(..., fwd_hooks=[...]) or "
            "around the call: `with hm.hooks(fwd_hooks=[...]): hm.run_with_cache(...)`"
        )
