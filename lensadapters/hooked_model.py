"""HookedModel: TransformerLens-style hook points on an unmodified Hugging Face model.

This module is the user-facing API (the TransformerLens surface: hooks, caches, weights). How hook points are
built from a plugin's description and realized as PyTorch hooks is :mod:`lensadapters.wiring`.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from .cache import ActivationCache
from .errors import LensAdaptersError, UnsupportedModelError
from .hook_point import HookFn, HookPoint, is_recomputing
from .registry import Registry, check_transformers_range, get_registry
from .weights import WeightAccessors
from .wiring import PATTERN_POINTS, Wiring

Tensor = torch.Tensor
NameFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
HookSpec = tuple[Union[str, Callable[[str], bool]], HookFn]

# user model -> its wrapper; also inner HF model -> wrapper, to refuse two wrappers on one model
_WRAPPERS: "weakref.WeakKeyDictionary[nn.Module, HookedModel]" = weakref.WeakKeyDictionary()
_contexts = itertools.count(1)
# hook points left out of run_with_cache's default (names_filter=None): costly and redundant
DEFAULT_CACHE_EXCLUDES = ("attn.hook_result",)


def _resolve_model(model: Any, registry: Registry) -> nn.Module:
    inner = model
    for _ in range(8):
        peeled = registry.pm.hook.lensadapters_resolve_model(model=inner)
        if peeled is None or peeled is inner:
            break
        inner = peeled
    if not isinstance(inner, nn.Module) or not hasattr(inner, "config"):
        raise UnsupportedModelError(
            f"HookedModel.wrap expects a transformers PreTrainedModel (or a wrapper a plugin can open, such as a "
            f"PeftModel), got {type(model).__name__}. {registry.describe_installed()}")
    return inner


class HookedModel(WeightAccessors):
    """Hook points, caches and weights for a Hugging Face model, without changing the model.

    Build with :meth:`wrap`; ``hm(...)`` is exactly ``model(...)``. ``hm.wiring`` is the description and
    the hook-point registry plugins see (:class:`lensadapters.protocol.Hooked`).
    """

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def wrap(cls, model: Any, adapter: Optional[str] = None, *, registry: Optional[Registry] = None) -> "HookedModel":
        """Wrap ``model`` (a ``PreTrainedModel`` or a ``PeftModel``); ``adapter`` forces a plugin by name.

        Wrapping an already wrapped model returns the existing wrapper.
        """
        if isinstance(model, HookedModel):
            return model
        existing = _WRAPPERS.get(model) if isinstance(model, nn.Module) else None
        if existing is not None:
            if adapter is not None and adapter not in (existing.arch.name, existing.plugin.name):
                raise LensAdaptersError(
                    f"this model is already wrapped with adapter {existing.arch.name!r}; call unwrap() first "
                    f"to wrap it with {adapter!r}")
            return existing
        registry = registry or get_registry()
        hf_model = _resolve_model(model, registry)
        other = _WRAPPERS.get(hf_model)
        if other is not None:
            raise LensAdaptersError(
                f"the model inside this {type(model).__name__} is already wrapped (as {type(other.model).__name__}); "
                f"use that wrapper or unwrap() it first, so no hook runs twice")
        model_type = getattr(hf_model.config, "model_type", None) or type(hf_model).__name__
        info, arch = registry.select(model_type, adapter)
        check_transformers_range(arch, info.name)
        hooks = registry.hooks_for(info)
        hooks.lensadapters_validate(arch=arch, model=hf_model)
        hm = cls(Wiring(model, hf_model, arch, info, hooks))
        impl = hm.wiring.attention_implementation()
        if impl not in arch.attn_implementations:
            warnings.warn(
                f"{type(hf_model).__name__} uses the attention implementation {impl!r}: every hook point works but "
                f"hook_attn_scores and hook_pattern, which need {' or '.join(map(repr, arch.attn_implementations))} "
                f"(model.set_attn_implementation({arch.attn_implementations[-1]!r}))", stacklevel=2)
        _WRAPPERS[model] = hm
        _WRAPPERS[hf_model] = hm
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
    mlp_layouts = property(lambda self: self.wiring.mlp_layouts, doc="The plugin's MLPLayout (or FusedGateUp) of each block.")
    attention_modules = property(lambda self: self.wiring.attention_modules, doc="Each block's attention module.")

    @property
    def blocks(self) -> list[nn.Module]:
        """Deprecated alias of ``block_modules`` (the Hugging Face decoder layers)."""
        return self.block_modules

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

    @property
    def has_hooks(self) -> bool:
        """Whether any hook point has a hook attached (the core's own cache readers included); O(1)."""
        return self.wiring.has_hooks

    def _check_alive(self) -> None:
        if not self._alive:
            raise LensAdaptersError("this HookedModel was unwrapped; call HookedModel.wrap(model) again")

    def add_hook(self, name: Union[str, Callable[[str], bool]], hook: HookFn, dir: str = "fwd",
                 is_permanent: bool = False, prepend: bool = False, *, _context: Optional[int] = None,
                 _touched: Optional[list[HookPoint]] = None, _readonly: bool = False) -> None:
        """Attach ``hook(tensor, hook) -> tensor | None`` to a hook point (or every point a filter accepts).

        Under gradient checkpointing a forward hook inside a checkpointed layer runs again when
        ``backward()`` recomputes that layer, and must return the same edit then. A read-only hook that
        should see each forward once checks ``hook.recomputing`` (:func:`lensadapters.is_recomputing`).
        """
        self._check_alive()
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', not {dir!r}")
        points = self.wiring.select(name)
        if any(p.name.endswith(PATTERN_POINTS) for p in points):
            self.wiring.check_pattern_implementation()
        with self.wiring.batched():
            for point in points:
                point.add(hook, dir, permanent=is_permanent, context=_context, prepend=prepend, readonly=_readonly)
                if _touched is not None:
                    _touched.append(point)

    def reset_hooks(self, including_permanent: bool = False) -> None:
        """Remove user hooks (permanent ones too when ``including_permanent``)."""
        self.wiring.remove_hooks(lambda e: including_permanent or not e.permanent)

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Iterable[HookSpec] = (), bwd_hooks: Iterable[HookSpec] = (),
              reset_hooks_end: bool = True, *, _readonly: bool = False) -> Iterator["HookedModel"]:
        """Hooks that live only inside the ``with`` block (removed even when a hook raises)."""
        self._check_alive()
        context = next(_contexts)
        touched: list[HookPoint] = []  # removal visits only these, not every hook point of the model
        try:
            with self.wiring.batched():
                for name, fn in fwd_hooks:
                    self.add_hook(name, fn, "fwd", _context=context, _touched=touched, _readonly=_readonly)
                for name, fn in bwd_hooks:
                    self.add_hook(name, fn, "bwd", _context=context, _touched=touched, _readonly=_readonly)
            yield self
        finally:
            if reset_hooks_end:
                self.wiring.remove_hooks(lambda e: e.context == context, touched)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Exactly the wrapped model's forward."""
        self._check_alive()
        try:
            return self.model(*args, **kwargs)
        finally:
            self.wiring.forward_state.clear()

    forward = __call__

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate``; while hooks are attached the forward is never compiled (see ``hooks``)."""
        self._check_alive()
        if self.wiring.installed:
            kwargs.setdefault("disable_compile", True)
        try:
            return self.model.generate(*args, **kwargs)
        finally:
            self.wiring.forward_state.clear()

    def run_with_hooks(self, *args: Any, fwd_hooks: Iterable[HookSpec] = (), bwd_hooks: Iterable[HookSpec] = (),
                       reset_hooks_end: bool = True, **kwargs: Any) -> Any:
        """Run the model with temporary hooks; returns the logits (the full output if it has none).

        Backward hooks stay attached to this forward's graph, so ``logits.sum().backward()`` after
        the call still runs them.
        """
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end):
            return _logits(self(*args, **kwargs))

    def cache_names(self, names_filter: NameFilter = None) -> list[str]:
        """The hook names ``run_with_cache`` stores for ``names_filter``."""
        if names_filter is None:
            return [n for n in self.hook_names if not n.endswith(DEFAULT_CACHE_EXCLUDES)]
        if isinstance(names_filter, str):
            return [pt.name for pt in self.wiring.select(names_filter)]
        if callable(names_filter):
            return [n for n in self.hook_names if names_filter(n)]
        return [pt.name for pt in self.wiring.select(list(names_filter))]

    def run_with_cache(self, *args: Any, names_filter: NameFilter = None, device: Any = None,
                       remove_batch_dim: bool = False, incl_bwd: bool = False,
                       **kwargs: Any) -> tuple[Any, ActivationCache]:
        """Run the model and return ``(logits, cache)``.

        ``names_filter``: a name, a list of names or a predicate (default: every hook point but
        ``attn.hook_result``, which is computed only when asked for). ``device`` moves cached tensors,
        ``remove_batch_dim`` drops a batch of one, ``incl_bwd`` backpropagates the model's loss (pass
        ``labels=``) and stores gradients as ``NAME_grad``.

        Under gradient checkpointing (``model.train()`` after ``gradient_checkpointing_enable()``) the
        backward pass re-runs the forward of each checkpointed layer; the cache records each hook point
        once, from the real forward (see :func:`lensadapters.is_recomputing`), and each gradient once.
        """
        names = self.cache_names(names_filter)
        store: dict[str, Tensor] = {}

        def keep(key: str, tensor: Tensor) -> None:
            value = tensor.detach()
            if device is not None:
                value = value.to(device)
            if remove_batch_dim:
                if value.shape[0] != 1:
                    raise ValueError(f"run_with_cache(remove_batch_dim=True) needs a batch of one; {key} has a batch "
                                     f"of {value.shape[0]} (shape {tuple(value.shape)})")
                value = value[0]
            store[key] = value

        def save(tensor: Tensor, hook: HookPoint) -> None:
            if not is_recomputing():  # gradient checkpointing re-runs the forward during backward
                keep(hook.name, tensor)

        def save_grad(tensor: Tensor, hook: HookPoint) -> None:
            keep(hook.name + "_grad", tensor)

        with self.hooks([(n, save) for n in names], [(n, save_grad) for n in names] if incl_bwd else [],
                        _readonly=True):
            with torch.enable_grad() if incl_bwd else contextlib.nullcontext():
                out = self(*args, **kwargs)
                if incl_bwd:
                    loss = getattr(out, "loss", None)
                    if loss is None:
                        raise ValueError("run_with_cache(incl_bwd=True) backpropagates the model's loss: pass labels=")
                    loss.backward()
        return _logits(out), ActivationCache(store, self.cfg.n_layers, not remove_batch_dim)

    def unwrap(self) -> Any:
        """Remove every hook and give back the model object, exactly as it was."""
        if self._alive:
            self.reset_hooks(including_permanent=True)
            self.wiring.uninstall()
            for key in (self.model, self.hf_model):
                if _WRAPPERS.get(key) is self:
                    del _WRAPPERS[key]
            self._alive = False
        return self.model

    def __repr__(self) -> str:
        return (f"HookedModel({type(self.model).__name__}, adapter={self.arch.name!r}, layers={self.cfg.n_layers}, "
                f"hook_points={len(self.hook_names)})")


def _logits(out: Any) -> Any:
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out
