"""The declarative description of a Llama-shaped decoder family and the plugin derived from it:
:class:`DecoderFamily` (what a family changes of the common shape) and :class:`DecoderPlugin` (the adapter hooks of
a family, derived from its description plus its quirks), both exported by :mod:`lensadapters.hf`; import them from
there. The helpers that make a plugin module's hooks from values are :mod:`.plugin_hooks`, the toy configs such
plugins answer ``lensadapters_tiny_config`` with :mod:`.toy_configs` (re-exported here).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

from torch import Tensor, nn

from lensadapters.adapters.hf_helpers import (
    DECODER_BLOCK,
    DECODER_QKV,
    ROTATE_HALF_ROPE_TYPES,
    SWIGLU_MLP,
    architecture,
    base_path,
    config_sizes,
    fused_qkv_split,
    head_dim,
    join,
    n_kv_heads,
    norm_spec_for,
    partial_rotary_factor,
    require_attention_implementation,
    require_fused_head_shapes,
    require_head_shapes,
    require_modules,
    require_rope_types,
    require_transformers_class,
    rope_parameters,
    rope_theta,
    rope_type,
    text_config,
    unembed_path,
)
from lensadapters.adapters.hookspecs import HOOKSPEC_VERSION, hookimpl
from lensadapters.adapters.latent_attention import LatentAttention, latent_sites, refused_weight
from lensadapters.adapters.plugin_hooks import PointChain, claims, layer_hooks, opaque_blocks  # noqa: F401
from lensadapters.adapters.toy_configs import decoder_config, toy_config, toy_draw  # noqa: F401
from lensadapters.errors import WeightUnavailableError
from lensadapters.hooks.rotary import rotate_half_spec, sectioned_rotate_half_spec
from lensadapters.hooks.sites import Site
from lensadapters.hooks.specs import (
    Architecture,
    BlockLayout,
    FusedGateUp,
    FusedQKV,
    HookedConfig,
    MLPLayout,
    ModelLayout,
    NormSpec,
    ProjectionNorm,
    QKVLayout,
    RotarySpec,
    SeparateQKV,
)

__all__ = ["DecoderFamily", "DecoderPlugin", "claims", "layer_hooks", "qk_norms", "toy_config"]
__all__ += ["PointChain", "opaque_blocks", "toy_draw"]


def qk_norms(layout: str) -> tuple[ProjectionNorm, ProjectionNorm]:
    """``self_attn.q_norm`` and ``self_attn.k_norm`` as :attr:`DecoderFamily.qk_norms`, both seeing ``layout``
    (``"bphd"`` per head, ``"bpf"`` over the projection width, ``"bhpd"`` after the transpose)."""
    return ProjectionNorm("self_attn.q_norm", layout), ProjectionNorm("self_attn.k_norm", layout)


@dataclass(frozen=True)
class DecoderFamily:
    """The description of a family shaped like transformers' Llama: ``<Family>Model`` with ``embed_tokens``,
    ``layers``, ``norm`` and ``rotary_emb``; blocks with ``self_attn.{q,k,v,o}_proj`` and RoPE on the rotary
    module's ``(cos, sin)``; RMSNorm. Fields say what a family changes; the methods answer the adapter hooks::

        FAMILY = hf.DecoderFamily("Mistral", model_type="mistral", packages=("mistral",), norms=("MistralRMSNorm",))

        @hookimpl
        def lensadapters_embed(arch, model):
            return FAMILY.embed(model)
    """

    family: str
    """The name in messages ("Mistral")."""
    model_type: str
    """``cfg.model_type``."""
    packages: Optional[tuple[str, ...]] = None
    """``transformers.models.<package>`` modules whose classes are accepted (custom code registered under the same
    ``model_type`` is refused); ``None`` accepts any class with the layout."""
    norms: tuple[str, ...] = ()
    """RMSNorm class names described by :meth:`norm_spec`."""
    norm_weight_offset: float = 0.0
    """1.0 for Gemma-style ``x / rms * (1 + weight)`` norms."""
    block: BlockLayout = DECODER_BLOCK
    qkv: tuple[str, str, str] = DECODER_QKV
    qk_norms: Optional[tuple[ProjectionNorm, ProjectionNorm]] = None
    """Norms on the query and key projections, between projection and RoPE."""
    mlp: Optional[Union[MLPLayout, FusedGateUp]] = SWIGLU_MLP
    """``None`` when the plugin describes the MLP itself (mixture of experts)."""
    rotary: Callable[[int], RotarySpec] = rotate_half_spec
    """The rotation of a head of the given size."""
    rope_types: tuple[str, ...] = ROTATE_HALF_ROPE_TYPES
    attention: Optional[tuple[str, ...]] = None
    """Attention implementations accepted at wrap time; ``None`` leaves others to the core (every hook point but
    the pattern ones)."""
    fused_qkv: Optional[str] = None
    """The path of one projection computing ``[q | k | v]`` (each ``[heads, d_head]``, in that order), in place of
    ``qkv``'s three."""
    partial_rotary: bool = False
    """Only the first ``partial_rotary_factor`` (the config's) of each head's dimensions rotate."""
    multimodal_rotary: bool = False
    """Multimodal RoPE (the rope parameters' ``mrope_section``: each token has temporal, height and width positions,
    which a vision-language model computes from its image grids): the rotary module returns one ``(cos, sin)`` per
    token (``[b, p, r]``, its axes merged) or one per axis (``[3, b, p, r]``), merged by the attention along the
    sections (:func:`~lensadapters.hooks.rotary.sectioned_rotate_half_spec`); the rotation is then rotate-half."""
    rotary_input: Optional[str] = None
    """The keyword argument of each layer's attention module that carries that layer's ``(cos, sin)``, for layers
    with different RoPE sources (``ModelLayout.rotary_input``); ``None`` reads the model's ``rotary_emb``."""
    qk_norms_after_projections: bool = False
    """The q/k norms run after all three projections (``SeparateQKV.norms_after_projections``)."""
    scaled_embeddings: bool = False
    """The model multiplies the token embeddings by ``sqrt(hidden_size)``: inside the embedding module where it has an
    ``embed_scale`` (transformers 5.x), in the model's forward after it otherwise (4.x). ``hook_embed`` and ``W_E``
    include the factor; ``cfg.extra["embed_scale"]`` is it."""
    layer_optional: tuple[str, ...] = ()
    """Per-layer paths of the layout that some layers lack by design (layers reading another layer's keys and
    values have no key/value projections): not required in every layer; the plugin's ``missing_in_layer`` checks
    them where they belong."""

    @classmethod
    def named(cls, family: str, model_type: str, **fields: Any) -> DecoderFamily:
        """The usual declaration: classes of ``transformers.models.<model_type>`` only (``packages``) and RMSNorms
        of class ``<family>RMSNorm`` (``norms``); ``fields`` give the rest (and may replace either)."""
        return cls(family, model_type, **{"packages": (model_type,), "norms": (f"{family}RMSNorm",), **fields})

    def architecture(self, description: str, **fields: Any) -> Architecture:
        """The :class:`Architecture` a plugin of this family claims: :func:`~lensadapters.hf.architecture` of
        ``model_type`` (named after it and claiming it unless ``name``/``model_types`` in ``fields`` say otherwise,
        tested with ``transformers``; ``vision_language``: also the language model of a vision-language model)."""
        return architecture(self.model_type, description, **fields)

    def base(self, model: nn.Module) -> str:
        """Dotted path of the ``<Family>Model`` inside ``model`` ("" when ``model`` is one)."""
        return base_path(model, self.family)

    def layers(self, model: nn.Module) -> list[nn.Module]:
        return list(model.get_submodule(join(self.base(model), "layers")))

    def rope_type(self, model: nn.Module) -> str:
        return rope_type(model.get_submodule(join(self.base(model), "rotary_emb")))

    def rope_types_of(self, model: nn.Module) -> list[str]:
        """The rope type of every rotary module of the ``<Family>Model`` (``rotary_emb``, ``rotary_emb_local``...;
        one module with a type per layer type counts each)."""
        found = []
        for name, module in model.get_submodule(self.base(model)).named_children():
            if name.startswith("rotary_emb"):
                kind = getattr(module, "rope_type", "default")
                found += list(kind.values()) if isinstance(kind, dict) else [str(kind)]
        return found

    def layer_paths(self) -> tuple[str, ...]:
        """The submodules every layer must have."""
        b = self.block
        paths = [b.ln1, b.attn, b.o_proj, b.ln2, b.mlp, b.ln1_post, b.ln2_post, b.mlp_residual]
        paths += [self.fused_qkv] if self.fused_qkv is not None else [*self.qkv]
        paths += [n.module for n in self.qk_norms or ()]
        if isinstance(self.mlp, FusedGateUp):
            paths += [self.mlp.module, self.mlp.out]
        elif self.mlp is not None:
            paths += [self.mlp.pre, self.mlp.pre_linear, self.mlp.out]
        return tuple(p for p in paths if p is not None and p not in self.layer_optional)

    def validate(
        self,
        model: nn.Module,
        missing_in_layer: Optional[Callable[[nn.Module], Iterable[str]]] = None,
        precheck: Optional[Callable[[nn.Module], None]] = None,
    ) -> list[nn.Module]:
        """Refuse a model this description does not fit (class, layout, rope type, attention implementation, head
        shapes); the decoder layers otherwise. ``missing_in_layer`` adds the plugin's own per-layer checks,
        ``precheck`` a check right after the class check."""
        if self.packages is not None:
            require_transformers_class(model, self.family, self.packages)
        if precheck is not None:
            precheck(model)
        layers = require_modules(
            model,
            self.base(model),
            self.family,
            ("embed_tokens", "norm") if self.rotary_input else ("embed_tokens", "norm", "rotary_emb"),
            self.layer_paths(),
            missing_in_layer=missing_in_layer,
        )
        require_rope_types(self.rope_types_of(model), self.rope_types, self.family)
        config = text_config(model)
        if self.attention is not None:
            require_attention_implementation(config, self.attention, self.family)
        if self.fused_qkv is not None:
            require_fused_head_shapes(config, layers[0].get_submodule(self.fused_qkv))
        else:
            require_head_shapes(config, layers[0].get_submodule(self.qkv[0]))
        return layers

    def rotary_dim(self, config: Any) -> int:
        """The rotated dimensions of a head (all of them, or ``partial_rotary_factor`` of them)."""
        return int(head_dim(config) * partial_rotary_factor(config)) if self.partial_rotary else head_dim(config)

    def hooked_config(self, model: nn.Module, extra: Optional[dict] = None, **fields: Any) -> HookedConfig:
        """``hm.cfg``: the fields every such family shares (rotary, RMS, gated MLP, the config's sizes), then
        ``fields``; ``extra`` holds ``rope_theta`` and ``rope_type`` (``rope_types``, every rotary module's, with
        ``rotary_input``), ``tie_word_embeddings`` and ``extra``. Sizes are read from the text config."""
        c = text_config(model)
        # each read only where ``fields`` does not give the value (a LayerNorm family has no rms_norm_eps)
        readers: dict[str, Callable[[], Any]] = dict(
            act_fn=lambda: c.hidden_act,
            normalization_type=lambda: "RMS",
            positional_embedding_type=lambda: "rotary",
            model_type=lambda: self.model_type,
            n_key_value_heads=lambda: n_kv_heads(c),
            rotary_dim=lambda: self.rotary_dim(c),
            gated_mlp=lambda: True,
            eps=lambda: c.rms_norm_eps,
            original_architecture=lambda: type(model).__name__,
        )
        shared = {name: read() for name, read in readers.items() if name not in fields}
        if self.rotary_input:
            rope: dict[str, Any] = {"rope_types": self.rope_types_of(model)}
        else:
            rope = {"rope_theta": rope_theta(c), "rope_type": self.rope_type(model)}
        if self.scaled_embeddings:
            rope["embed_scale"] = float(c.hidden_size) ** 0.5
        described = {
            **rope,
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
            **(extra or {}),
        }
        return HookedConfig(**config_sizes(c, **shared, **fields), extra=described)

    def dense_mlp(self) -> Union[MLPLayout, FusedGateUp]:
        """The dense MLP description (for ``lensadapters_mlp_act``); a family without one describes its MLP itself."""
        if self.mlp is None:
            raise TypeError(f"{self.family} describes its MLP itself (mlp=None)")
        return self.mlp

    def embed(self, model: nn.Module) -> ModelLayout:
        base = self.base(model)
        if self.scaled_embeddings:
            module = model.get_submodule(join(base, "embed_tokens"))
            scale = {
                "embed_scale": float(text_config(model).hidden_size) ** 0.5,
                "embed_scale_after_module": not hasattr(module, "embed_scale"),
            }
        else:
            scale = {}
        return ModelLayout(
            blocks=join(base, "layers"),
            embed=join(base, "embed_tokens"),
            ln_final=join(base, "norm"),
            rotary=None if self.rotary_input else join(base, "rotary_emb"),
            unembed=unembed_path(model),
            rotary_input=self.rotary_input,
            **scale,
        )

    def attn_qkv(self, model: nn.Module) -> Union[SeparateQKV, FusedQKV]:
        c = text_config(model)
        sections = rope_parameters(c).get("mrope_section") if self.multimodal_rotary else None
        if sections:
            rotary = sectioned_rotate_half_spec(sections, self.rotary_dim(c))
        else:
            rotary = self.rotary(self.rotary_dim(c))
        if self.fused_qkv is not None:
            split, merge = fused_qkv_split(c.num_attention_heads, n_kv_heads(c), head_dim(c))
            return FusedQKV(self.fused_qkv, split, merge, rotary=rotary)
        q_norm, k_norm = self.qk_norms or (None, None)
        after = self.qk_norms_after_projections
        return SeparateQKV(*self.qkv, rotary=rotary, q_norm=q_norm, k_norm=k_norm, norms_after_projections=after)

    def norm_spec(self, module: nn.Module) -> Optional[NormSpec]:
        return norm_spec_for(module, self.norms, self.norm_weight_offset)


def _no_fields(model: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class DecoderPlugin:
    """A plugin declared from a :class:`DecoderFamily`: the adapter hooks (architectures, validate, config, embed,
    block, attn_qkv, mlp_act, norm_scale, tiny_config) are derived from the family, and the fields say what the
    family adds. A plugin module declares itself and puts the hooks in its own namespace, so the entry point naming
    the module registers them (pluggy also registers a ``DecoderPlugin`` object directly)::

        FAMILY = hf.DecoderFamily("Mistral", model_type="mistral", packages=("mistral",), norms=("MistralRMSNorm",))
        hf.DecoderPlugin(ARCH, FAMILY, tiny_config, config=window_fields).export(globals())
    """

    arch: Architecture
    family: DecoderFamily
    tiny_config: Callable[[int], Any]
    """The toy config of a seed (``lensadapters_tiny_config``)."""
    config: Callable[[Any], dict[str, Any]] = _no_fields
    """``HookedConfig`` fields (and ``extra``) of a model beyond the family's shared ones."""
    check: Optional[Callable[[Any], None]] = None
    """A wrap-time check after the family's own (raises ``UnsupportedModelError``)."""
    missing_in_layer: Optional[Callable[[nn.Module], Iterable[str]]] = None
    """Per-layer paths the family's layout does not list (see :meth:`DecoderFamily.validate`)."""
    embed: Optional[Callable[[Any, ModelLayout], ModelLayout]] = None
    """Changes the family's ``ModelLayout`` of a model (embedding scale...)."""
    block: Optional[Callable[[Any, int], BlockLayout]] = None
    """A layer's block layout when it is not the family's ``block``."""
    attn_qkv: Optional[Callable[[Any, int], QKVLayout]] = None
    """A layer's attention projections when they are not the family's."""
    mlp: Optional[Callable[[Any, int], Any]] = None
    """A layer's MLP when the family has none (``mlp=None``: mixtures of experts) or it varies by layer."""
    layer_mlp: Optional[Callable[[nn.Module, Any], Any]] = None
    """In place of ``mlp``: a layer's MLP from that decoder layer and the model's config (a mixture of experts'
    ``MoELayout`` of the layer)."""
    precheck: Optional[Callable[[Any], None]] = None
    """A wrap-time check before the family's own, after the class check (a model the family's paths would
    misread: a multimodal model around the text model...)."""
    latent_attention: Optional[Callable[[Any, int], Optional[LatentAttention]]] = None
    """A layer's multi-head latent attention (``None`` for a layer without): its projections (unless ``attn_qkv``
    says otherwise), its latent points and sites, and the refusal of ``W_K``/``W_V`` (:mod:`.latent_attention`)."""

    @hookimpl
    def lensadapters_architectures(self) -> list[Architecture]:
        return [self.arch]

    @hookimpl
    def lensadapters_validate(self, arch: Architecture, model: nn.Module) -> None:
        self.family.validate(model, missing_in_layer=self.missing_in_layer, precheck=self.precheck)
        if self.check is not None:
            self.check(model)

    @hookimpl
    def lensadapters_config(self, arch: Architecture, model: nn.Module) -> HookedConfig:
        return self.family.hooked_config(model, **self.config(model))

    @hookimpl
    def lensadapters_embed(self, arch: Architecture, model: nn.Module) -> ModelLayout:
        layout = self.family.embed(model)
        return layout if self.embed is None else self.embed(model, layout)

    @hookimpl
    def lensadapters_block(self, arch: Architecture, model: nn.Module, layer: int) -> BlockLayout:
        return self.family.block if self.block is None else self.block(model, layer)

    @hookimpl
    def lensadapters_attn_qkv(self, arch: Architecture, model: nn.Module, layer: int) -> QKVLayout:
        if self.attn_qkv is not None:
            return self.attn_qkv(model, layer)
        form = self.latent_attention(model, layer) if self.latent_attention is not None else None
        return self.family.attn_qkv(model) if form is None else form.qkv()

    @hookimpl
    def lensadapters_extra_sites(self, arch: Architecture, hooked: Any) -> list[Site]:
        return latent_sites(hooked)  # exported only with latent_attention (see hooks())

    @hookimpl
    def lensadapters_weight(self, arch: Architecture, hooked: Any, name: str) -> Optional[Tensor]:
        why = refused_weight(hooked, name)  # exported only with latent_attention (see hooks())
        if why is not None:
            raise WeightUnavailableError(why)
        return None

    @hookimpl
    def lensadapters_mlp_act(self, arch: Architecture, model: nn.Module, layer: int) -> Any:
        if self.layer_mlp is not None:
            return self.layer_mlp(self.family.layers(model)[layer], text_config(model))
        return self.family.dense_mlp() if self.mlp is None else self.mlp(model, layer)

    @hookimpl
    def lensadapters_norm_scale(self, arch: Architecture, module: nn.Module) -> Optional[NormSpec]:
        return self.family.norm_spec(module)

    @hookimpl
    def lensadapters_tiny_config(self, arch: Architecture, seed: int) -> Any:
        return self.tiny_config(seed)

    def hooks(self) -> dict[str, Any]:
        """The hook implementations by name (``lensadapters_norm_scale`` only when the family names its norms:
        other RMSNorms are left to the core's checked fallback)."""
        names = [n for n in dir(type(self)) if n.startswith("lensadapters_")]
        if self.latent_attention is None:
            names = [n for n in names if n not in _LATENT_HOOKS]
        return {n: getattr(self, n) for n in names if n != "lensadapters_norm_scale" or self.family.norms}

    def export(self, namespace: dict[str, Any]) -> DecoderPlugin:
        """Puts :meth:`hooks` in a plugin module's namespace (``globals()``); returns the declaration. The module
        also gets, unless it sets them itself, ``LENSADAPTERS_HOOKSPEC`` (the hooks are the core's, so the core's
        major version) and, when the plugin is a package with a ``testing`` module, ``LENSADAPTERS_CONTRACT =
        "<package>.testing:<family>Contract"`` (the contract suite ``lensadapters check`` runs)."""
        namespace.update(self.hooks())
        namespace.setdefault("LENSADAPTERS_HOOKSPEC", HOOKSPEC_VERSION.split(".")[0])
        package = namespace.get("__name__")
        if package and "LENSADAPTERS_CONTRACT" not in namespace and _has_module(f"{package}.testing"):
            namespace["LENSADAPTERS_CONTRACT"] = f"{package}.testing:{self.family.family}Contract"
        return self


#: the hooks a :class:`DecoderPlugin` exports only when it declares a latent attention
_LATENT_HOOKS = ("lensadapters_extra_sites", "lensadapters_weight")


def _has_module(name: str) -> bool:
    """Whether ``name`` can be imported (without importing it; its package is, or is being, imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
