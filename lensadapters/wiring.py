"""The wiring of one wrapped model: its description, its hook points and the sites that realize them.

:class:`Wiring` is the object plugins receive as ``hooked`` (it implements :class:`lensadapters.protocol.Hooked`).
It is built once per ``HookedModel.wrap``, in three phases:

1. **Points.** From the plugin's description (``ModelLayout``, one ``BlockLayout``/``QKVLayout``/``MLPLayout``
   or ``FusedGateUp`` per block) the core creates every hook point it serves, in the order the points fire.
   A block whose ``BlockLayout`` is ``None`` is *opaque*: the core creates no points for it, and a plugin serves
   whatever points it can through its own sites (the generic adapter, ``lensadapters.generic``, describes every
   block so).
2. **Plugins.** ``lensadapters_extra_sites`` runs: a plugin may add points (``new_point(name, after=...)``),
   take over a point the core created (``claim_point(name)``: the core then builds no hook for it) and return
   its own sites.
3. **Core sites.** The core builds its sites for the points nobody claimed.

Sites are installed lazily: a PyTorch hook exists only while one of its site's points has a hook attached
(``_sync``), so a model with no hooks runs exactly Hugging Face's forward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from . import weights as _w
from .copying import Setting, detachable
from .distributed import FsdpHookOrder
from .errors import LensAdaptersError, UnknownHookError, UnsupportedModelError
from .frames import ForwardState, RecomputeToken, tag_for_recompute
from .guard import ModuleGuard
from .head_inputs import add_head_input_sites
from .hook_point import HookPoint, is_recomputing
from .moe import MoELayout, build_moe_site, is_expert_point, is_moe, moe_point_names
from .offload import live_parameters
from .sites import (
    AttentionRotarySite,
    AttentionSite,
    BlockShapeSite,
    FusedGateUpSite,
    FusedQKVSite,
    InputSite,
    NormedRotarySite,
    NormSite,
    OutputSite,
    PositionEmbedSite,
    ProjectionSite,
    RecomputedRotarySite,
    ResidualSite,
    ResultSite,
    RotaryCaptureSite,
    ScaledOutputSite,
    Site,
    first_input,
    first_output,
    heads_view,
    replace_first_input,
    replace_first_output,
)
from .specs import (
    Architecture,
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    HookedConfig,
    LinearWeight,
    MLPLayout,
    MLPLayouts,
    ModelLayout,
    NormSpec,
    ProjectionNorm,
    QKVLayout,
    SeparateQKV,
)
from .validation import check_paths, check_result

if TYPE_CHECKING:  # pragma: no cover
    from .plugin_calls import ScopedHooks
    from .registry import PluginInfo

Tensor = torch.Tensor
Selector = Union[str, Callable[[str], bool], Sequence[str]]
_UNSET = object()
PATTERN_POINTS = ("attn.hook_attn_scores", "attn.hook_pattern")


def _norm_points(prefix: str) -> list[str]:
    return [f"{prefix}.hook_scale", f"{prefix}.hook_normalized"]


def qkv_point_names(qkv: QKVLayout) -> list[str]:
    """The query/key/value points of one block (relative to ``blocks.{i}.``), in the order they fire.

    Separate projections run one after another, each query/key rotated as soon as it is projected (or, with a
    ``q_norm``/``k_norm``, as soon as it is normalized); a fused projection yields q, k and v at once and rotary
    follows.
    """
    rotary = qkv.rotary is not None
    if isinstance(qkv, FusedQKV):
        return ["attn.hook_q", "attn.hook_k", "attn.hook_v"] + (
            ["attn.hook_rot_q", "attn.hook_rot_k"] if rotary else []
        )
    norms = {"q": qkv.q_norm, "k": qkv.k_norm}

    def after_norm(x: str) -> list[str]:  # the norm's points, then rotary on its output
        if norms[x] is None:
            return []
        return _norm_points(f"attn.{x}_norm") + ([f"attn.hook_rot_{x}"] if rotary else [])

    def projection(x: str) -> list[str]:  # the projection, rotated right away when no norm follows it
        return [f"attn.hook_{x}"] + ([f"attn.hook_rot_{x}"] if rotary and norms[x] is None else [])

    if qkv.norms_after_projections:
        return projection("q") + projection("k") + ["attn.hook_v"] + after_norm("q") + after_norm("k")
    return projection("q") + after_norm("q") + projection("k") + after_norm("k") + ["attn.hook_v"]


def is_gated(mlp: Union[MLPLayouts, MoELayout]) -> bool:
    """Whether a dense MLP layout has a gate and an up projection (``mlp.hook_pre_linear``, ``W_gate``)."""
    return isinstance(mlp, FusedGateUp) or (isinstance(mlp, MLPLayout) and mlp.pre_linear is not None)


def block_point_names(block: BlockLayout, qkv: QKVLayout, mlp: Union[MLPLayouts, MoELayout]) -> list[str]:
    """The core's hook points of one block (relative to ``blocks.{i}.``), in the order they fire.

    Post-norm blocks normalize after each residual add; ``ln1_post``/``ln2_post`` normalize the attention and
    MLP outputs before the residual adds.
    """
    ln1 = _norm_points("ln1") if block.ln1 is not None else []
    attn = qkv_point_names(qkv)
    attn += ["attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "attn.hook_result"]
    attn += (_norm_points("ln1_post") if block.ln1_post is not None else []) + ["hook_attn_out"]
    if is_moe(mlp):  # a mixture of experts: routing and per-expert points (lensadapters.moe)
        mlp_names = moe_point_names(mlp)
    else:
        mlp_names = ["mlp.hook_pre"] + (["mlp.hook_pre_linear"] if is_gated(mlp) else []) + ["mlp.hook_post"]
    mlp_names += (_norm_points("ln2_post") if block.ln2_post is not None else []) + ["hook_mlp_out"]
    if block.post_norm:
        return (
            ["hook_resid_pre"]
            + attn
            + ["hook_resid_mid"]
            + ln1
            + ["hook_mlp_in"]
            + mlp_names
            + _norm_points("ln2")
            + ["hook_resid_post"]
        )
    names = ["hook_resid_pre"] + ln1 + attn
    if not block.parallel:
        names.append("hook_resid_mid")
    if block.ln2 is not None:
        names += ["hook_mlp_in"] + _norm_points("ln2")
    elif not block.parallel:  # no pre-MLP norm (OLMo 2): the MLP reads the residual stream itself
        names.append("hook_mlp_in")
    return names + mlp_names + ["hook_resid_post"]


class Wiring:
    """The description of one wrapped model, its hook points, and the sites serving them (see the module docstring).

    Everything public here is the plugin protocol (:class:`lensadapters.protocol.Hooked`); the rest is the core's.
    """

    def __init__(
        self, model: Any, hf_model: nn.Module, arch: Architecture, plugin: "PluginInfo", hooks: "ScopedHooks"
    ) -> None:
        self.model = model
        self.hf_model = hf_model
        self._fsdp_order = FsdpHookOrder(hf_model)  # FSDP2's hooks stay around ours (sharded before or after)
        self.owner: Any = None  # the HookedModel (set by it): alive as long as the model's hooks reference this
        self.arch = arch
        self.plugin = plugin
        self.plugin_hooks = hooks
        self.cfg: HookedConfig = self._describe("lensadapters_config", (HookedConfig,), "for the model")
        self.layout: ModelLayout = self._describe("lensadapters_embed", (ModelLayout,), "for the model")
        self.block_modules: list[nn.Module] = self._blocks()
        n = len(self.block_modules)
        self.block_layouts: list[Optional[BlockLayout]] = [
            self._describe("lensadapters_block", (BlockLayout, type(None)), f"for layer {i}", i) for i in range(n)
        ]
        # an opaque block (lensadapters_block returned None) gets no points and no further description
        self.qkv_layouts: list[Optional[QKVLayout]] = [
            None
            if bl is None
            else self._describe("lensadapters_attn_qkv", (SeparateQKV, FusedQKV), f"for layer {i}", i)
            for i, bl in enumerate(self.block_layouts)
        ]
        self.mlp_layouts: list[Optional[MLPLayout]] = [
            None
            if bl is None
            else self._describe("lensadapters_mlp_act", (MLPLayout, FusedGateUp, MoELayout), f"for layer {i}", i)
            for i, bl in enumerate(self.block_layouts)
        ]
        self.attention_modules = [
            b.get_submodule(bl.attn) if bl is not None else None
            for b, bl in zip(self.block_modules, self.block_layouts)
        ]
        self.forward_state = ForwardState()
        self.guard = ModuleGuard(hf_model)  # the module paths as they are now, before any plugin code runs
        self._points: dict[str, HookPoint] = {}
        self._claimed: dict[str, str] = {}  # point name -> the plugin serving it instead of the core
        self._building = False
        self._sites: list[Site] = []
        self._point_sites: dict[HookPoint, list[Site]] = {}
        self._norm_modules: dict[str, nn.Module] = {}
        self._installed: dict[Site, tuple[tuple[bool, ...], list[Any]]] = {}
        self._dirty: set[Site] = set()
        self._hooked_points: set[HookPoint] = set()  # points with a hook attached, kept as hooks come and go
        self._defer = 0
        self._pattern_backend: Any = None
        self._compile_setting: Any = _UNSET
        self._build()

    # --- the description, checked as it is read ---------------------------------------------------------

    def _describe(self, hook: str, expected: tuple[type, ...], what: str, layer: Optional[int] = None) -> Any:
        """One description object from the plugins, of the expected type, its module paths checked in the model."""
        kwargs: dict[str, Any] = {"arch": self.arch, "model": self.hf_model}
        if layer is not None:
            kwargs["layer"] = layer
        value, supplier = self.plugin_hooks.__getattr__(hook).answer(**kwargs)
        supplier = supplier or self.plugin.name
        check_result(supplier, hook, value, expected, what)
        owner = self.hf_model if layer is None else self.block_modules[layer]
        where = "a path from the model" if layer is None else f"a path from block {layer}, {self._blocks_path(layer)}"
        check_paths(supplier, owner, value, where)
        return value

    def _blocks_path(self, layer: int) -> str:
        return f"{self.layout.blocks}.{layer}"

    def _blocks(self) -> list[nn.Module]:
        blocks = self.hf_model.get_submodule(self.layout.blocks)
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise UnsupportedModelError(
                f"plugin {self.plugin.name!r}: ModelLayout.blocks={self.layout.blocks!r} is a "
                f"{type(blocks).__name__}; it must name the ModuleList of decoder layers"
            )
        return list(blocks)

    # --- hook points (plugin protocol) ------------------------------------------------------------

    @property
    def hook_names(self) -> list[str]:
        """Every hook point, in the order the points fire."""
        return list(self._points)

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        return dict(self._points)

    def point(self, name: str) -> HookPoint:
        """The hook point ``name`` (``UnknownHookError`` if the model has none)."""
        if name not in self._points:
            raise UnknownHookError(name, self._points)
        return self._points[name]

    def new_point(self, name: str, after: Optional[str] = None, before: Optional[str] = None) -> HookPoint:
        """Create a hook point; ``after`` or ``before`` (an existing name) places it in ``hook_names``, which
        lists points in the order they fire (the contract checks it)."""
        if name in self._points:
            raise LensAdaptersError(
                f"hook point {name!r} exists twice; a plugin defines it again (to serve a point "
                f"the core creates, use claim_point({name!r}))"
            )
        point = HookPoint(name, self._point_changed, self.forward_state)
        anchor = before if before in self._points else after if after in self._points else None
        if anchor is None:
            self._points[name] = point
        else:
            items = list(self._points.items())
            at = [k for k, _ in items].index(anchor) + (0 if anchor == before else 1)
            self._points = dict(items[:at] + [(name, point)] + items[at:])
        return point

    def remove_point(self, name: str) -> None:
        """Remove a point that :meth:`new_point` made and no site fires (an SAE's points), with its hooks."""
        point = self.point(name)
        if self._point_sites.get(point):
            raise LensAdaptersError(f"hook point {name!r} is fired by the model's modules and cannot be removed")
        self._hooked_points.discard(point)
        del self._points[name]

    def claim_point(self, name: str) -> HookPoint:
        """Take over a point the core created: the core builds no site for it, the caller's site serves it.

        Only during ``lensadapters_extra_sites`` (before the core builds its sites). The point keeps its
        name and place in ``hook_names``.
        """
        if not self._building:
            raise LensAdaptersError(f"claim_point({name!r}) works only inside lensadapters_extra_sites")
        point = self.point(name)
        owner = self._claimed.get(name)
        if owner is not None:
            raise LensAdaptersError(f"hook point {name!r} is claimed twice (first by {owner})")
        self._claimed[name] = "a plugin"
        return point

    def add_site(self, site: Site) -> None:
        """Register a site; its points' hooks install and remove its PyTorch hooks from now on."""
        if isinstance(site, NormSite) and site.scale.name.endswith(".hook_scale"):
            self.register_norm(site.scale.name[: -len(".hook_scale")], site.module)
        self._sites.append(site)
        for point in site.points:
            self._point_sites.setdefault(point, []).append(site)

    def register_norm(self, prefix: str, module: nn.Module) -> None:
        """Record the module behind ``{prefix}.hook_scale``/``hook_normalized`` (``norm_module`` answers it)."""
        self._norm_modules[prefix] = module

    @property
    def sites(self) -> tuple[Site, ...]:
        """Every site, the core's and the plugins'."""
        return tuple(self._sites)

    @property
    def has_hooks(self) -> bool:
        """Whether any hook point has a hook attached (the core's own cache readers included); O(1)."""
        return bool(self._hooked_points)

    def select(self, name: Selector) -> list[HookPoint]:
        """The points a name, a list of names or a predicate on names selects."""
        if isinstance(name, str):
            return [self.point(name)]
        if callable(name):
            return [pt for n, pt in self._points.items() if name(n)]
        selected: list[HookPoint] = []
        for item in name:
            selected += self.select(item)
        return selected

    # --- reading the model (plugin protocol) --------------------------------------------------------

    def read_linear(self, module: nn.Module) -> LinearWeight:
        """The effective ``LinearWeight`` (``[d_in, d_out]`` and bias) of a linear-like module, through every plugin."""
        return _w.read_linear(self, module)

    def norm_spec(self, module: nn.Module) -> NormSpec:
        """How ``module`` (one of the model's norms) normalizes: a ``NormSpec`` with live weights."""
        return self._norm_spec(module)()

    def norm_module(self, prefix: str) -> nn.Module:
        """The norm module whose ``hook_scale``/``hook_normalized`` points start with ``prefix``
        (``"blocks.0.ln1"``, ``"ln_final"``, a plugin's ``"blocks.0.attn.q_norm"``...)."""
        try:
            return self._norm_modules[prefix]
        except KeyError:
            raise UnknownHookError(prefix + ".hook_scale", self._points) from None

    def module_name(self, module: nn.Module) -> str:
        """The qualified name of ``module`` in the Hugging Face model (for error messages)."""
        for name, candidate in self.hf_model.named_modules():
            if candidate is module:
                return name or "<model>"
        return type(module).__name__

    def attention_implementation(self) -> str:
        """The attention implementation the model is configured with (``config._attn_implementation``)."""
        from .attention import KEY_PREFIX

        impl = getattr(self.hf_model.config, "_attn_implementation", None) or "eager"
        return impl[len(KEY_PREFIX) :] if impl.startswith(KEY_PREFIX) else impl

    @property
    def pattern_backend(self) -> Any:
        """The backend serving ``hook_attn_scores``/``hook_pattern`` (created on first use)."""
        if self._pattern_backend is None:
            self._pattern_backend = self.plugin_hooks.lensadapters_attn_pattern(arch=self.arch, hooked=self)
        return self._pattern_backend

    def _norm_spec(self, module: nn.Module) -> Callable[[], NormSpec]:
        arch, hooks = self.arch, self.plugin_hooks

        def spec() -> NormSpec:
            try:
                with live_parameters(module):  # the spec keeps the loaded weights of an offloaded norm
                    result, supplier = hooks.lensadapters_norm_scale.answer(arch=arch, module=module)
            except UnsupportedModelError as exc:
                raise UnsupportedModelError(f"{self.module_name(module)}: {exc}") from None
            if result is not None and not isinstance(result, NormSpec):
                raise UnsupportedModelError(
                    f"plugin {supplier!r}: lensadapters_norm_scale returned a "
                    f"{type(result).__name__} for {self.module_name(module)}; it must "
                    f"return a NormSpec (or None for norms it does not know)"
                )
            if result is None:
                raise UnsupportedModelError(
                    f"no plugin knows how {type(module).__name__} ({self.module_name(module)}) normalizes; "
                    f"implement lensadapters_norm_scale for it"
                )
            return result

        return spec

    def _linear_reader(self, module: nn.Module) -> Callable[[], tuple[Tensor, Optional[Tensor]]]:
        def read() -> tuple[Tensor, Optional[Tensor]]:
            lw = self.read_linear(module)
            return lw.W, lw.b

        return read

    # --- building (the three phases of the module docstring) ------------------------------------------

    def _build(self) -> None:
        self._check_layouts()
        self._create_points()
        self._building = True
        try:
            for sites in self.plugin_hooks.lensadapters_extra_sites(arch=self.arch, hooked=self):
                for site in sites or ():
                    self.add_site(site)
        finally:
            self._building = False
        self._build_core_sites()
        add_head_input_sites(self)  # blocks.L.hook_attn_in / hook_{q,k,v}_input, computed only when hooked
        self._show_flat_tokens_as_batches()
        self._frame_site = _FrameSite(self)
        self.add_site(self._frame_site)
        self._check_norms()

    def _check_norms(self) -> None:
        """Ask the spec of every norm a NormSite serves once at wrap time: a norm nobody can describe (or whose
        guessed spec the module contradicts) is refused now, with its name, not at the first hook. (A norm a plugin
        registers for points it serves itself is that plugin's to describe.)"""
        norms = [site.module for site in self._sites if isinstance(site, NormSite)]
        with torch.no_grad():
            for module in dict.fromkeys(norms):
                self._norm_spec(module)()

    def _check_layouts(self) -> None:
        def refuse(what: str, layer: int) -> None:
            raise UnsupportedModelError(f"plugin {self.plugin.name!r}: {what} (layer {layer})")

        for i, (bl, mlp) in enumerate(zip(self.block_layouts, self.mlp_layouts)):
            if bl is None:  # an opaque block (see the module docstring)
                continue
            if is_moe(mlp) and (bl.mlp is None or bl.post_norm or bl.ln2_post is not None):
                refuse("a mixture-of-experts MLP needs BlockLayout.mlp (the MoE module) in a pre-norm block", i)
            if bl.post_norm and (bl.parallel or bl.ln2 is None or bl.ln1 is None):
                refuse("a post_norm block needs ln1 and ln2 and cannot be parallel", i)
            if bl.post_norm and (bl.ln1_post or bl.ln2_post):
                refuse("a post_norm block normalizes after the residual adds; it has no ln1_post/ln2_post", i)
            if bl.post_norm and bl.mlp is None and is_gated(mlp):
                refuse("a post_norm gated MLP needs BlockLayout.mlp (the module whose input is hook_mlp_in)", i)
            if bl.ln1 is None and bl.parallel:
                refuse("a parallel block needs ln1", i)
            if bl.ln2 is None and not bl.parallel and bl.mlp is None:
                refuse("a sequential block without ln2 needs BlockLayout.mlp (the module reading hook_mlp_in)", i)
            if bl.ln2_post is not None and bl.parallel:
                refuse("ln2_post in a parallel block is not supported", i)
        if any(q is not None and q.rotary is not None for q in self.qkv_layouts) and not (
            self.layout.rotary or self.layout.rotary_input
        ):
            raise UnsupportedModelError(
                f"plugin {self.plugin.name!r} declares rotary queries but no rotary module "
                f"(ModelLayout.rotary) or attention argument (ModelLayout.rotary_input)"
            )

    def _create_points(self) -> None:
        new = self.new_point
        new("hook_embed")
        if self.layout.pos_embed:
            new("hook_pos_embed")
        for i, (bl, qkv, mlp) in enumerate(zip(self.block_layouts, self.qkv_layouts, self.mlp_layouts)):
            if bl is None:  # an opaque block: its plugin creates its points
                continue
            for name in block_point_names(bl, qkv, mlp):
                new(f"blocks.{i}.{name}").costly = is_expert_point(name)
        if self.layout.ln_final:
            new("ln_final.hook_scale")
            new("ln_final.hook_normalized")

    def _embeddings_argument(self) -> Optional[int]:
        """Where ``inputs_embeds`` stands among the model's positional arguments, when the token-embedding module
        is the layout's ``embed`` module (``inputs_embeds`` then replaces exactly its output); ``-1``: keyword only;
        ``None``: ``hook_embed`` sits elsewhere (after a projection that runs on ``inputs_embeds`` as well)."""
        try:
            token_embedding = self.hf_model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            return None
        if token_embedding is None or token_embedding is not self.hf_model.get_submodule(self.layout.embed):
            return None
        try:
            names = list(inspect.signature(self.hf_model.forward).parameters)
        except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
            return -1
        return names.index("inputs_embeds") if "inputs_embeds" in names else -1

    def _given_embeddings(self, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """``hook_embed`` on the ``inputs_embeds`` a caller passed instead of token ids (see the README): the
        embedding module does not run then, and the given embeddings are what it would have output."""
        at = self._embeds_at
        if at is None:
            return None
        positional = 0 <= at < len(args)
        embeds = args[at] if positional else kwargs.get("inputs_embeds")
        if not isinstance(embeds, Tensor):
            return None
        self.forward_state.batch = embeds.shape[0]  # what the embedding module's output tells hook_pos_embed
        point = self._points.get("hook_embed")
        if point is None or "hook_embed" in self._claimed or not point.active:
            return None
        value, changed = point.apply(embeds, protect=True)  # the caller's tensor is theirs: edits go to a copy
        if not changed:
            return None
        if positional:
            return args[:at] + (value,) + args[at + 1 :], kwargs
        return args, {**kwargs, "inputs_embeds": value}

    def _core(self, name: str) -> HookPoint:
        """The point a core site serves: the real one, or a detached stand-in (never hooked) if a plugin claimed it."""
        if name in self._claimed:
            return HookPoint(name, lambda point: None)
        return self._points[name]

    def _build_core_sites(self) -> None:
        m, L = self.hf_model, self.layout
        embed = m.get_submodule(L.embed)
        if L.embed_scale_after_module and L.embed_scale != 1.0:
            self.add_site(ScaledOutputSite(embed, self._core("hook_embed"), L.embed_scale))
        else:  # the module's output is what the model uses (a scaled embedding module includes its factor)
            self.add_site(OutputSite(embed, self._core("hook_embed")))
        if L.pos_embed:
            self.add_site(
                PositionEmbedSite(m.get_submodule(L.pos_embed), embed, self._core("hook_pos_embed"), self.forward_state)
            )
        for i in range(len(self.block_modules)):
            if self.block_layouts[i] is not None:
                self._build_block_sites(i)
        if L.ln_final:
            ln_f = m.get_submodule(L.ln_final)
            self.add_site(
                NormSite(
                    ln_f,
                    self._norm_spec(ln_f),
                    self._core("ln_final.hook_scale"),
                    self._core("ln_final.hook_normalized"),
                )
            )
        self._build_rotary_sites()
        self._embeds_at = self._embeddings_argument()

    def _block_point(self, layer: int) -> Callable[[str], Optional[HookPoint]]:
        def get(name: str) -> Optional[HookPoint]:
            full = f"blocks.{layer}.{name}"
            return self._core(full) if full in self._points else None

        return get

    def _norm_site(
        self,
        module: nn.Module,
        pt: Callable[[str], Optional[HookPoint]],
        prefix: str,
        view: Any = None,
        unview: Any = None,
    ) -> None:
        self.add_site(
            NormSite(
                module,
                self._norm_spec(module),
                pt(f"{prefix}.hook_scale"),
                pt(f"{prefix}.hook_normalized"),
                view,
                unview,
            )
        )

    def _build_block_sites(self, i: int) -> None:
        block, bl = self.block_modules[i], self.block_layouts[i]
        pt, get = self._block_point(i), block.get_submodule
        self.add_site(InputSite(block, pt("hook_resid_pre")))
        if bl.ln1 is not None:
            ln1 = get(bl.ln1)
            if bl.post_norm:
                self.add_site(InputSite(ln1, pt("hook_resid_mid")))
            self._norm_site(ln1, pt, "ln1")
        self._build_qkv_sites(i)
        attention_site = AttentionSite(i, _LazyBackend(self), pt("attn.hook_attn_scores"), pt("attn.hook_pattern"))
        self.guard.also(attention_site, [self.attention_modules[i]])
        self.add_site(attention_site)
        o_proj = get(bl.o_proj)
        self.add_site(InputSite(o_proj, pt("attn.hook_z"), heads=self.cfg.n_heads))
        self.add_site(ResultSite(o_proj, pt("attn.hook_result"), self.cfg.n_heads, self._linear_reader(o_proj)))
        if bl.ln1_post is not None:  # the post norm's output is what the block adds to the residual
            ln1_post = get(bl.ln1_post)
            self._norm_site(ln1_post, pt, "ln1_post")
            self.add_site(OutputSite(ln1_post, pt("hook_attn_out")))
        else:
            self.add_site(OutputSite(get(bl.attn), pt("hook_attn_out")))
        if bl.ln2 is not None:
            self._norm_site(get(bl.ln2), pt, "ln2")
        self._build_mlp_sites(i)

    def _build_qkv_sites(self, i: int) -> None:
        qkv, pt, get, state = (
            self.qkv_layouts[i],
            self._block_point(i),
            self.block_modules[i].get_submodule,
            self.forward_state,
        )
        q, k, v = pt("attn.hook_q"), pt("attn.hook_k"), pt("attn.hook_v")
        rot_q, rot_k = pt("attn.hook_rot_q"), pt("attn.hook_rot_k")
        if isinstance(qkv, FusedQKV):
            self.add_site(FusedQKVSite(get(qkv.module), qkv, q, k, v, state, rot_q, rot_k))
            return
        n_heads, n_kv = self.cfg.n_heads, self.cfg.n_key_value_heads
        for x, point, rot, path, heads, norm in (
            ("q", q, rot_q, qkv.q, n_heads, qkv.q_norm),
            ("k", k, rot_k, qkv.k, n_kv, qkv.k_norm),
        ):
            if norm is None:
                self.add_site(ProjectionSite(get(path), point, heads, state, rot, qkv.rotary))
                continue
            self.add_site(ProjectionSite(get(path), point, heads, state))
            self._projection_norm_sites(i, x, norm, heads, rot, qkv)
        self.add_site(ProjectionSite(get(qkv.v), v, n_kv, state))

    def _projection_norm_sites(
        self, i: int, x: str, norm: ProjectionNorm, heads: int, rot: Optional[HookPoint], qkv: SeparateQKV
    ) -> None:
        """``attn.q_norm.*`` (or ``k_norm``) on a norm between projection and rotary, and rotary on its output."""
        module, pt = self.block_modules[i].get_submodule(norm.module), self._block_point(i)
        view = unview = None
        if norm.layout == "bhpd":  # shown per position as [b, p, h, ...] like hook_q
            view, unview = heads_view("bhpd", heads)
        self._norm_site(module, pt, f"attn.{x}_norm", view, unview)
        if rot is not None and qkv.rotary is not None:
            self.add_site(NormedRotarySite(module, norm, heads, rot, qkv.rotary, self.forward_state))

    def _build_mlp_sites(self, i: int) -> None:
        block, bl, mlp = self.block_modules[i], self.block_layouts[i], self.mlp_layouts[i]
        pt, get = self._block_point(i), block.get_submodule
        first: Optional[nn.Module] = None  # the MLP's first module (its input is hook_mlp_in in a post-LN block)
        if is_moe(mlp):
            self.add_site(build_moe_site(self, i, mlp, pt))
        elif isinstance(mlp, FusedGateUp):
            self.add_site(FusedGateUpSite(get(mlp.module), mlp, pt("mlp.hook_pre"), pt("mlp.hook_pre_linear")))
            first = get(mlp.module)
        else:
            self.add_site(OutputSite(get(mlp.pre), pt("mlp.hook_pre")))
            if mlp.pre_linear is not None:
                self.add_site(OutputSite(get(mlp.pre_linear), pt("mlp.hook_pre_linear")))
            first = get(mlp.pre)
        if not is_moe(mlp):
            self.add_site(InputSite(get(mlp.out), pt("mlp.hook_post")))
        if bl.ln2_post is not None:  # the post norm's output is what the block adds to the residual
            mlp_out_module = get(bl.ln2_post)
            self._norm_site(mlp_out_module, pt, "ln2_post")
        else:
            mlp_out_module = get(bl.mlp) if bl.mlp is not None else get(mlp.out)  # a MoE has bl.mlp (checked)
        if bl.post_norm:
            # every residual point is a plain module input/output: the norms carry edits downstream
            self.add_site(
                InputSite(get(bl.mlp) if bl.mlp is not None else first, pt("hook_mlp_in"), protect=True)
            )  # ln1's output is the MLP's residual too
            self.add_site(OutputSite(mlp_out_module, pt("hook_mlp_out")))
            self.add_site(OutputSite(block, pt("hook_resid_post")))
            return
        residual_add = (
            get(bl.mlp_residual)
            if bl.mlp_residual
            else mlp_out_module
            if bl.ln2_post is not None
            else get(bl.mlp)
            if bl.mlp is not None
            else None
        )
        # the module whose input is hook_resid_mid/hook_mlp_in: ln2, or the MLP itself in a block without one
        mlp_entry = (
            get(bl.ln2) if bl.ln2 is not None else get(bl.mlp) if not bl.parallel and bl.mlp is not None else None
        )
        self.add_site(
            ResidualSite(
                i,
                block,
                mlp_entry,
                mlp_out_module,
                self.forward_state,
                pt("hook_resid_mid"),
                pt("hook_mlp_in"),
                pt("hook_mlp_out"),
                pt("hook_resid_post"),
                residual_add=residual_add,
            )
        )

    def _build_rotary_sites(self) -> None:
        rot_points = [self._core(n) for n in self._points if n.endswith(("attn.hook_rot_q", "attn.hook_rot_k"))]
        if not rot_points:
            return
        L = self.layout
        if L.rotary_input:  # each layer's (cos, sin) from its attention module's arguments
            for i in range(len(self.block_modules)):
                points = [pt for pt in rot_points if pt.name.startswith(f"blocks.{i}.")]
                if points:
                    self.add_site(
                        AttentionRotarySite(self.attention_modules[i], L.rotary_input, points, self.forward_state)
                    )
            return
        rotary_module = self.hf_model.get_submodule(L.rotary)
        self.add_site(RotaryCaptureSite(rotary_module, rot_points, self.forward_state, L.rotary_from_inputs))
        for i in range(len(self.block_modules)):
            points = [pt for pt in rot_points if pt.name.startswith(f"blocks.{i}.")]
            if points:
                self.add_site(
                    RecomputedRotarySite(
                        self.attention_modules[i], points, self.forward_state, rotary_module, L.rotary_from_inputs
                    )
                )

    def _show_flat_tokens_as_batches(self) -> None:
        for i, block in enumerate(self.block_modules):
            if self.block_layouts[i] is not None and self.block_layouts[i].flat_mlp:
                # every point of the block, plugin-added ones (PEFT's *_lora) included, shows [b*p, ...] as [b, p, ...]
                block_points = [pt for name, pt in self._points.items() if name.startswith(f"blocks.{i}.")]
                for point in block_points:
                    point.token_shape = functools.partial(self._block_shape, i)
                self.add_site(BlockShapeSite(i, block, block_points, self.forward_state))

    def _block_shape(self, layer: int) -> Optional[tuple[int, ...]]:
        return self.forward_state.block_shape.get(layer)

    # --- installing sites as hooks come and go -------------------------------------------------------

    def _point_changed(self, point: HookPoint) -> None:
        if point.active:
            self._hooked_points.add(point)
        else:
            self._hooked_points.discard(point)
        self._dirty.update(self._point_sites.get(point, ()))
        if not self._defer:
            self._sync()

    def remove_hooks(self, predicate: Callable[[Any], bool], points: Optional[Iterable[HookPoint]] = None) -> None:
        """Remove the hooks ``predicate`` accepts (a ``HookEntry`` predicate) from ``points`` (default: all)."""
        with self.batched():
            for point in self._points.values() if points is None else dict.fromkeys(points):
                if point.remove_where(predicate):
                    if not point.active:
                        self._hooked_points.discard(point)
                    self._dirty.update(self._point_sites.get(point, ()))
        self.forward_state.clear()

    @property
    def installed(self) -> bool:
        """Whether any site has PyTorch hooks on the model now."""
        return bool(self._installed)

    def unpin(self, points: Sequence[HookPoint]) -> None:
        """A forward that may have been recomputed with these points' hooks is gone (its graph was freed).

        Called from a finalizer, at any time: the sites are re-installed at the next safe moment (``sync``).
        """
        for point in points:
            point.pins -= 1
            if not point.active:
                self._hooked_points.discard(point)
            self._dirty.update(self._point_sites.get(point, ()))

    def sync(self) -> None:
        """Install and remove PyTorch hooks as the attached hooks require (when no forward of this thread runs)."""
        if self._dirty and not self._defer and self.forward_state.open_frames == 0:
            self._sync()

    def _sync(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for site in dirty:
            signature = site.signature()
            current = self._installed.get(site)
            if current is not None and current[0] == signature:
                continue
            if site is getattr(self, "_frame_site", None) and not any(signature) and self.forward_state.open_frames:
                self._dirty.add(site)  # a forward of this thread still needs its frame closed: remove it later
                continue
            if current is not None:
                for handle in current[1]:
                    handle.remove()
                del self._installed[site]
            if any(signature):
                self._installed[site] = (signature, [detachable(handle) for handle in site.install()])
        self._fsdp_order.outermost()
        self.guard.watch(self._installed)
        self._guard_compile(bool(self._installed))

    def uninstall(self) -> None:
        """Remove every PyTorch hook of every site (``unwrap``)."""
        for _, handles in list(self._installed.values()):
            for handle in handles:
                handle.remove()
        self._installed.clear()
        self._fsdp_order.restore()
        self.guard.watch(())
        self._guard_compile(False)
        self.forward_state.clear()

    def _guard_compile(self, hooked: bool) -> None:
        """While any hook is installed, ``generate`` must not compile the forward.

        transformers compiles the decoding forward on its own for static caches on accelerators; a
        compiled graph does not see PyTorch hooks added after it was traced (dynamo skips hook guards),
        so hooks would run on the first step and silently not on the others. The model's
        ``generation_config.disable_compile`` holds a :class:`lensadapters.copying.Setting` while hooks exist
        (truthy for ``generate``; the user's own value for ``save_pretrained``, copies and pickles) and gets the
        user's value back when they go.
        """
        config = getattr(self.hf_model, "generation_config", None)
        if config is None:
            return
        if hooked and self._compile_setting is _UNSET:
            current = getattr(config, "disable_compile", None)
            if current:  # the user's own setting disables compilation already
                return
            self._compile_setting = current
            ref = weakref.ref(self)
            config.disable_compile = Setting(current, lambda: _installed(ref), self.hf_model)
        elif not hooked and self._compile_setting is not _UNSET:
            if isinstance(getattr(config, "disable_compile", None), Setting):  # not set by the user meanwhile
                config.disable_compile = self._compile_setting
            self._compile_setting = _UNSET

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Add or remove many hooks, installing PyTorch hooks once at the end."""
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1
            if not self._defer:
                self._sync()

    def _recompute_token(self) -> Optional[RecomputeToken]:
        """A snapshot of the hooks of the forward starting now, when gradient checkpointing may recompute it."""
        if not torch.is_grad_enabled() or not any(
            b.training and getattr(b, "gradient_checkpointing", False) for b in self.block_modules
        ):
            return None
        thread, depth = threading.get_ident(), self.forward_state.depth
        snapshot: dict[HookPoint, tuple[list[Any], list[Any]]] = {}
        for point in list(self._hooked_points):
            fwd = [e for e in point.fwd_hooks if not e.readonly and e.applies(thread, depth)]
            bwd = [e for e in point.bwd_hooks if e.applies(thread, depth)]
            if fwd or bwd:
                snapshot[point] = (fwd, bwd)
        if not snapshot:
            return None
        token = RecomputeToken(snapshot, weakref.WeakMethod(self.sync))  # sites removed once the graph is freed
        points = list(snapshot)
        for point in points:
            point.pins += 1
        weakref.finalize(token, self.unpin, points)
        return token

    def check_pattern_implementation(self) -> None:
        """Refuse pattern/score hooks under an attention implementation the plugin's backend cannot read."""
        impl = self.attention_implementation()
        if impl not in self.arch.attn_implementations:
            raise UnsupportedModelError(
                f"hook_attn_scores and hook_pattern are computed explicitly in the layers that are hooked, with the "
                f"masks of the {' or '.join(map(repr, self.arch.attn_implementations))} attention implementation; "
                f"this model uses {impl!r}. Call model.set_attn_implementation({self.arch.attn_implementations[-1]!r}) "
                f"to hook patterns, or leave patterns out (run_with_cache(names_filter=lambda n: not "
                f"n.endswith(('hook_pattern', 'hook_attn_scores')))): every other hook point works with {impl!r}"
            )


def _installed(ref: "weakref.ref[Wiring]") -> bool:
    wiring = ref()
    return wiring is not None and bool(wiring._installed)


class _FrameSite(Site):
    """Opens a frame (:mod:`lensadapters.frames`) around every forward of the model while any site is installed,
    and tags the output of each block for gradient-checkpoint recomputation when the forward may be recomputed."""

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self.points = tuple(wiring.hook_dict.values())

    def wanted(self) -> bool:
        return self.wiring.has_hooks

    def install(self) -> list[Any]:
        model = self.wiring.hf_model
        handles = [
            model.register_forward_pre_hook(self._open, with_kwargs=True),
            model.register_forward_hook(self._close, always_call=True),
        ]
        for block in self.wiring.block_modules:
            handles.append(block.register_forward_hook(self._tag))
        # where the hidden states leave the blocks: reentrant checkpointing runs the blocks' own hooks without
        # gradients, so the graph is tagged here too (before the final norm, or the unembedding)
        exit_path = self.wiring.layout.ln_final or self.wiring.layout.unembed
        if exit_path:
            handles.append(model.get_submodule(exit_path).register_forward_pre_hook(self._tag_input, with_kwargs=True))
        return handles

    def _open(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        wiring = self.wiring
        if module is not wiring.hf_model:
            raise LensAdaptersError(
                f"a copy of the wrapped {type(module).__name__} ran (torch.nn.DataParallel replicates the model into "
                f"worker threads) while lensadapters hooks were attached: hook points and caches belong to the wrapped "
                f"model itself. Use DistributedDataParallel (one process per device) or run the model unreplicated"
            )
        frame = wiring.forward_state.push()  # popped by _close even if what follows raises
        wiring.guard.check()
        frame.token = wiring._recompute_token()
        return wiring._given_embeddings(args, kwargs)

    def _close(self, module: nn.Module, args: tuple, output: Any) -> None:
        if module is self.wiring.hf_model:
            self.wiring.forward_state.pop()

    def _tagged(self, hidden: Any, exit: bool = False) -> Optional[torch.Tensor]:
        token = self.wiring.forward_state.frame.token
        if (
            token is None
            or not torch.is_grad_enabled()
            or is_recomputing()
            or not isinstance(hidden, torch.Tensor)
            or not hidden.requires_grad
        ):
            return None
        return tag_for_recompute(hidden, token, exit)

    def _tag(self, module: nn.Module, args: tuple, output: Any) -> Any:
        tagged = self._tagged(first_output(output))
        return None if tagged is None else replace_first_output(output, tagged)

    def _tag_input(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        tagged = self._tagged(first_input(args, kwargs), exit=True)  # outside any checkpointed region
        return None if tagged is None else replace_first_input(args, kwargs, tagged)


class _LazyBackend:
    """Creates the pattern backend on first use, so wrapping costs nothing until patterns are hooked."""

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring

    def activate(self, layer: int, site: Any) -> Any:
        return self.wiring.pattern_backend.activate(layer, site)
