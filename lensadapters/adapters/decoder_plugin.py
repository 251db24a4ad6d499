"""The declarative description of a Llama-shaped decoder family and the plugin derived from it:
:class:`DecoderFamily` (what a family changes of the common shape), :class:`DecoderPlugin` (the adapter hooks of a
family, derived from its description plus its quirks) and :func:`toy_config` (the toy models such plugins answer
``lensadapters_tiny_config`` with). All three are exported by :mod:`lensadapters.hf`; import them from there.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from torch import nn

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
    rope_theta,
    rope_type,
    size_fields,
    text_config,
    unembed_path,
)
from lensadapters.adapters.hookspecs import HOOKSPEC_VERSION, hookimpl
from lensadapters.hooks.rotary import rotate_half_spec
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


def claims(*archs: Architecture) -> Callable[[], list[Architecture]]:
    """A plugin module's ``lensadapters_architectures`` hook, answering ``archs``:
    ``lensadapters_architectures = hf.claims(ARCH)``."""

    @hookimpl
    def lensadapters_architectures() -> list[Architecture]:
        return list(archs)

    return lensadapters_architectures


def opaque_blocks() -> tuple[Callable[..., None], Callable[..., None], Callable[..., None]]:
    """The block, attention and MLP hooks of a plugin that serves every point of its blocks itself (in
    ``lensadapters_extra_sites``: encoder-decoders with their own names), answering ``None`` for every layer:
    ``lensadapters_block, lensadapters_attn_qkv, lensadapters_mlp_act = hf.opaque_blocks()``."""

    @hookimpl
    def lensadapters_block(arch: Architecture, model: Any, layer: int) -> None:
        return None  # opaque: the points are the plugin's own

    @hookimpl
    def lensadapters_attn_qkv(arch: Architecture, model: Any, layer: int) -> None:
        return None  # never asked: every block is opaque

    @hookimpl
    def lensadapters_mlp_act(arch: Architecture, model: Any, layer: int) -> None:
        return None  # never asked: every block is opaque

    return lensadapters_block, lensadapters_attn_qkv, lensadapters_mlp_act


class PointChain:
    """Creates a plugin's points in firing order, each after the previous one (``after`` the name to start after),
    and a norm's ``hook_scale``/``hook_normalized`` with its ``NormSite`` (the norm registered under ``prefix``)."""

    def __init__(self, hooked: Any, after: Optional[str]) -> None:
        self.hooked, self.last = hooked, after

    def new(self, name: str) -> Any:
        point = self.hooked.new_point(name, after=self.last)
        self.last = name
        return point

    def norm(self, module: nn.Module, prefix: str) -> Any:
        from lensadapters.hooks.sites.norm import NormSite

        scale, normalized = self.new(f"{prefix}.hook_scale"), self.new(f"{prefix}.hook_normalized")
        self.hooked.register_norm(prefix, module)
        return NormSite(module, lambda: self.hooked.norm_spec(module), scale, normalized)


LayerValue = Union[Any, Callable[[Any, int], Any]]
"""A layer's description: the same value for every layer, or a function of ``(model, layer)``."""


def layer_hooks(block: LayerValue, qkv: LayerValue, mlp: LayerValue) -> dict[str, Callable[..., Any]]:
    """A plugin module's ``lensadapters_block``, ``lensadapters_attn_qkv`` and ``lensadapters_mlp_act``, answering
    ``block`` (a ``BlockLayout``), ``qkv`` (a ``QKVLayout``) and ``mlp`` (an ``MLPLayout``...), each the same for
    every layer or a function of ``(model, layer)``: ``globals().update(hf.layer_hooks(BLOCK, qkv_of, MLP))``."""

    def answer(value: LayerValue, model: Any, layer: int) -> Any:
        return value(model, layer) if callable(value) else value

    @hookimpl
    def lensadapters_block(arch: Architecture, model: nn.Module, layer: int) -> BlockLayout:
        return answer(block, model, layer)

    @hookimpl
    def lensadapters_attn_qkv(arch: Architecture, model: nn.Module, layer: int) -> QKVLayout:
        return answer(qkv, model, layer)

    @hookimpl
    def lensadapters_mlp_act(arch: Architecture, model: nn.Module, layer: int) -> Any:
        return answer(mlp, model, layer)

    return {f.__name__: f for f in (lensadapters_block, lensadapters_attn_qkv, lensadapters_mlp_act)}


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
        rotary = self.rotary(self.rotary_dim(c))
        if self.fused_qkv is not None:
            split, merge = fused_qkv_split(c.num_attention_heads, n_kv_heads(c), head_dim(c))
            return FusedQKV(self.fused_qkv, split, merge, rotary=rotary)
        q_norm, k_norm = self.qk_norms or (None, None)
        after = self.qk_norms_after_projections
        return SeparateQKV(*self.qkv, rotary=rotary, q_norm=q_norm, k_norm=k_norm, norms_after_projections=after)

    def norm_spec(self, module: nn.Module) -> Optional[NormSpec]:
        return norm_spec_for(module, self.norms, self.norm_weight_offset)


def toy_draw(seed: int, demo: Sequence[Any], *choices: Any) -> tuple[Any, ...]:
    """The values a toy config varies: ``demo`` for seed 0 (the demo's model); for another seed one draw per
    choice, in order, from ``random.Random(seed)``: a list draws one of its items, a float ``p`` is true with
    probability ``p``, a callable is called with the generator and the values drawn before it."""
    if seed == 0:
        return tuple(demo)
    rng = random.Random(seed)
    drawn: list[Any] = []
    for choice in choices:
        if isinstance(choice, float):
            drawn.append(rng.random() < choice)
        elif callable(choice):
            drawn.append(choice(rng, *drawn))
        else:
            drawn.append(rng.choice(choice))
    return tuple(drawn)


def sliding_layers(layers: int, full_every: int, last_full: bool = False) -> list[str]:
    """A config's ``layer_types`` with every ``full_every``-th layer (and, ``last_full``, the last one)
    ``"full_attention"`` and the others ``"sliding_attention"``."""
    full = [(i + 1) % full_every == 0 or (last_full and i == layers - 1) for i in range(layers)]
    return ["full_attention" if f else "sliding_attention" for f in full]


def _sized_config(
    config_class: Callable[..., Any],
    sizes: tuple[int, int, int, int, int, int, int],
    fields: dict[str, Any],
) -> Any:
    """``config_class`` of ``sizes`` (width, MLP width, layers, heads, key/value heads, vocabulary, positions), bos
    1, eos 2, pad 0, then ``fields`` (which may replace any of those)."""
    named = size_fields(**dict(zip(("hidden", "d_mlp", "layers", "heads", "kv_heads", "vocab", "positions"), sizes)))
    return config_class(**{**named, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **fields})


def toy_config(config_class: Callable[..., Any], layers: int, heads: int, kv_heads: int, **fields: Any) -> Any:
    """A toy config of a Llama-shaped family for ``lensadapters_tiny_config``: width 64, MLP width 128, vocabulary
    512, 128 positions, bos 1, eos 2, pad 0, then the family's ``fields`` (which may replace any of those)."""
    return _sized_config(config_class, (64, 128, layers, heads, kv_heads, 512, 128), fields)


def decoder_config(
    config_class: Callable[..., Any],
    *,
    n_heads: int = 4,
    n_kv: int = 2,
    hidden: int = 32,
    layers: int = 1,
    d_mlp: int = 32,
    vocab: int = 64,
    theta: float = 10000.0,
    tied: bool = False,
    eps: float = 1e-6,
    act: str = "silu",
    act_field: str = "hidden_act",
    max_pos: int = 64,
    **fields: Any,
) -> Any:
    """A tiny config of a Llama-shaped family (bos 1, eos 2, pad 0, no attention dropout): the shared fields, then
    the family's own ``fields`` (transformers' names: ``head_dim=8``, ``sliding_window=3``..., which may replace
    shared ones such as ``bos_token_id``); the activation under the config's name for it, ``act_field``."""
    shared = dict(rms_norm_eps=eps, tie_word_embeddings=tied, rope_theta=theta, attention_dropout=0.0)
    sizes = (hidden, d_mlp, layers, n_heads, n_kv, vocab, max_pos)
    return _sized_config(config_class, sizes, {**shared, act_field: act, **fields})


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
        return self.family.attn_qkv(model) if self.attn_qkv is None else self.attn_qkv(model, layer)

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


def _has_module(name: str) -> bool:
    """Whether ``name`` can be imported (without importing it; its package is, or is being, imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
