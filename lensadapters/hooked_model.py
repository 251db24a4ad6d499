"""HookedModel: TransformerLens-style hook points on an unmodified Hugging Face model."""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from . import weights as _w
from .cache import ActivationCache
from .errors import LensAdaptersError, UnknownHookError, UnsupportedModelError
from .hook_point import HookFn, HookPoint, is_recomputing
from .offload import live_parameters
from .registry import PluginInfo, Registry, ScopedHooks, get_registry
from .sites import (
    AttentionSite,
    BlockShapeSite,
    ForwardState,
    FusedQKVSite,
    InputSite,
    NormSite,
    OutputSite,
    PositionEmbedSite,
    ProjectionSite,
    ResidualSite,
    RecomputedRotarySite,
    ResultSite,
    RotaryCaptureSite,
    Site,
)
from .specs import Architecture, FusedQKV, HookedConfig
from . import tl_call  # analysis layer: TransformerLens call conventions
from .head_inputs import NAMES as _HEAD_INPUT_NAMES, add_head_input_sites  # analysis layer
from .tl_api import TransformerLensAPI  # analysis layer: tokenizer, circuits, hook namespace, nn.Module methods

Tensor = torch.Tensor
NameFilter = Union[None, str, Sequence[str], Callable[[str], bool]]
HookSpec = tuple[Union[str, Callable[[str], bool]], HookFn]

# user model -> its wrapper; also inner HF model -> wrapper, to refuse two wrappers on one model
_WRAPPERS: "weakref.WeakKeyDictionary[nn.Module, HookedModel]" = weakref.WeakKeyDictionary()
_contexts = itertools.count(1)
_UNSET = object()
_PATTERN_POINTS = ("attn.hook_attn_scores", "attn.hook_pattern")
# hook points left out of run_with_cache's default (names_filter=None): costly and redundant
DEFAULT_CACHE_EXCLUDES = ("attn.hook_result",) + _HEAD_INPUT_NAMES


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


class HookedModel(TransformerLensAPI):
    """Hook points, caches and weights for a Hugging Face model, without changing the model.

    Build with :meth:`wrap`; ``hm(...)`` is exactly ``model(...)`` (TransformerLens-style calls aside:
    see :mod:`lensadapters.tl_call`).
    """

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def wrap(cls, model: Any, adapter: Optional[str] = None, *, registry: Optional[Registry] = None,
             tokenizer: Any = None) -> "HookedModel":
        """Wrap ``model`` (a ``PreTrainedModel`` or a ``PeftModel``); ``adapter`` forces a plugin by name;
        ``tokenizer`` (a Hugging Face tokenizer) enables text inputs and ``hm.to_tokens``...

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
            existing._init_tl_api(tokenizer)  # analysis layer
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
        hooks = registry.hooks_for(info)
        hooks.lensadapters_validate(arch=arch, model=hf_model)
        hm = cls(model, hf_model, arch, info, hooks)
        impl = hm.attention_implementation()
        if impl not in arch.attn_implementations:
            warnings.warn(
                f"{type(hf_model).__name__} uses the attention implementation {impl!r}: every hook point works but "
                f"hook_attn_scores and hook_pattern, which need {' or '.join(map(repr, arch.attn_implementations))} "
                f"(model.set_attn_implementation({arch.attn_implementations[-1]!r}))", stacklevel=2)
        _WRAPPERS[model] = hm
        _WRAPPERS[hf_model] = hm
        hm._init_tl_api(tokenizer)  # analysis layer
        return hm

    def __init__(self, model: Any, hf_model: nn.Module, arch: Architecture, plugin: PluginInfo,
                 hooks: ScopedHooks) -> None:
        self.model = model
        self.hf_model = hf_model
        self.arch = arch
        self.plugin = plugin
        self._hooks = hooks
        self._alive = True
        self.cfg: HookedConfig = hooks.lensadapters_config(arch=arch, model=hf_model)
        self.layout = hooks.lensadapters_embed(arch=arch, model=hf_model)
        self.block_modules: list[nn.Module] = list(hf_model.get_submodule(self.layout.blocks))
        n = len(self.block_modules)
        self.block_layouts = [hooks.lensadapters_block(arch=arch, model=hf_model, layer=i) for i in range(n)]
        self.qkv_layouts = [hooks.lensadapters_attn_qkv(arch=arch, model=hf_model, layer=i) for i in range(n)]
        self.mlp_layouts = [hooks.lensadapters_mlp_act(arch=arch, model=hf_model, layer=i) for i in range(n)]
        self.attention_modules = [b.get_submodule(bl.attn) for b, bl in zip(self.block_modules, self.block_layouts)]
        self._state = ForwardState()
        self._points: dict[str, HookPoint] = {}
        self._sites: list[Site] = []
        self._norm_modules: dict[str, nn.Module] = {}
        self._point_sites: dict[HookPoint, list[Site]] = {}
        self._installed: dict[Site, tuple[tuple[bool, ...], list[Any]]] = {}
        self._dirty: set[Site] = set()
        self._hooked_points: set[HookPoint] = set()  # points with a hook attached, kept as hooks come and go
        self._defer = 0
        self._pattern_backend: Any = None
        self._compile_setting: Any = _UNSET
        self._build()

    # --- hook points and sites ---------------------------------------------------------------------

    def new_point(self, name: str, after: Optional[str] = None, before: Optional[str] = None) -> HookPoint:
        """Create a hook point (for plugins adding sites); ``after`` or ``before`` places it in ``hook_names``
        (which lists hook points in the order they fire)."""
        if name in self._points:
            raise LensAdaptersError(f"hook point {name!r} exists twice; a plugin defines it again")
        point = HookPoint(name, self._point_changed)
        anchor = before if before in self._points else after if after in self._points else None
        if anchor is None:
            self._points[name] = point
        else:
            items = list(self._points.items())
            at = [k for k, _ in items].index(anchor) + (0 if anchor == before else 1)
            self._points = dict(items[:at] + [(name, point)] + items[at:])
        return point

    def remove_point(self, name: str) -> None:
        """Remove a hook point that :meth:`new_point` made and no site of the model fires (an SAE's points), with
        its hooks."""
        point = self.point(name)
        if self._point_sites.get(point):
            raise LensAdaptersError(f"hook point {name!r} is fired by the model's modules and cannot be removed")
        self._hooked_points.discard(point)
        del self._points[name]

    def point(self, name: str) -> HookPoint:
        """The hook point ``name`` (``UnknownHookError`` if the model has none)."""
        if name not in self._points:
            raise UnknownHookError(name, self._points)
        return self._points[name]

    @property
    def forward_state(self) -> ForwardState:
        """Values that sites share within one forward pass (rotary cos/sin, residual bookkeeping)."""
        return self._state

    def read_linear(self, module: nn.Module) -> Any:
        """The effective ``LinearWeight`` (``[d_in, d_out]`` and bias) of a linear-like module, through every plugin."""
        return _w.read_linear(self, module)

    def norm_module(self, prefix: str) -> nn.Module:
        """The norm module whose ``hook_scale``/``hook_normalized`` points start with ``prefix``
        (``"blocks.0.ln1"``, ``"ln_final"``, a plugin's ``"blocks.0.attn.q_norm"``...)."""
        try:
            return self._norm_modules[prefix]
        except KeyError:
            raise UnknownHookError(prefix + ".hook_scale", self._points) from None

    def add_site(self, site: Site) -> None:
        if isinstance(site, NormSite):
            self._norm_modules[site.scale.name[: -len(".hook_scale")]] = site.module
        self._sites.append(site)
        for point in site.points:
            self._point_sites.setdefault(point, []).append(site)

    def _norm_spec(self, module: nn.Module) -> Callable[[], Any]:
        arch, hooks = self.arch, self._hooks

        def spec() -> Any:
            with live_parameters(module):  # the spec keeps the loaded weights of an offloaded norm
                result = hooks.lensadapters_norm_scale(arch=arch, module=module)
            if result is None:
                raise UnsupportedModelError(
                    f"no plugin knows how {type(module).__name__} ({self.module_name(module)}) normalizes; "
                    f"implement lensadapters_norm_scale for it")
            return result

        return spec

    def norm_spec(self, module: nn.Module) -> Any:
        """How ``module`` (one of the model's norms) normalizes: a ``NormSpec`` with live weights."""
        return self._norm_spec(module)()

    @property
    def pattern_backend(self) -> Any:
        if self._pattern_backend is None:
            self._pattern_backend = self._hooks.lensadapters_attn_pattern(arch=self.arch, hooked=self)
        return self._pattern_backend

    def _build(self) -> None:
        m, L, cfg, st = self.hf_model, self.layout, self.cfg, self._state
        p = self.new_point
        embed = m.get_submodule(L.embed)
        self.add_site(OutputSite(embed, p("hook_embed")))
        if L.pos_embed:
            self.add_site(PositionEmbedSite(m.get_submodule(L.pos_embed), embed, p("hook_pos_embed"), st))
        rot_points: list[HookPoint] = []
        for i, block in enumerate(self.block_modules):
            bl, qkv, mlp = self.block_layouts[i], self.qkv_layouts[i], self.mlp_layouts[i]
            if bl.post_norm and (bl.parallel or bl.ln2 is None):
                raise UnsupportedModelError(f"plugin {self.plugin.name!r}: a post_norm block needs ln2 and cannot be "
                                            f"parallel (layer {i})")
            if bl.post_norm and bl.mlp is None and mlp.pre_linear is not None:
                raise UnsupportedModelError(f"plugin {self.plugin.name!r}: a post_norm gated MLP needs BlockLayout.mlp "
                                            f"(the module whose input is hook_mlp_in) (layer {i})")
            pre = f"blocks.{i}."
            pts = {}
            ln1_names = ["ln1.hook_scale", "ln1.hook_normalized"]
            # execution order: a fused projection yields q, k, v at once and rotary follows; separate projections
            # run one after another, each query/key rotated as soon as it is projected
            if qkv.rotary is None:
                attn_names = ["attn.hook_q", "attn.hook_k", "attn.hook_v"]
            elif isinstance(qkv, FusedQKV):
                attn_names = ["attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k"]
            else:
                attn_names = ["attn.hook_q", "attn.hook_rot_q", "attn.hook_k", "attn.hook_rot_k", "attn.hook_v"]
            attn_names += ["attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "attn.hook_result",
                           "hook_attn_out"]
            mlp_names = ["mlp.hook_pre"] + (["mlp.hook_pre_linear"] if mlp.pre_linear is not None else [])
            mlp_names += ["mlp.hook_post", "hook_mlp_out"]
            if bl.post_norm:
                names = (["hook_resid_pre"] + attn_names + ["hook_resid_mid"] + ln1_names + ["hook_mlp_in"]
                         + mlp_names + ["ln2.hook_scale", "ln2.hook_normalized", "hook_resid_post"])
            else:
                names = ["hook_resid_pre"] + ln1_names + attn_names
                if not bl.parallel:
                    names.append("hook_resid_mid")
                if bl.ln2 is not None:
                    names += ["hook_mlp_in", "ln2.hook_scale", "ln2.hook_normalized"]
                names += mlp_names + ["hook_resid_post"]
            for name in names:
                pts[name] = p(pre + name)
            get = block.get_submodule
            self.add_site(InputSite(block, pts["hook_resid_pre"]))
            ln1 = get(bl.ln1)
            if bl.post_norm:
                self.add_site(InputSite(ln1, pts["hook_resid_mid"]))
            self.add_site(NormSite(ln1, self._norm_spec(ln1), pts["ln1.hook_scale"], pts["ln1.hook_normalized"]))
            rot_q, rot_k = pts.get("attn.hook_rot_q"), pts.get("attn.hook_rot_k")
            if rot_q is not None:
                rot_points += [rot_q, rot_k]
            if isinstance(qkv, FusedQKV):
                self.add_site(FusedQKVSite(get(qkv.module), qkv, pts["attn.hook_q"], pts["attn.hook_k"],
                                           pts["attn.hook_v"], st, rot_q, rot_k))
            else:
                self.add_site(ProjectionSite(get(qkv.q), pts["attn.hook_q"], cfg.n_heads, st, rot_q, qkv.rotary))
                self.add_site(ProjectionSite(get(qkv.k), pts["attn.hook_k"], cfg.n_key_value_heads, st, rot_k,
                                             qkv.rotary))
                self.add_site(ProjectionSite(get(qkv.v), pts["attn.hook_v"], cfg.n_key_value_heads, st))
            self.add_site(AttentionSite(i, _LazyBackend(self), pts["attn.hook_attn_scores"], pts["attn.hook_pattern"]))
            o_proj = get(bl.o_proj)
            self.add_site(InputSite(o_proj, pts["attn.hook_z"], heads=cfg.n_heads))
            self.add_site(ResultSite(o_proj, pts["attn.hook_result"], cfg.n_heads, self._linear_reader(o_proj)))
            self.add_site(OutputSite(get(bl.attn), pts["hook_attn_out"]))
            ln2 = get(bl.ln2) if bl.ln2 is not None else None
            if ln2 is not None:
                self.add_site(NormSite(ln2, self._norm_spec(ln2), pts["ln2.hook_scale"], pts["ln2.hook_normalized"]))
            self.add_site(OutputSite(get(mlp.pre), pts["mlp.hook_pre"]))
            if mlp.pre_linear is not None:
                self.add_site(OutputSite(get(mlp.pre_linear), pts["mlp.hook_pre_linear"]))
            self.add_site(InputSite(get(mlp.out), pts["mlp.hook_post"]))
            mlp_out_module = get(bl.mlp) if bl.mlp is not None else get(mlp.out)
            if bl.post_norm:
                # every residual point is a plain module input/output: the norms carry edits downstream
                self.add_site(InputSite(get(bl.mlp) if bl.mlp is not None else get(mlp.pre), pts["hook_mlp_in"],
                                        protect=True))  # ln1's output is the MLP's residual too
                self.add_site(OutputSite(mlp_out_module, pts["hook_mlp_out"]))
                self.add_site(OutputSite(block, pts["hook_resid_post"]))
            else:
                self.add_site(ResidualSite(i, block, ln2, mlp_out_module, st, pts.get("hook_resid_mid"),
                                           pts.get("hook_mlp_in"), pts["hook_mlp_out"], pts["hook_resid_post"],
                                           residual_add=(get(bl.mlp_residual) if bl.mlp_residual else
                                                         get(bl.mlp) if bl.mlp is not None else None)))
        if L.ln_final:
            ln_f = m.get_submodule(L.ln_final)
            self.add_site(NormSite(ln_f, self._norm_spec(ln_f), p("ln_final.hook_scale"),
                                   p("ln_final.hook_normalized")))
        if rot_points:
            if not L.rotary:
                raise UnsupportedModelError(f"plugin {self.plugin.name!r} declares rotary queries but no rotary module")
            rotary_module = m.get_submodule(L.rotary)
            self.add_site(RotaryCaptureSite(rotary_module, rot_points, st, L.rotary_from_inputs))
            for i, block in enumerate(self.block_modules):
                points = [pt for pt in rot_points if pt.name.startswith(f"blocks.{i}.")]
                if points:
                    self.add_site(RecomputedRotarySite(self.attention_modules[i], points, st, rotary_module,
                                                        L.rotary_from_inputs))
        for sites in self._hooks.lensadapters_extra_sites(arch=self.arch, hooked=self):
            for site in sites or ():
                self.add_site(site)
        for i, block in enumerate(self.block_modules):
            if self.block_layouts[i].flat_mlp:
                # every point of the block, plugin-added ones (PEFT's *_lora) included, shows [b*p, ...] as [b, p, ...]
                block_points = [pt for name, pt in self._points.items() if name.startswith(f"blocks.{i}.")]
                for point in block_points:
                    point.token_shape = functools.partial(st.block_shape.get, i)
                self.add_site(BlockShapeSite(i, block, block_points, st))
        add_head_input_sites(self)  # analysis layer: blocks.L.hook_attn_in / hook_{q,k,v}_input, only when hooked

    def _linear_reader(self, module: nn.Module) -> Callable[[], tuple[Tensor, Optional[Tensor]]]:
        def read() -> tuple[Tensor, Optional[Tensor]]:
            lw = _w.read_linear(self, module)
            return lw.W, lw.b

        return read

    @property
    def has_hooks(self) -> bool:
        """Whether any hook point has a hook attached (the core's own cache readers included); O(1)."""
        return bool(self._hooked_points)

    def _point_changed(self, point: HookPoint) -> None:
        if point.active:
            self._hooked_points.add(point)
        else:
            self._hooked_points.discard(point)
        self._dirty.update(self._point_sites.get(point, ()))
        if not self._defer:
            self._sync()

    def _sync(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for site in dirty:
            signature = site.signature()
            current = self._installed.get(site)
            if current is not None and current[0] == signature:
                continue
            if current is not None:
                for handle in current[1]:
                    handle.remove()
                del self._installed[site]
            if any(signature):
                self._installed[site] = (signature, site.install())
        self._guard_compile(bool(self._installed))

    def _guard_compile(self, hooked: bool) -> None:
        """While any hook is installed, ``generate`` must not compile the forward.

        transformers compiles the decoding forward on its own for static caches on accelerators; a
        compiled graph does not see PyTorch hooks added after it was traced (dynamo skips hook guards),
        so hooks would run on the first step and silently not on the others. The model's
        ``generation_config.disable_compile`` is set while hooks exist and restored when they go.
        """
        config = getattr(self.hf_model, "generation_config", None)
        if config is None:
            return
        if hooked and self._compile_setting is _UNSET:
            self._compile_setting = getattr(config, "disable_compile", False)
            config.disable_compile = True
        elif not hooked and self._compile_setting is not _UNSET:
            config.disable_compile = self._compile_setting
            self._compile_setting = _UNSET

    @contextlib.contextmanager
    def _batched(self) -> Iterator[None]:
        """Add or remove many hooks, installing PyTorch hooks once at the end."""
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1
            if not self._defer:
                self._sync()

    # --- public hook API ---------------------------------------------------------------------------

    @property
    def hook_names(self) -> list[str]:
        """Every hook point of this model, in execution order."""
        return list(self._points)

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        return dict(self._points)

    def _select(self, name: Union[str, Callable[[str], bool], Sequence[str]]) -> list[HookPoint]:
        if isinstance(name, str):
            if name not in self._points:
                raise UnknownHookError(name, self._points)
            return [self._points[name]]
        if callable(name):
            return [pt for n, pt in self._points.items() if name(n)]
        selected: list[HookPoint] = []
        for item in name:
            selected += self._select(item)
        return selected

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
        points = self._select(name)
        if any(p.name.endswith(_PATTERN_POINTS) for p in points):
            self._check_pattern_implementation()
        with self._batched():
            for point in points:
                point.add(hook, dir, permanent=is_permanent, context=_context, prepend=prepend, readonly=_readonly)
                if _touched is not None:
                    _touched.append(point)

    def attention_implementation(self) -> str:
        """The attention implementation the model is configured with (``config._attn_implementation``)."""
        from .attention import KEY_PREFIX

        impl = getattr(self.hf_model.config, "_attn_implementation", None) or "eager"
        return impl[len(KEY_PREFIX):] if impl.startswith(KEY_PREFIX) else impl

    def _check_pattern_implementation(self) -> None:
        impl = self.attention_implementation()
        if impl not in self.arch.attn_implementations:
            raise UnsupportedModelError(
                f"hook_attn_scores and hook_pattern are computed explicitly in the layers that are hooked, with the "
                f"masks of the {' or '.join(map(repr, self.arch.attn_implementations))} attention implementation; "
                f"this model uses {impl!r}. Call model.set_attn_implementation({self.arch.attn_implementations[-1]!r}) "
                f"to hook patterns, or leave patterns out (run_with_cache(names_filter=lambda n: not "
                f"n.endswith(('hook_pattern', 'hook_attn_scores')))): every other hook point works with {impl!r}")

    def reset_hooks(self, including_permanent: bool = False) -> None:
        """Remove user hooks (permanent ones too when ``including_permanent``)."""
        self._remove_where(lambda e: including_permanent or not e.permanent)

    def _remove_where(self, predicate: Callable[[Any], bool], points: Optional[Iterable[HookPoint]] = None) -> None:
        """Remove the user hooks ``predicate`` accepts, from ``points`` (default: every hook point)."""
        with self._batched():
            for point in (self._points.values() if points is None else dict.fromkeys(points)):
                if point.remove_where(predicate):
                    if not point.active:
                        self._hooked_points.discard(point)
                    self._dirty.update(self._point_sites.get(point, ()))
        self._state.clear()

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Iterable[HookSpec] = (), bwd_hooks: Iterable[HookSpec] = (),
              reset_hooks_end: bool = True, *, _readonly: bool = False) -> Iterator["HookedModel"]:
        """Hooks that live only inside the ``with`` block (removed even when a hook raises)."""
        self._check_alive()
        context = next(_contexts)
        touched: list[HookPoint] = []  # removal visits only these, not every hook point of the model
        try:
            with self._batched():
                for name, fn in fwd_hooks:
                    self.add_hook(name, fn, "fwd", _context=context, _touched=touched, _readonly=_readonly)
                for name, fn in bwd_hooks:
                    self.add_hook(name, fn, "bwd", _context=context, _touched=touched, _readonly=_readonly)
            yield self
        finally:
            if reset_hooks_end:
                self._remove_where(lambda e: e.context == context, touched)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Exactly the wrapped model's forward, unless the call is TransformerLens-style (a TransformerLens keyword
        or text input: see :mod:`lensadapters.tl_call` for what it returns)."""
        self._check_alive()
        try:
            if tl_call.wants_transformer_lens(args, kwargs):  # analysis layer
                return tl_call.forward(self, *args, **kwargs)
            return self.model(*args, **kwargs)
        finally:
            self._state.clear()

    forward = __call__

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate``; while hooks are attached the forward is never compiled (see ``hooks``)."""
        self._check_alive()
        if self._installed:
            kwargs.setdefault("disable_compile", True)
        try:
            return self.model.generate(*args, **kwargs)
        finally:
            self._state.clear()

    @property
    def config(self) -> Any:
        return self.hf_model.config

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

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
            return [n for n in self._points if not n.endswith(DEFAULT_CACHE_EXCLUDES)]
        if isinstance(names_filter, str):
            return [pt.name for pt in self._select(names_filter)]
        if callable(names_filter):
            return [n for n in self._points if names_filter(n)]
        return [pt.name for pt in self._select(list(names_filter))]

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
                    loss = out if isinstance(out, Tensor) else getattr(out, "loss", None)  # TL: the returned loss
                    if loss is None:
                        raise ValueError("run_with_cache(incl_bwd=True) backpropagates the model's loss: pass labels=")
                    loss.backward()
        return _logits(out), ActivationCache(store, self.cfg.n_layers, not remove_batch_dim, model=self)

    def unwrap(self) -> Any:
        """Remove every hook and give back the model object, exactly as it was."""
        if self._alive:
            if self.__dict__.get("_sae_splices"):
                self.reset_saes()
            self.reset_hooks(including_permanent=True)
            for site, (_, handles) in list(self._installed.items()):
                for handle in handles:
                    handle.remove()
            self._installed.clear()
            self._guard_compile(False)
            self._state.clear()
            for key in (self.model, self.hf_model):
                if _WRAPPERS.get(key) is self:
                    del _WRAPPERS[key]
            self._alive = False
        return self.model

    def module_name(self, module: nn.Module) -> str:
        for name, candidate in self.hf_model.named_modules():
            if candidate is module:
                return name or "<model>"
        return type(module).__name__

    def __repr__(self) -> str:
        return (f"HookedModel({type(self.model).__name__}, adapter={self.arch.name!r}, layers={self.cfg.n_layers}, "
                f"hook_points={len(self._points)})")

    # --- weights (TransformerLens shapes, from the live parameters) --------------------------------

    def _override(self, name: str) -> Optional[Tensor]:
        return self._hooks.lensadapters_weight(arch=self.arch, hooked=self, name=name)

    def _weight(self, name: str, compute: Callable[[], Tensor]) -> Tensor:
        override = self._override(name)
        return override if override is not None else compute()

    @property
    def W_E(self) -> Tensor:
        def compute() -> Tensor:
            with live_parameters(self.hf_model.get_submodule(self.layout.embed)) as embed:
                return embed.weight

        return self._weight("W_E", compute)

    @property
    def W_pos(self) -> Tensor:
        def compute() -> Tensor:
            if not self.layout.pos_embed:
                raise AttributeError(f"{self.arch.name} has no learned position embeddings (W_pos)")
            with live_parameters(self.hf_model.get_submodule(self.layout.pos_embed)) as pos_embed:
                return pos_embed.weight[self.layout.pos_embed_offset:]

        return self._weight("W_pos", compute)

    def _unembed(self) -> nn.Module:
        if self.layout.unembed is None:
            raise AttributeError(f"this {type(self.hf_model).__name__} has no unembedding (language-model head): "
                                 f"W_U and b_U exist only for *ForCausalLM models")
        return self.hf_model.get_submodule(self.layout.unembed)

    @property
    def W_U(self) -> Tensor:
        return self._weight("W_U", lambda: _w.read_linear(self, self._unembed()).W)

    @property
    def b_U(self) -> Tensor:
        def compute() -> Tensor:
            lw = _w.read_linear(self, self._unembed())
            return lw.b if lw.b is not None else torch.zeros(lw.W.shape[-1], dtype=lw.W.dtype, device=lw.W.device)

        return self._weight("b_U", compute)

    def _layers(self, fn: Callable[[int], Tensor]) -> Tensor:
        return torch.stack([fn(i) for i in range(self.cfg.n_layers)])

    W_Q = property(lambda self: self._weight("W_Q", lambda: _w.stacked(self, 0, 0)))
    b_Q = property(lambda self: self._weight("b_Q", lambda: _w.stacked(self, 0, 1)))
    _W_K = property(lambda self: self._weight("_W_K", lambda: _w.stacked(self, 1, 0)))
    _b_K = property(lambda self: self._weight("_b_K", lambda: _w.stacked(self, 1, 1)))
    _W_V = property(lambda self: self._weight("_W_V", lambda: _w.stacked(self, 2, 0)))
    _b_V = property(lambda self: self._weight("_b_V", lambda: _w.stacked(self, 2, 1)))
    W_K = property(lambda self: _w.repeat_kv(self._W_K, self.cfg.n_heads))
    b_K = property(lambda self: _w.repeat_kv(self._b_K, self.cfg.n_heads))
    W_V = property(lambda self: _w.repeat_kv(self._W_V, self.cfg.n_heads))
    b_V = property(lambda self: _w.repeat_kv(self._b_V, self.cfg.n_heads))
    W_O = property(lambda self: self._weight("W_O", lambda: self._layers(lambda i: _w.o_weights(self, i)[0])))
    b_O = property(lambda self: self._weight("b_O", lambda: self._layers(lambda i: _w.o_weights(self, i)[1])))
    W_in = property(lambda self: self._weight("W_in", lambda: self._layers(lambda i: _w.mlp_weights(self, i, "in")[0])))
    b_in = property(lambda self: self._weight("b_in", lambda: self._layers(lambda i: _w.mlp_weights(self, i, "in")[1])))
    W_gate = property(lambda self: self._weight("W_gate",
                                                lambda: self._layers(lambda i: _w.mlp_weights(self, i, "gate")[0])))
    b_gate = property(lambda self: self._weight("b_gate",
                                                lambda: self._layers(lambda i: _w.mlp_weights(self, i, "gate")[1])))
    W_out = property(lambda self: self._weight("W_out",
                                               lambda: self._layers(lambda i: _w.mlp_weights(self, i, "out")[0])))
    b_out = property(lambda self: self._weight("b_out",
                                               lambda: self._layers(lambda i: _w.mlp_weights(self, i, "out")[1])))




class _LazyBackend:
    """Creates the pattern backend on first use, so wrapping costs nothing until patterns are hooked."""

    def __init__(self, hm: HookedModel) -> None:
        self.hm = hm

    def activate(self, layer: int, site: Any) -> Any:
        return self.hm.pattern_backend.activate(layer, site)


def _logits(out: Any) -> Any:
    if isinstance(out, tl_call.Output):  # analysis layer: a TransformerLens-style call's result, as it is
        return out
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out
