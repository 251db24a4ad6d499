"""Helpers for plugins of transformers' decoder-only models (``<Family>ForCausalLM`` → ``<Family>Model`` with
``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``): finding the pieces, reading rope parameters in
transformers 4.x and 5.x spellings, and the checks that refuse a model a plugin cannot describe.

Exported by :mod:`lensadapters.hf` (with :mod:`lensadapters.adapters.decoder_plugin`'s declarations, which put
them together); import them from there.

Nothing here names an architecture: plugins pass their own class names, paths and supported values.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from lensadapters.adapters.vlm import class_to_check, text_config
from lensadapters.errors import UnsupportedModelError
from lensadapters.hooks.specs import Architecture, BlockLayout, MLPLayout, NormSpec

Tensor = torch.Tensor

__all__ = [
    "TRANSFORMERS_TESTED",
    "architecture",
    "config_sizes",
    "size_fields",
    "without_dropout",
    "router_fields",
    "base_path",
    "base_prefix",
    "base_model",
    "join",
    "unembed_path",
    "rope_parameters",
    "rope_theta",
    "rope_type",
    "rope_types",
    "layer_config",
    "head_dim",
    "n_kv_heads",
    "layer_windows",
    "window_fields",
    "missing_paths",
    "missing_expert_paths",
    "require_transformers_class",
    "require_modules",
    "require_rope_types",
    "require_attention_implementation",
    "require_head_shapes",
    "attention_implementation",
    "norm_spec_for",
    "ROTATE_HALF_ROPE_TYPES",
    "DECODER_BLOCK",
    "DECODER_QKV",
    "SWIGLU_MLP",
    "SANDWICH_BLOCK",
    "text_config",
    "partial_rotary_factor",
    "fused_qkv_split",
    "require_fused_head_shapes",
]

TRANSFORMERS_TESTED = ">=4.57,<6"
"""The transformers range :func:`architecture` declares unless told another."""
ROTATE_HALF_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
"""transformers' rope types whose rotation is rotate-half RoPE on the rotary module's ``(cos, sin)``."""
DECODER_BLOCK = BlockLayout(
    ln1="input_layernorm", attn="self_attn", o_proj="self_attn.o_proj", ln2="post_attention_layernorm", mlp="mlp"
)
DECODER_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
SANDWICH_BLOCK = BlockLayout(
    ln1="input_layernorm",
    attn="self_attn",
    o_proj="self_attn.o_proj",
    ln2="pre_feedforward_layernorm",
    mlp="mlp",
    ln1_post="post_attention_layernorm",
    ln2_post="post_feedforward_layernorm",
)
"""A block normed before and after attention and before and after the MLP (the post norms' outputs are added to
the residual stream)."""
SWIGLU_MLP = MLPLayout(pre="mlp.gate_proj", out="mlp.down_proj", pre_linear="mlp.up_proj")

_ATTN_PREFIX = "lensadapters:"


def architecture(
    model_type: str,
    description: str,
    *,
    name: Optional[str] = None,
    model_types: Optional[tuple[str, ...]] = None,
    transformers: str = TRANSFORMERS_TESTED,
    vision_language: bool = False,
    encoder_decoder: bool = False,
) -> Architecture:
    """The :class:`Architecture` a plugin claims: named after ``model_type`` and claiming it unless
    ``name``/``model_types`` say otherwise, tested with ``transformers``; ``vision_language``: also the language
    model of a vision-language model, ``encoder_decoder``: an encoder-decoder (see :class:`Architecture`)."""
    return Architecture(
        name=name or model_type,
        model_types=model_types or (model_type,),
        description=description,
        transformers=transformers,
        vision_language=vision_language,
        encoder_decoder=encoder_decoder,
    )


def config_sizes(config: Any, **fields: Any) -> dict[str, Any]:
    """``HookedConfig``'s sizes (``n_layers``, ``d_model``, ``n_heads``, ``d_head``, ``d_mlp``, ``d_vocab``,
    ``n_ctx``) read from a transformers config under transformers' usual names, each only where ``fields`` does not
    give it (a config that names its MLP width otherwise passes ``d_mlp``), then ``fields``."""
    readers: dict[str, Callable[[], Any]] = dict(
        n_layers=lambda: config.num_hidden_layers,
        d_model=lambda: config.hidden_size,
        n_heads=lambda: config.num_attention_heads,
        d_head=lambda: head_dim(config),
        d_mlp=lambda: config.intermediate_size,
        d_vocab=lambda: config.vocab_size,
        n_ctx=lambda: config.max_position_embeddings,
    )
    return {**{n: read() for n, read in readers.items() if n not in fields}, **fields}


_SIZE_FIELDS = {
    "hidden": "hidden_size",
    "d_mlp": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "vocab": "vocab_size",
    "positions": "max_position_embeddings",
}


def size_fields(**sizes: int) -> dict[str, Any]:
    """A config's sizes under transformers' usual keyword names, given by short ones: ``hidden`` (``hidden_size``),
    ``d_mlp`` (``intermediate_size``), ``layers`` (``num_hidden_layers``), ``heads`` (``num_attention_heads``),
    ``kv_heads`` (``num_key_value_heads``), ``vocab`` (``vocab_size``), ``positions``
    (``max_position_embeddings``); only those given."""
    unknown = sorted(set(sizes) - set(_SIZE_FIELDS))
    if unknown:
        raise TypeError(f"size_fields() knows no size {', '.join(unknown)} (it knows {', '.join(_SIZE_FIELDS)})")
    return {_SIZE_FIELDS[name]: value for name, value in sizes.items()}


def without_dropout(config_class: Callable[..., Any], **fields: Any) -> Any:
    """``config_class(**fields)`` with every dropout probability of the model body (a float field named
    ``*dropout``, ``*dropout_prob`` or ``*pdrop``; not a task head's ``classifier_*``/``summary_*``) zero where
    ``fields`` does not set it: a toy config whose hook points read the same in train and eval mode, whatever its
    family calls them."""
    defaults = config_class().to_dict().items()
    rates = {n: 0.0 for n, v in defaults if isinstance(v, float) and n.endswith(_DROPOUT) and not n.startswith(_HEAD)}
    return config_class(**{**rates, **fields})


def router_fields(config_class: Callable[..., Any], experts: int, top_k: int) -> dict[str, Any]:
    """A mixture of experts' toy config fields: ``experts`` experts (under the name ``config_class`` gives their
    number: ``num_experts``, ``num_local_experts`` or ``n_routed_experts``), ``top_k`` of them per token, and no
    router logits among the outputs."""
    names = config_class().to_dict()
    count = next((n for n in _EXPERT_COUNTS if n in names), None)
    if count is None:
        raise TypeError(f"{config_class.__name__} has no number of experts ({', '.join(_EXPERT_COUNTS)})")
    return {count: experts, "num_experts_per_tok": top_k, "output_router_logits": False}


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
_DROPOUT, _HEAD = ("dropout", "pdrop", "dropout_prob"), ("classifier_", "summary_")


def join(prefix: str, name: str) -> str:
    """``prefix.name`` (just ``name`` at the root)."""
    return f"{prefix}.{name}" if prefix else name


def base_path(model: nn.Module, family: str, attributes: Sequence[str] = ("embed_tokens", "layers")) -> str:
    """Dotted path of the decoder stack inside ``model`` (the first submodule with all ``attributes``)."""
    for name, module in model.named_modules():
        if all(hasattr(module, a) for a in attributes):
            return name
    raise UnsupportedModelError(
        f"{type(model).__name__} has model_type {model.config.model_type!r} but no submodule with "
        f"{' and '.join(f'`{a}`' for a in attributes)}; the {family} plugin supports transformers' own {family} "
        f"classes ({family}ForCausalLM, {family}Model)"
    )


def base_prefix(model: nn.Module) -> str:
    """The path of the base model inside ``model`` (its ``base_model_prefix`` child, as transformers' heads hold
    it), with a trailing dot; ``""`` when ``model`` is the base model itself."""
    name = getattr(model, "base_model_prefix", "")
    return f"{name}." if name and isinstance(getattr(model, name, None), nn.Module) else ""


def base_model(model: nn.Module) -> Any:
    """The base model inside ``model`` (:func:`base_prefix`), or ``model`` itself."""
    prefix = base_prefix(model)
    return model.get_submodule(prefix[:-1]) if prefix else model


def unembed_path(model: nn.Module) -> Optional[str]:
    """Path of the output embeddings (language-model head), or ``None`` (a bare ``*Model``)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None
    for name, module in model.named_modules():
        if module is head:
            return name
    return None


def rope_parameters(config: Any, layer_type: Optional[str] = None) -> dict:
    """The rope parameters as one dict (``rope_type``, ``rope_theta``, scaling keys...), from transformers 5.x
    ``rope_parameters`` (per layer type when ``layer_type`` is given and the dict is nested) or 4.x
    ``rope_theta``/``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        out = dict(params)
        out.setdefault("rope_type", out.get("type", "default"))
        return out
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    theta = getattr(config, "rope_theta", None)
    if theta is not None:
        scaling.setdefault("rope_theta", theta)
    return scaling


def rope_theta(config: Any, layer_type: Optional[str] = None) -> Optional[float]:
    theta = rope_parameters(config, layer_type).get("rope_theta")
    return float(theta) if theta is not None else None


def rope_type(rotary: nn.Module) -> str:
    """The rope type a transformers rotary-embedding module computes (``"default"`` when it does not say)."""
    return str(getattr(rotary, "rope_type", "default"))


def partial_rotary_factor(config: Any) -> float:
    """The fraction of each head's dimensions that rotate (``partial_rotary_factor`` of the rope parameters or the
    config; 1.0 when neither sets it)."""
    factor = rope_parameters(config).get("partial_rotary_factor")
    return float(factor if factor is not None else getattr(config, "partial_rotary_factor", 1.0) or 1.0)


def fused_qkv_split(
    n_heads: int, n_kv: int, d_head: int
) -> tuple[Callable[[Tensor], tuple[Tensor, Tensor, Tensor]], Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """``(split, merge)`` of ``[q | k | v]`` along the last dimension, each part viewed as ``[heads, d_head]``."""
    q_width, kv_width = n_heads * d_head, n_kv * d_head

    def split(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = t.split([q_width, kv_width, kv_width], dim=-1)
        return q.unflatten(-1, (n_heads, d_head)), k.unflatten(-1, (n_kv, d_head)), v.unflatten(-1, (n_kv, d_head))

    def merge(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)

    return split, merge


def rope_types(rotary: nn.Module) -> list[str]:
    """Every rope type a rotary-embedding module computes: one, or one per layer type where the module holds a
    ``{layer_type: rope_type}`` mapping (one module called once per layer type)."""
    kind = getattr(rotary, "rope_type", "default")
    return [str(k) for k in kind.values()] if isinstance(kind, dict) else [str(kind)]


def layer_config(config: Any, layer: int = 0) -> Any:
    """The config of one layer: ``config.per_layer_config[layer]`` where the config varies by layer (transformers'
    heterogeneous configs, whose per-layer attributes refuse to be read from the whole config), else ``config``."""
    per_layer = getattr(config, "per_layer_config", None)
    return config if per_layer is None else per_layer[layer]


def head_dim(config: Any, layer: int = 0) -> int:
    """The head size (of layer ``layer`` where it varies by layer)."""
    c = layer_config(config, layer)
    return getattr(c, "head_dim", None) or config.hidden_size // config.num_attention_heads


def n_kv_heads(config: Any, layer: int = 0) -> int:
    """The number of key/value heads (of layer ``layer`` where it varies by layer)."""
    return getattr(layer_config(config, layer), "num_key_value_heads", None) or config.num_attention_heads


def layer_windows(config: Any) -> list[Optional[int]]:
    """Each layer's sliding window (``None`` for full attention), from ``config.layer_types``."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [window if t == "sliding_attention" and window else None for t in types]


def window_fields(windows: Sequence[Optional[int]]) -> dict[str, Any]:
    """``HookedConfig``'s ``window_size`` (the first window) and ``attn_types`` (TransformerLens' ``"local"``/
    ``"global"`` per layer, ``None`` when no layer is windowed) for per-layer ``windows``."""
    windowed = any(w is not None for w in windows)
    return {
        "window_size": next((w for w in windows if w is not None), None),
        "attn_types": tuple("local" if w else "global" for w in windows) if windowed else None,
    }


def missing_paths(module: nn.Module, paths: Iterable[str], prefix: str = "") -> list[str]:
    """The ``paths`` (each ``prefix + path``) that are not submodules of ``module``."""
    missing = []
    for path in paths:
        try:
            module.get_submodule(path)
        except AttributeError:
            missing.append(prefix + path)
    return missing


def missing_expert_paths(layer: nn.Module, moe: str, projections: Sequence[str]) -> list[str]:
    """What the mixture of experts at ``moe`` (a path in ``layer``) lacks: its ``gate`` and ``experts``, then each
    expert's ``projections`` and ``act_fn`` (an ``nn.ModuleList`` of experts) or, for transformers 5's fused
    experts (under any adapter wrapping them), ``gate_up_proj``, ``down_proj`` and ``act_fn``."""
    from .layers import innermost_layer  # the registry's adapter wrappers (imported here: it needs the registry)

    missing = missing_paths(layer, (f"{moe}.gate", f"{moe}.experts"))
    if missing:
        return missing
    experts = layer.get_submodule(f"{moe}.experts")
    if isinstance(experts, nn.ModuleList):
        needed = (*projections, "act_fn")
        return [f"{moe}.experts.{e}.{p}" for e, expert in enumerate(experts) for p in needed if not hasattr(expert, p)]
    experts = innermost_layer(experts)
    return [f"{moe}.experts.{p}" for p in ("gate_up_proj", "down_proj", "act_fn") if not hasattr(experts, p)]


def require_transformers_class(model: nn.Module, family: str, packages: Iterable[str]) -> None:
    """Refuse a model whose classes are not transformers' own ``transformers.models.<package>`` ones: custom code
    registered under the same ``model_type`` (``trust_remote_code=True``) may compute something else. Of a
    vision-language model, its own class must be transformers' and its language model's class the family's."""
    allowed = tuple(f"transformers.models.{p}." for p in packages)
    where, inner = type(model).__module__, type(class_to_check(model)).__module__
    if not inner.startswith(allowed) or not where.startswith("transformers.models."):
        raise UnsupportedModelError(
            f"{type(model).__name__} (from {where}) has model_type {model.config.model_type!r} but is not "
            f"transformers' own {family} class: custom modeling code registered under the same model_type "
            f"(trust_remote_code=True) may compute something the {family} plugin does not describe. Load the "
            f"checkpoint with transformers' implementation (trust_remote_code=False; transformers has {family} "
            f"built in)"
        )


def require_modules(
    model: nn.Module,
    base: str,
    family: str,
    model_paths: Sequence[str],
    layer_paths: Sequence[Optional[str]],
    layers: str = "layers",
    missing_in_layer: Optional[Callable[[nn.Module], Iterable[str]]] = None,
) -> list[nn.Module]:
    """The decoder layers; refuse a model missing any of ``model_paths`` (relative to ``base``) or, in any
    layer, ``layer_paths`` or what ``missing_in_layer(layer)`` finds missing (paths relative to the layer, for
    layouts that vary by layer or transformers version)."""
    missing = []
    try:
        blocks = list(model.get_submodule(join(base, layers)))
    except AttributeError:
        blocks = []
    for path in model_paths:
        try:
            model.get_submodule(join(base, path))
        except AttributeError:
            missing.append(join(base, path))
    for i, layer in enumerate(blocks):
        for path in layer_paths:
            if path is None:  # a layout field the family leaves unset requires nothing
                continue
            try:
                layer.get_submodule(path)
            except AttributeError:
                missing.append(f"{join(base, layers)}.{i}.{path}")
        if missing_in_layer is not None:
            missing += [f"{join(base, layers)}.{i}.{path}" for path in missing_in_layer(layer)]
    if missing or not blocks:
        raise UnsupportedModelError(
            f"{type(model).__name__} has model_type {model.config.model_type!r} but not transformers' {family} layout "
            f"(missing: {', '.join(missing[:6]) or 'decoder layers'}); the {family} plugin supports transformers' "
            f"{family} classes"
        )
    return blocks


def require_rope_types(found: Iterable[str], supported: Sequence[str], family: str) -> None:
    """Refuse rope types whose rotation is not known to be rotate-half RoPE on the rotary module's (cos, sin)."""
    for rope_type in dict.fromkeys(found):
        if rope_type not in supported:
            raise UnsupportedModelError(
                f"{family} rope type {rope_type!r} is not supported by the {family} plugin (supported: "
                f"{', '.join(supported)}): hook_rot_q/hook_rot_k need a rotation known to be rotate-half RoPE on the "
                f"(cos, sin) the model computes. Every other hook point would work; convert the checkpoint's "
                f"rope_scaling to a supported type or ask for support of {rope_type!r}"
            )


def require_attention_implementation(config: Any, supported: Sequence[str], family: str) -> None:
    """Refuse, at wrap time, an attention implementation outside ``supported`` (for a plugin that refuses more than
    the core, which keeps every hook point but the pattern ones under implementations it cannot read)."""
    impl = attention_implementation(config)
    if impl not in supported:
        raise UnsupportedModelError(
            f"attention implementation {impl!r} is not supported by the {family} plugin (supported: "
            f"{', '.join(supported)}; flash and flex attention are untested and pass masks that hook_pattern cannot "
            f"read). Call model.set_attn_implementation('sdpa') before wrapping"
        )


def require_head_shapes(config: Any, q_proj: nn.Module) -> None:
    """Refuse a config whose query heads are not a multiple of its key/value heads, or whose heads do not match
    ``q_proj``'s output width."""
    n_heads, n_kv = config.num_attention_heads, n_kv_heads(config)
    if n_heads % n_kv:
        raise UnsupportedModelError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    q_out = getattr(q_proj, "out_features", None)
    if isinstance(q_out, int) and q_out != n_heads * head_dim(config):
        raise UnsupportedModelError(
            f"q_proj has {q_out} output features, but the config says {n_heads} heads of size {head_dim(config)}"
        )


def require_fused_head_shapes(config: Any, qkv_proj: nn.Module) -> None:
    """Refuse a config whose query heads are not a multiple of its key/value heads, or whose heads do not match the
    output width of ``qkv_proj`` (one projection computing ``[q | k | v]``)."""
    n_heads, n_kv, d = config.num_attention_heads, n_kv_heads(config), head_dim(config)
    if n_heads % n_kv:
        raise UnsupportedModelError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    out = getattr(qkv_proj, "out_features", None)
    if isinstance(out, int) and out != (n_heads + 2 * n_kv) * d:
        raise UnsupportedModelError(
            f"qkv_proj has {out} output features, but the config says {n_heads} query and {n_kv} key/value heads of "
            f"size {d}"
        )


def attention_implementation(config: Any) -> str:
    """``config._attn_implementation`` without lensadapters' own prefix (``"eager"`` when unset)."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    return impl[len(_ATTN_PREFIX) :] if impl.startswith(_ATTN_PREFIX) else impl


def norm_spec_for(module: nn.Module, class_names: Iterable[str], weight_offset: float = 0.0) -> Optional[NormSpec]:
    """A ``NormSpec("RMS", ...)`` for an RMSNorm module of one of ``class_names`` (``eps`` or ``variance_epsilon``),
    with ``weight_offset`` (1.0 for Gemma-style ``(1 + weight)`` norms); ``None`` for any other module."""
    if type(module).__name__ not in set(class_names):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return NormSpec("RMS", float(eps), getattr(module, "weight", None), weight_offset=weight_offset)
