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

The module holds the class and its point registry; the phases live beside it: the point names in
:mod:`~lensadapters.wiring.names`, phases 1 and 3 in :mod:`~lensadapters.wiring.core_sites`, the lazy installation in
:mod:`~lensadapters.wiring.lifecycle`, the per-forward frame site in :mod:`~lensadapters.wiring.forward`.

Sites are installed lazily: a PyTorch hook exists only while one of its site's points has a hook attached
(``_sync``), so a model with no hooks runs exactly Hugging Face's forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from lensadapters.adapters.hf_helpers import text_config
from lensadapters.adapters.moe import FusedExperts, MoELayout, is_moe
from lensadapters.adapters.validation import check_paths, check_result
from lensadapters.errors import LensAdaptersError, UnknownHookError, UnsupportedModelError
from lensadapters.hooks.distributed import FsdpHookOrder
from lensadapters.hooks.frames import ForwardState
from lensadapters.hooks.guard import ModuleGuard
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.sites import (
    NormSite,
    Site,
)
from lensadapters.hooks.specs import (
    Architecture,
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    HookedConfig,
    LinearWeight,
    MLPLayout,
    ModelLayout,
    NormSpec,
    OpaqueMLP,
    ProjectionParts,
    QKVLayout,
    SeparateQKV,
)
from lensadapters.wiring import weights as _w
from lensadapters.wiring.head_inputs import head_input_sites

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.adapters.plugin_calls import ScopedHooks
    from lensadapters.adapters.registry import PluginInfo

from lensadapters.wiring.core_sites import CoreSites
from lensadapters.wiring.forward import _FrameSite
from lensadapters.wiring.lifecycle import _UNSET, Installation
from lensadapters.wiring.names import is_gated

Tensor = torch.Tensor
Selector = Union[str, Callable[[str], bool], Sequence[str]]


#: what ``lensadapters_mlp_act`` may answer
MLP_DESCRIPTIONS = (MLPLayout, FusedGateUp, MoELayout, OpaqueMLP)


class Wiring(CoreSites, Installation):
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
            else self._describe("lensadapters_attn_qkv", (SeparateQKV, FusedQKV, type(None)), f"for layer {i}", i)
            for i, bl in enumerate(self.block_layouts)
        ]
        self.mlp_layouts: list[Optional[MLPLayout]] = [
            None if bl is None else self._describe("lensadapters_mlp_act", MLP_DESCRIPTIONS, f"for layer {i}", i)
            for i, bl in enumerate(self.block_layouts)
        ]
        #: the mixtures of experts of blocks a plugin serves itself (``block_layouts`` ``None``: the generic adapter's
        #: mixer form), by layer, as the plugin records them once verified: what the weight readers read them with
        self.own_mlp_layouts: dict[int, MoELayout] = {}
        self.attention_modules = [
            b.get_submodule(bl.attn) if bl is not None else None
            for b, bl in zip(self.block_modules, self.block_layouts)
        ]
        self.forward_state = ForwardState()
        self.guard = ModuleGuard(hf_model)  # the module paths as they are now, before any plugin code runs
        self._points: dict[str, HookPoint] = {}
        self._claimed: dict[str, str] = {}  # point name -> the plugin serving it instead of the core
        #: points the core creates after ``lensadapters_extra_sites`` (the per-head inputs) that a plugin asks it not
        #: to create (the generic adapter, for what it could not verify)
        self.withheld: set[str] = set()
        self._building = False
        self._sites: list[Site] = []
        self._site_order: dict[Site, int] = {}  # registration order: the order ``_sync`` installs sites in
        self._point_sites: dict[HookPoint, list[Site]] = {}
        self._norm_modules: dict[str, nn.Module] = {}
        self._projection_parts: list[ProjectionParts] = []
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

    def declare_projection_parts(self, parts: ProjectionParts) -> None:
        """Record that the points ``parts.points`` show the parts of ``parts.module``'s output (see
        :class:`~lensadapters.hooks.specs.ProjectionParts`). Only during ``lensadapters_extra_sites``; a module is
        declared once, with points that exist."""
        if not self._building:
            raise LensAdaptersError("declare_projection_parts works only inside lensadapters_extra_sites")
        if any(p.module is parts.module for p in self._projection_parts):
            raise LensAdaptersError(f"the parts of {self.module_name(parts.module)} are declared twice")
        for name in (*parts.points, parts.first_point):
            self.point(name)
        self._projection_parts.append(parts)

    @property
    def projection_parts(self) -> tuple[ProjectionParts, ...]:
        """The projections declared so far (:meth:`declare_projection_parts`), in declaration order."""
        return tuple(self._projection_parts)

    def add_site(self, site: Site) -> None:
        """Register a site; its points' hooks install and remove its PyTorch hooks from now on."""
        if isinstance(site, NormSite) and site.scale.name.endswith(".hook_scale"):
            self.register_norm(site.scale.name[: -len(".hook_scale")], site.module)
        self._site_order.setdefault(site, len(self._sites))
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
        from lensadapters.hooks.attention import KEY_PREFIX

        impl = getattr(text_config(self.hf_model), "_attn_implementation", None) or "eager"
        return impl[len(KEY_PREFIX) :] if impl.startswith(KEY_PREFIX) else impl

    @property
    def pattern_backend(self) -> Any:
        """The backend serving ``hook_attn_scores``/``hook_pattern`` (created on first use)."""
        if self._pattern_backend is None:
            self._pattern_backend = self.plugin_hooks.lensadapters_attn_pattern(arch=self.arch, hooked=self)
        return self._pattern_backend

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
        for site in head_input_sites(self):  # blocks.L.hook_attn_in / hook_{q,k,v}_input, computed only when hooked
            self.add_site(site)
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
            if bl.no_mlp:
                if bl.mlp or bl.ln2 or bl.ln2_post or bl.parallel or bl.post_norm or bl.scaled or bl.more_after_mlp:
                    refuse(
                        "a block without an MLP (BlockLayout.no_mlp) is sequential and pre-norm, with no mlp, ln2, "
                        "ln2_post, branch constants or more_after_mlp",
                        i,
                    )
                if not isinstance(mlp, OpaqueMLP):
                    refuse("a block without an MLP (BlockLayout.no_mlp) has an OpaqueMLP saying so as its MLP", i)
                continue
            if isinstance(mlp, OpaqueMLP) and bl.mlp is None:
                refuse("an MLP whose inside is not described (OpaqueMLP) needs BlockLayout.mlp (its module)", i)
            if is_moe(mlp) and mlp.beside is not None:
                if bl.post_norm or bl.ln2_post is None or bl.parallel or mlp.branch_outputs is None:
                    refuse(
                        "experts beside a dense MLP need a sequential pre-norm block with ln2_post (the norm of "
                        "the branches' sum) and MoELayout.branch_outputs",
                        i,
                    )
                if not isinstance(mlp.experts, FusedExperts) or mlp.router_output in ("logits", "scores"):
                    refuse("experts beside a dense MLP must be FusedExperts routed through the router's output", i)
            elif is_moe(mlp) and (bl.mlp is None or bl.post_norm or bl.ln2_post is not None):
                refuse("a mixture-of-experts MLP needs BlockLayout.mlp (the MoE module) in a pre-norm block", i)
            if bl.post_norm and (bl.parallel or bl.ln2 is None or bl.ln1 is None):
                refuse("a post_norm block needs ln1 and ln2 and cannot be parallel", i)
            if bl.post_norm and (bl.ln1_post or bl.ln2_post):
                refuse("a post_norm block normalizes after the residual adds; it has no ln1_post/ln2_post", i)
            if bl.resid_post_before_norm and not bl.post_norm:
                refuse("resid_post_before_norm describes a post_norm block's points; set post_norm=True", i)
            if bl.post_norm and bl.mlp is None and is_gated(mlp):
                refuse("a post_norm gated MLP needs BlockLayout.mlp (the module whose input is hook_mlp_in)", i)
            if bl.ln1 is None and bl.parallel:
                refuse("a parallel block needs ln1", i)
            if bl.ln2 is None and not bl.parallel and bl.mlp is None:
                refuse("a sequential block without ln2 needs BlockLayout.mlp (the module reading hook_mlp_in)", i)
            if bl.ln2_post is not None and bl.parallel:
                refuse("ln2_post in a parallel block is not supported", i)
            if bl.scaled and (
                bl.parallel
                or bl.post_norm
                or bl.ln1_post is not None
                or bl.ln2_post is not None
                or bl.mlp is None
                or bl.flat_mlp
                or bl.more_after_mlp
                or bl.mlp_residual is not None
                or (is_moe(mlp) and mlp.beside is not None)
            ):
                refuse(
                    "branch constants (BlockLayout.attn_scale/mlp_scale) need a sequential pre-norm block with "
                    "BlockLayout.mlp, no post norms, no flat_mlp, more_after_mlp or mlp_residual, and no experts "
                    "beside a dense MLP",
                    i,
                )
            if bl.attn_in_scale != 1.0 and (bl.ln1 is None or bl.parallel or bl.post_norm):
                refuse(
                    "an attention input constant (BlockLayout.attn_in_scale) needs a sequential block with ln1 (the "
                    "norm whose output the block multiplies by it)",
                    i,
                )
        if any(q is not None and q.rotary is not None for q in self.qkv_layouts) and not (
            self.layout.rotary or self.layout.rotary_input
        ):
            raise UnsupportedModelError(
                f"plugin {self.plugin.name!r} declares rotary queries but no rotary module "
                f"(ModelLayout.rotary) or attention argument (ModelLayout.rotary_input)"
            )

    # --- installing sites as hooks come and go -------------------------------------------------------

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
