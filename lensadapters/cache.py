"""ActivationCache: a mapping of hook names to tensors with TransformerLens' shorthand keys."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Union

import torch

Tensor = torch.Tensor

# short name -> full name template; "{i}" is the layer
_ALIASES = {
    "embed": "hook_embed",
    "pos_embed": "hook_pos_embed",
    "resid_pre": "blocks.{i}.hook_resid_pre",
    "resid_mid": "blocks.{i}.hook_resid_mid",
    "resid_post": "blocks.{i}.hook_resid_post",
    "attn_out": "blocks.{i}.hook_attn_out",
    "mlp_out": "blocks.{i}.hook_mlp_out",
    "mlp_in": "blocks.{i}.hook_mlp_in",
    "q": "blocks.{i}.attn.hook_q",
    "k": "blocks.{i}.attn.hook_k",
    "v": "blocks.{i}.attn.hook_v",
    "rot_q": "blocks.{i}.attn.hook_rot_q",
    "rot_k": "blocks.{i}.attn.hook_rot_k",
    "z": "blocks.{i}.attn.hook_z",
    "result": "blocks.{i}.attn.hook_result",
    "attn_scores": "blocks.{i}.attn.hook_attn_scores",
    "scores": "blocks.{i}.attn.hook_attn_scores",
    "attn": "blocks.{i}.attn.hook_pattern",
    "pattern": "blocks.{i}.attn.hook_pattern",
    "pre": "blocks.{i}.mlp.hook_pre",
    "pre_linear": "blocks.{i}.mlp.hook_pre_linear",
    "post": "blocks.{i}.mlp.hook_post",
}


def _as_int(value: object) -> str:
    try:
        return str(int(value))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return "LAYER"


def get_act_name(name: str, layer: Optional[int] = None, layer_type: Optional[str] = None) -> str:
    """Full hook name from TransformerLens-style shorthand: ``("resid_pre", 3)``, ``("scale", 2, "ln1")``.

    ``("scale",)`` and ``("normalized",)`` without a layer mean the final norm.
    """
    if "." in name or name.startswith("hook_"):
        return name
    if name in ("scale", "normalized"):
        if layer is None:
            return f"ln_final.hook_{name}"
        return f"blocks.{layer}.{layer_type or 'ln1'}.hook_{name}"
    if name not in _ALIASES:
        raise KeyError(f"unknown activation shorthand {name!r}; use one of {sorted(_ALIASES)} or a full hook name")
    template = _ALIASES[name]
    if "{i}" in template:
        if layer is None:
            raise KeyError(f"{name!r} needs a layer: cache[{name!r}, LAYER]")
        return template.format(i=layer)
    return template


class ActivationCache(Mapping):
    """Cached activations of one forward pass (``cache["resid_pre", 3]`` or ``cache["blocks.3.hook_resid_pre"]``)."""

    def __init__(self, data: dict[str, Tensor], n_layers: int, has_batch_dim: bool = True) -> None:
        self._data = data
        self.n_layers = n_layers
        self.has_batch_dim = has_batch_dim

    def _key(self, key: Union[str, tuple]) -> str:
        if isinstance(key, tuple):
            if not key or len(key) > 3 or not isinstance(key[0], str):
                raise TypeError(
                    f"cache[{key!r}]: use cache[name], cache[name, layer] or cache[name, layer, "
                    f"layer_type] (like cache['resid_pre', 3] or cache['scale', 2, 'ln2'])"
                )
            name, *rest = key
            layer = rest[0] if rest else None
            if layer is not None:
                try:
                    layer = operator.index(layer)
                except TypeError:
                    raise TypeError(
                        f"cache[{key!r}]: the layer must be an int, not {type(layer).__name__} "
                        f"{layer!r}; write cache[{name!r}, {_as_int(layer)}]"
                    ) from None
                if not -self.n_layers <= layer < self.n_layers:
                    raise KeyError(
                        f"cache[{key!r}]: layer {layer} is out of range; the model has {self.n_layers} "
                        f"layers (0 to {self.n_layers - 1}, or negative from the end)"
                    )
                if layer < 0:
                    layer += self.n_layers
            layer_type = rest[1] if len(rest) > 1 else None
            if layer_type is not None and not isinstance(layer_type, str):
                raise TypeError(
                    f"cache[{key!r}]: the layer type must be a string such as 'ln1' or 'ln2', not {layer_type!r}"
                )
            return get_act_name(name, layer, layer_type)
        if not isinstance(key, str):
            raise TypeError(
                f"cache keys are hook names (strings) or tuples like ('resid_pre', 3), not "
                f"{type(key).__name__} {key!r:.60}"
            )
        if key in self._data:
            return key
        return get_act_name(key)

    def __getitem__(self, key: Union[str, tuple]) -> Tensor:
        full = self._key(key)
        try:
            return self._data[full]
        except KeyError:
            raise KeyError(
                f"{full!r} is not in the cache; cached names: {len(self._data)} "
                f"(pass names_filter to run_with_cache to choose them)"
            ) from None

    def __contains__(self, key: object) -> bool:
        try:
            return self._key(key) in self._data  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self._data)} activations: {', '.join(list(self._data)[:4])}...)"

    def to(self, device: Any) -> "ActivationCache":
        return ActivationCache({k: v.to(device) for k, v in self._data.items()}, self.n_layers, self.has_batch_dim)

    def remove_batch_dim(self) -> "ActivationCache":
        """Drop a batch dimension of size 1 from every activation."""
        if not self.has_batch_dim:
            return self
        for k, v in self._data.items():
            if v.shape[0] != 1:
                raise ValueError(f"remove_batch_dim needs batch size 1; {k} has batch size {v.shape[0]}")
        return ActivationCache({k: v[0] for k, v in self._data.items()}, self.n_layers, False)

    def stack_activation(self, name: str, layer: int = -1) -> Tensor:
        """``[layers, ...]`` stack of one activation over blocks ``0..layer`` (all when -1)."""
        last = self.n_layers if layer == -1 else layer
        return torch.stack([self[name, i] for i in range(last)])

    def accumulated_resid(self, layer: Optional[int] = None) -> Tensor:
        """Residual stream before each block and after the last: ``[layers+1, ...]``."""
        last = self.n_layers if layer is None else layer
        parts = [self["resid_pre", i] for i in range(last)]
        if last == self.n_layers:
            parts.append(self["resid_post", self.n_layers - 1])
        return torch.stack(parts)
