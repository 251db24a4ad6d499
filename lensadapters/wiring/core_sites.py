"""The core's points and sites for a description (phases 1 and 3 of :mod:`lensadapters.wiring.core`).

:class:`CoreSites` is mixed into :class:`~lensadapters.wiring.core.Wiring`: it creates every point the core
serves from the plugin's ``ModelLayout``/``BlockLayout``/``QKVLayout``/``MLPLayout`` and builds the sites for
the points no plugin claimed. Every weight a site computes with is read through
:func:`lensadapters.wiring.weights.layer_weight` (``attn.hook_result``'s ``W_O`` included).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from lensadapters.adapters.moe import build_moe_site, is_expert_point, is_moe
from lensadapters.errors import UnsupportedModelError
from lensadapters.hooks.frames import ForwardState
from lensadapters.hooks.guard import ModuleGuard
from lensadapters.hooks.hook_point import HookPoint
from lensadapters.hooks.offload import live_parameters
from lensadapters.hooks.sites import (
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
    heads_view,
)
from lensadapters.hooks.sites.scaled import ScaledBranchSite
from lensadapters.hooks.specs import (
    Architecture,
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    HookedConfig,
    MLPLayout,
    ModelLayout,
    NormSpec,
    OpaqueMLP,
    ProjectionNorm,
    QKVLayout,
    SeparateQKV,
)
from lensadapters.wiring import weights as _w
from lensadapters.wiring.forward import _LazyBackend
from lensadapters.wiring.names import block_point_names
from lensadapters.wiring.vision import build_image_sites, create_image_points
from lensadapters.wiring.vision_tower import build_tower_sites, create_tower_points

Tensor = torch.Tensor


class CoreSites:
    """Creating the core's points and building its sites (mixed into ``Wiring``)."""

    # the wiring's state these methods build on (set in ``Wiring.__init__``)
    arch: Architecture
    cfg: HookedConfig
    layout: ModelLayout
    hf_model: nn.Module
    block_modules: list[nn.Module]
    block_layouts: list[Optional[BlockLayout]]
    qkv_layouts: list[Optional[QKVLayout]]
    mlp_layouts: list[Optional[MLPLayout]]
    attention_modules: list[Optional[nn.Module]]
    forward_state: ForwardState
    guard: ModuleGuard
    plugin_hooks: Any
    _points: dict[str, HookPoint]
    _claimed: dict[str, str]

    def add_site(self, site: Site) -> None:
        raise NotImplementedError  # Wiring's

    def new_point(self, name: str, after: Optional[str] = None, before: Optional[str] = None) -> HookPoint:
        raise NotImplementedError  # Wiring's

    def module_name(self, module: nn.Module) -> str:
        raise NotImplementedError  # Wiring's

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

    def _o_reader(self, layer: int) -> Callable[[], tuple[Tensor, Optional[Tensor]]]:
        """``attn.hook_result``'s weight: ``W_O`` of ``layer`` as ``[d_in, d_model]``, through the one weight reader
        (a plugin's ``W_O`` override included; the bias is in the projection's output already)."""

        def read() -> tuple[Tensor, Optional[Tensor]]:
            return _w.layer_weight(self, "W_O", layer).flatten(0, 1), None

        return read

    def _create_points(self) -> None:
        new = self.new_point
        new("hook_embed")
        if self.layout.pos_embed:
            new("hook_pos_embed")
        self._tower = create_tower_points(self, new)
        self._projector = create_image_points(self, new)
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
        if self._scaled_embed is not None:  # scaled by the model, and served at the first block's input
            self._scaled_embed.given(embeds)
            return None
        value, changed = point.apply(embeds, protect=True)  # the caller's tensor is theirs: edits go to a copy
        if not changed:
            return None
        if positional:
            return args[:at] + (value,) + args[at + 1 :], kwargs
        return args, {**kwargs, "inputs_embeds": value}

    def embed_at_first_block(self) -> Optional[ScaledOutputSite]:
        """The site serving ``hook_embed`` at the first block's input, where the model scales its embeddings in its
        own forward (``ModelLayout.embed_scale_after_module``), or ``None`` where ``hook_embed`` is the embedding
        module's output. A forward that gives block 0 a residual of its own calls the site's
        :meth:`~lensadapters.hooks.sites.generic.ScaledOutputSite.skip` (that input is no embedding); one that ends
        before block 0's own hooks run calls its :meth:`~lensadapters.hooks.sites.generic.ScaledOutputSite.serve` to
        serve ``hook_embed`` there."""
        return self._scaled_embed

    def _core(self, name: str) -> HookPoint:
        """The point a core site serves: the real one, or a detached stand-in (never hooked) if a plugin claimed it."""
        if name in self._claimed:
            return HookPoint(name, lambda point: None)
        return self._points[name]

    def _build_core_sites(self) -> None:
        m, L = self.hf_model, self.layout
        embed = m.get_submodule(L.embed)
        self._scaled_embed: Optional[ScaledOutputSite] = None
        if L.embed_scale_after_module and L.embed_scale != 1.0:
            self._scaled_embed = ScaledOutputSite(
                embed,
                self.block_modules[0],
                self._core("hook_embed"),
                L.embed_scale,
                self.forward_state,
                L.embed_scale_rounded,
                L.embed_scale_in_place,
            )
            self.add_site(self._scaled_embed)
        else:  # the module's output is what the model uses (a scaled embedding module includes its factor)
            self.add_site(OutputSite(embed, self._core("hook_embed")))
        if L.pos_embed:
            self.add_site(
                PositionEmbedSite(m.get_submodule(L.pos_embed), embed, self._core("hook_pos_embed"), self.forward_state)
            )
        build_tower_sites(self, self._tower, self._core)
        build_image_sites(self, self._projector, self._core)
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
                    # run elsewhere too: its call after the last block only
                    after=self.block_modules[-1] if L.ln_final_after_blocks else None,
                    state=self.forward_state,
                )
            )
        self._build_rotary_sites()
        self._embeds_at = self._embeddings_argument()

    def _block_point(self, layer: int) -> Callable[[str], Optional[HookPoint]]:
        def get(name: str) -> Optional[HookPoint]:
            full = f"blocks.{layer}.{name}"
            # a point a plugin claimed (and perhaps removed, as not served) gets a stand-in the core's site fires
            return self._core(full) if full in self._points or full in self._claimed else None

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
        if self.qkv_layouts[i] is not None:  # None: the block's mixer is not softmax attention (no attn.* points)
            self._build_attention_sites(i)
        if bl.ln1_post is not None:  # the post norm's output is what the block adds to the residual
            ln1_post = get(bl.ln1_post)
            self._norm_site(ln1_post, pt, "ln1_post")
            self.add_site(OutputSite(ln1_post, pt("hook_attn_out")))
        elif not bl.scaled:  # (branch constants: the ScaledBranchSite's, with the MLP's points)
            self.add_site(OutputSite(get(bl.attn), pt("hook_attn_out")))
        if bl.no_mlp:  # one branch: the block's output is hook_resid_post
            self.add_site(OutputSite(block, pt("hook_resid_post")))
            return
        if bl.ln2 is not None:
            self._norm_site(get(bl.ln2), pt, "ln2")
        self._build_mlp_sites(i)

    def _build_attention_sites(self, i: int) -> None:
        bl, pt = self.block_layouts[i], self._block_point(i)
        assert bl is not None
        self._build_qkv_sites(i)
        attention_site = AttentionSite(i, _LazyBackend(self), pt("attn.hook_attn_scores"), pt("attn.hook_pattern"))
        self.guard.also(attention_site, [self.attention_modules[i]])
        self.add_site(attention_site)
        o_proj = self.block_modules[i].get_submodule(bl.o_proj)
        self.add_site(InputSite(o_proj, pt("attn.hook_z"), heads=self.cfg.n_heads))
        if not bl.scaled:  # (branch constants: the result enters the contribution, the ScaledBranchSite's)
            self.add_site(ResultSite(o_proj, pt("attn.hook_result"), self.cfg.n_heads, self._o_reader(i)))

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
            rq, rk = (None if norm is not None else rot for norm, rot in ((qkv.q_norm, rot_q), (qkv.k_norm, rot_k)))
            self.add_site(FusedQKVSite(get(qkv.module), qkv, q, k, v, state, rq, rk))
            for x, norm, rot, heads in (("q", qkv.q_norm, rot_q, self.cfg.n_heads), ("k", qkv.k_norm, rot_k, None)):
                if norm is not None:
                    self._projection_norm_sites(i, x, norm, heads or self.cfg.n_key_value_heads, rot, qkv)
            return
        n_heads, n_kv = self.cfg.n_heads, qkv.kv_heads or self.cfg.n_key_value_heads
        if qkv.values_from_keys:
            self._values_from_keys_sites(i, qkv, n_heads, n_kv)
            return
        projections = [("q", q, rot_q, qkv.q, n_heads, qkv.q_norm), ("k", k, rot_k, qkv.k, n_kv, qkv.k_norm)]
        for x, point, rot, path, heads, norm in projections[: 1 if qkv.kv_from is not None else 2]:
            if norm is None:
                scale = qkv.scale("qk".index(x)) if isinstance(qkv, SeparateQKV) else 1.0
                self.add_site(ProjectionSite(get(path), point, heads, state, rot, qkv.rotary, scale))
                continue
            self.add_site(ProjectionSite(get(path), point, heads, state))
            self._projection_norm_sites(i, x, norm, heads, rot, qkv)
        if qkv.kv_from is not None:  # another layer's keys and values: no points here
            return
        self.add_site(ProjectionSite(get(qkv.v), v, n_kv, state))
        if qkv.v_norm is not None:
            self._projection_norm_sites(i, "v", qkv.v_norm, n_kv, None, qkv)

    def _values_from_keys_sites(self, i: int, qkv: SeparateQKV, n_heads: int, n_kv: int) -> None:
        """``SeparateQKV.values_from_keys``: ``hook_k``/``hook_v`` on the inputs of ``k_norm``/``v_norm``."""
        pt, get, state = self._block_point(i), self.block_modules[i].get_submodule, self.forward_state
        if qkv.q_norm is None or qkv.k_norm is None or qkv.v_norm is None:
            raise UnsupportedModelError("SeparateQKV.values_from_keys needs q_norm, k_norm and v_norm")
        self.add_site(ProjectionSite(get(qkv.q), pt("attn.hook_q"), n_heads, state))
        self._projection_norm_sites(i, "q", qkv.q_norm, n_heads, pt("attn.hook_rot_q"), qkv)
        for x, norm, rot in (("k", qkv.k_norm, pt("attn.hook_rot_k")), ("v", qkv.v_norm, None)):
            if norm.layout != "bphd":
                raise UnsupportedModelError("SeparateQKV.values_from_keys needs per-head norms of layout 'bphd'")
            self.add_site(InputSite(get(norm.module), pt(f"attn.hook_{x}"), protect=True))
            self._projection_norm_sites(i, x, norm, n_kv, rot, qkv)

    def _projection_norm_sites(
        self, i: int, x: str, norm: ProjectionNorm, heads: int, rot: Optional[HookPoint], qkv: QKVLayout
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
        entries: list[nn.Module] = []  # more modules reading hook_mlp_in: a MoE branch beside a dense MLP
        if is_moe(mlp):
            self.add_site(build_moe_site(self, i, mlp, pt))
            if mlp.beside is not None and mlp.branch_outputs is not None:  # checked with the layouts
                for name, path in zip(("mlp.hook_dense_out", "mlp.hook_moe_out"), mlp.branch_outputs):
                    self.add_site(OutputSite(get(path), pt(name)))
                entries = [get(path) for path in mlp.inputs]
            mlp = mlp.beside  # the dense MLP beside the experts, if any
        if mlp is None or is_moe(mlp):
            pass
        elif isinstance(mlp, OpaqueMLP):  # no point inside it (_check_layouts: bl.mlp is its module)
            first = get(bl.mlp)
        elif isinstance(mlp, FusedGateUp):
            self.add_site(FusedGateUpSite(get(mlp.module), mlp, pt("mlp.hook_pre"), pt("mlp.hook_pre_linear")))
            first = get(mlp.module)
        else:
            self.add_site(OutputSite(get(mlp.pre), pt("mlp.hook_pre"), scale=mlp.pre_scale))
            if mlp.pre_linear is not None:
                self.add_site(OutputSite(get(mlp.pre_linear), pt("mlp.hook_pre_linear")))
            first = get(mlp.pre)
        if mlp is not None and not is_moe(mlp) and not isinstance(mlp, OpaqueMLP):
            self.add_site(InputSite(get(mlp.out), pt("mlp.hook_post")))
        if bl.ln2_post is not None:  # the post norm's output is what the block adds to the residual
            mlp_out_module = get(bl.ln2_post)
            self._norm_site(mlp_out_module, pt, "ln2_post")
        else:
            mlp_out_module = get(bl.mlp) if bl.mlp is not None else get(mlp.out)  # a MoE has bl.mlp (checked)
        if bl.scaled:  # the branches added times constants: read and edited where the block adds them
            self.add_site(self._scaled_branch_site(i, mlp_out_module))
            return
        if bl.post_norm:
            # every residual point is a plain module input/output: the norms carry edits downstream
            self.add_site(
                InputSite(get(bl.mlp) if bl.mlp is not None else first, pt("hook_mlp_in"), protect=True)
            )  # ln1's output is the MLP's residual too
            self.add_site(OutputSite(mlp_out_module, pt("hook_mlp_out")))
            if bl.resid_post_before_norm:  # TransformerLens' BertBlock: the sum before ln2, then the block output
                self.add_site(InputSite(get(bl.ln2), pt("hook_resid_post")))
                self.add_site(OutputSite(block, pt("hook_normalized_resid_post")))
            else:
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
                continues=bl.more_after_mlp,
                entries=entries,
            )
        )

    def _scaled_branch_site(self, i: int, mlp_module: nn.Module) -> ScaledBranchSite:
        """The branch points of a block with branch constants (``BlockLayout.attn_scale``/``mlp_scale``; checked
        with the layouts: sequential, pre-norm, no post norms, ``BlockLayout.mlp`` set)."""
        block, bl, pt = self.block_modules[i], self.block_layouts[i], self._block_point(i)
        assert bl is not None
        get = block.get_submodule
        names = ("attn.hook_result", "hook_attn_out", "hook_resid_mid", "hook_mlp_in", "hook_mlp_out")
        points = {name: pt(name) for name in (*names, "hook_resid_post")}
        attention = self.qkv_layouts[i] is not None
        return ScaledBranchSite(
            block,
            get(bl.ln1) if bl.ln1 is not None else get(bl.attn),
            get(bl.attn),
            get(bl.o_proj) if attention else None,
            get(bl.ln2) if bl.ln2 is not None else mlp_module,
            mlp_module,
            bl.attn_scale,
            bl.mlp_scale,
            points,
            self.cfg.n_heads if attention else None,
            self._o_reader(i) if attention else None,
            self.forward_state,
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
