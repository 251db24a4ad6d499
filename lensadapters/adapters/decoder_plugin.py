"""A plugin declared from a :class:`lensadapters.hf.DecoderFamily`: :class:`DecoderPlugin` derives the adapter hooks
of a Llama-shaped family from its description plus the family's quirks, and :func:`toy_config` builds the toy models
such plugins answer ``lensadapters_tiny_config`` with. Both are exported by :mod:`lensadapters.hf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol

from torch import nn

from lensadapters.adapters.hookspecs import hookimpl
from lensadapters.hooks.specs import Architecture, BlockLayout, HookedConfig, ModelLayout, NormSpec, QKVLayout


class DecoderFamily(Protocol):
    """What a :class:`DecoderPlugin` reads of its family: the members of :class:`lensadapters.hf.DecoderFamily`
    (a protocol here, so this module does not import the description module that re-exports it)."""

    @property
    def norms(self) -> tuple[str, ...]: ...

    @property
    def block(self) -> BlockLayout: ...

    def validate(
        self, model: nn.Module, missing_in_layer: Optional[Callable[[nn.Module], Iterable[str]]] = None
    ) -> list[nn.Module]: ...

    def hooked_config(self, model: nn.Module, extra: Optional[dict] = None, **fields: Any) -> HookedConfig: ...

    def embed(self, model: nn.Module) -> ModelLayout: ...

    def attn_qkv(self, model: nn.Module) -> QKVLayout: ...

    def dense_mlp(self) -> Any: ...

    def norm_spec(self, module: nn.Module) -> Optional[NormSpec]: ...


__all__ = ["DecoderPlugin", "toy_config"]


def toy_config(config_class: Callable[..., Any], layers: int, heads: int, kv_heads: int, **fields: Any) -> Any:
    """A toy config of a Llama-shaped family for ``lensadapters_tiny_config``: width 64, MLP width 128, vocabulary
    512, 128 positions, bos 1, eos 2, pad 0, then the family's ``fields`` (which may replace any of those)."""
    shared = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=512,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return config_class(**{**shared, **fields})


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

    @hookimpl
    def lensadapters_architectures(self) -> list[Architecture]:
        return [self.arch]

    @hookimpl
    def lensadapters_validate(self, arch: Architecture, model: nn.Module) -> None:
        self.family.validate(model, missing_in_layer=self.missing_in_layer)
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
        """Puts :meth:`hooks` in a plugin module's namespace (``globals()``); returns the declaration."""
        namespace.update(self.hooks())
        return self
