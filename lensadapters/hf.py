"""Helpers for plugins of transformers' decoder-only models (``<Family>ForCausalLM`` → ``<Family>Model`` with
``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``): finding the pieces, reading rope parameters in
transformers 4.x and 5.x spellings, and the checks that refuse a model a plugin cannot describe.

Nothing here names an architecture: plugins pass their own class names, paths and supported values.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from torch import nn

from .errors import UnsupportedModelError

__all__ = [
    "base_path", "join", "unembed_path", "rope_parameters", "rope_theta", "head_dim", "n_kv_heads",
    "require_transformers_class", "require_modules", "require_rope_types", "attention_implementation",
    "norm_spec_for",
]

_ATTN_PREFIX = "lensadapters:"


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
        f"classes ({family}ForCausalLM, {family}Model)")


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


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def n_kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def require_transformers_class(model: nn.Module, family: str, packages: Iterable[str]) -> None:
    """Refuse a model whose classes are not transformers' own ``transformers.models.<package>`` ones: custom code
    registered under the same ``model_type`` (``trust_remote_code=True``) may compute something else."""
    where = type(model).__module__
    allowed = tuple(f"transformers.models.{p}." for p in packages)
    if not where.startswith(allowed):
        raise UnsupportedModelError(
            f"{type(model).__name__} (from {where}) has model_type {model.config.model_type!r} but is not "
            f"transformers' own {family} class: custom modeling code registered under the same model_type "
            f"(trust_remote_code=True) may compute something the {family} plugin does not describe. Load the "
            f"checkpoint with transformers' implementation (trust_remote_code=False; transformers has {family} "
            f"built in)")


def require_modules(model: nn.Module, base: str, family: str, model_paths: Sequence[str],
                    layer_paths: Sequence[Optional[str]], layers: str = "layers") -> list[nn.Module]:
    """The decoder layers; refuse a model missing any of ``model_paths`` (relative to ``base``) or, in any
    layer, ``layer_paths`` (a ``None`` path, a layout field the family leaves unset, requires nothing)."""
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
            if path is None:
                continue
            try:
                layer.get_submodule(path)
            except AttributeError:
                missing.append(f"{join(base, layers)}.{i}.{path}")
    if missing or not blocks:
        raise UnsupportedModelError(
            f"{type(model).__name__} has model_type {model.config.model_type!r} but not transformers' {family} layout "
            f"(missing: {', '.join(missing[:6]) or 'decoder layers'}); the {family} plugin supports transformers' "
            f"{family} classes")
    return blocks


def require_rope_types(found: Iterable[str], supported: Sequence[str], family: str) -> None:
    """Refuse rope types whose rotation is not known to be rotate-half RoPE on the rotary module's (cos, sin)."""
    for rope_type in dict.fromkeys(found):
        if rope_type not in supported:
            raise UnsupportedModelError(
                f"{family} rope type {rope_type!r} is not supported by the {family} plugin (supported: "
                f"{', '.join(supported)}): hook_rot_q/hook_rot_k need a rotation known to be rotate-half RoPE on the "
                f"(cos, sin) the model computes. Every other hook point would work; convert the checkpoint's "
                f"rope_scaling to a supported type or ask for support of {rope_type!r}")


def attention_implementation(config: Any) -> str:
    """``config._attn_implementation`` without lensadapters' own prefix (``"eager"`` when unset)."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    return impl[len(_ATTN_PREFIX):] if impl.startswith(_ATTN_PREFIX) else impl


def norm_spec_for(module: nn.Module, class_names: Iterable[str], weight_offset: float = 0.0) -> Any:
    """A ``NormSpec("RMS", ...)`` for an RMSNorm module of one of ``class_names`` (``eps`` or ``variance_epsilon``),
    with ``weight_offset`` (1.0 for Gemma-style ``(1 + weight)`` norms); ``None`` for any other module."""
    from .specs import NormSpec

    if type(module).__name__ not in set(class_names):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return NormSpec("RMS", float(eps), getattr(module, "weight", None), weight_offset=weight_offset)
