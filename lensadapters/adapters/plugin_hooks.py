"""Helpers that make a plugin module's adapter hooks from values: :func:`claims` (the architectures it claims),
:func:`layer_hooks` (its block, attention and MLP answers, per layer or for all), :func:`opaque_blocks` (a plugin
serving its blocks' points itself) and :class:`PointChain` (points created in firing order). Exported by
:mod:`lensadapters.hf`; import them from there.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from torch import nn

from lensadapters.adapters.hookspecs import hookimpl
from lensadapters.hooks.specs import Architecture, BlockLayout, QKVLayout

__all__ = ["LayerValue", "PointChain", "claims", "layer_hooks", "opaque_blocks"]


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
