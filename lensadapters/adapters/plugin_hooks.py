"""Helpers that make a plugin module's adapter hooks from values: :func:`claims` (the architectures it claims),
:func:`hooked_config` (its ``hm.cfg`` from the fields it reads), :func:`model_layout` (its model's parts under the
base model), :func:`layer_hooks` (its block, attention and MLP answers, per layer or for all), :func:`opaque_blocks`
(a plugin serving its blocks' points itself), :func:`own_attention_patterns` (its pattern backend where its attention
is its own code) and :class:`PointChain` (points created in firing order). Exported by :mod:`lensadapters.hf`;
import them from there.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from torch import nn

from lensadapters.adapters.hf_helpers import base_prefix, config_sizes, unembed_path
from lensadapters.adapters.hookspecs import hookimpl
from lensadapters.hooks.specs import Architecture, BlockLayout, HookedConfig, ModelLayout, QKVLayout

__all__ = ["LayerValue", "PointChain", "claims", "layer_hooks", "opaque_blocks", "own_attention_patterns"]
__all__ += ["hooked_config", "model_layout"]


def claims(*archs: Architecture) -> Callable[[], list[Architecture]]:
    """A plugin module's ``lensadapters_architectures`` hook, answering ``archs``:
    ``lensadapters_architectures = hf.claims(ARCH)``."""

    @hookimpl
    def lensadapters_architectures() -> list[Architecture]:
        return list(archs)

    return lensadapters_architectures


def hooked_config(fields: Callable[[Any], dict[str, Any]]) -> Callable[[Architecture, nn.Module], HookedConfig]:
    """A plugin module's ``lensadapters_config`` hook: ``hm.cfg`` with the model's sizes
    (:func:`~lensadapters.adapters.hf_helpers.config_sizes`, each only where ``fields(model)`` does not give it), its
    config's ``model_type``, its class name as ``original_architecture``, then ``fields(model)`` (the family's own:
    activation, norms, positions...): ``lensadapters_config = hf.hooked_config(config_fields)``."""

    @hookimpl
    def lensadapters_config(arch: Architecture, model: nn.Module) -> HookedConfig:
        config: Any = model.config
        shared = {"model_type": config.model_type, "original_architecture": type(model).__name__}
        return HookedConfig(**{**shared, **config_sizes(config, **fields(model))})

    return lensadapters_config


def model_layout(**paths: Any) -> Callable[[Architecture, nn.Module], ModelLayout]:
    """A plugin module's ``lensadapters_embed`` hook for a model whose parts are children of its base model: the
    :class:`~lensadapters.hooks.specs.ModelLayout` of ``paths`` (``blocks="h"``, ``embed="wte"``...), each path
    under the base model's (:func:`~lensadapters.adapters.hf_helpers.base_prefix`: ``transformer.`` in a head model,
    nothing in the base model itself), the unembedding the model's output embeddings
    (:func:`~lensadapters.adapters.hf_helpers.unembed_path`: none in a base model); a value that is not a path
    (``rotary_from_inputs``) as given: ``lensadapters_embed = hf.model_layout(blocks="h", embed="wte")``."""

    @hookimpl
    def lensadapters_embed(arch: Architecture, model: nn.Module) -> ModelLayout:
        prefix = base_prefix(model)
        fields: dict[str, Any] = {name: prefix + v if isinstance(v, str) else v for name, v in paths.items()}
        return ModelLayout(unembed=unembed_path(model), **fields)

    return lensadapters_embed


def own_attention_patterns(
    computes_itself: Callable[[nn.Module], bool], backend: Callable[[Any], Any]
) -> Callable[..., Optional[Any]]:
    """A plugin module's ``lensadapters_attn_pattern`` hook for a family whose attention modules compute attention
    in their own code under some transformers versions (``computes_itself(module)``, asked of the model's first
    attention module): ``backend(hooked)`` there, ``None`` (the core's backend for transformers' attention
    interface) otherwise: ``lensadapters_attn_pattern = hf.own_attention_patterns(_own_attention, MyBackend)``."""

    @hookimpl
    def lensadapters_attn_pattern(arch: Architecture, hooked: Any) -> Optional[Any]:
        modules = [m for m in hooked.attention_modules if m is not None]
        return backend(hooked) if modules and computes_itself(modules[0]) else None

    return lensadapters_attn_pattern


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
