"""ActivationCache: a mapping of hook names to tensors with TransformerLens' shorthand keys."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Union

import torch

from lensadapters.analysis.cache_analysis import CacheAnalysisMixin
from lensadapters.analysis.utils import get_act_name as tl_get_act_name

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


class ActivationCache(Mapping, CacheAnalysisMixin):
    """Cached activations of one forward pass (``cache["resid_pre", 3]`` or ``cache["blocks.3.hook_resid_pre"]``).

    A read-only mapping of hook names to tensors, with TransformerLens' shorthand keys (``utils.get_act_name``)
    and its analysis methods (``accumulated_resid``, ``decompose_resid``, ``stack_head_results``,
    ``logit_attrs``...; see :mod:`lensadapters.cache_analysis`), which use ``model``, the HookedModel the
    activations come from.
    """

    def __init__(
        self, data: dict[str, Tensor], n_layers: Any = None, has_batch_dim: bool = True, model: Any = None
    ) -> None:
        """``ActivationCache(cache_dict, model, has_batch_dim=True)`` (TransformerLens' order: the model second) or
        ``ActivationCache(cache_dict, n_layers, has_batch_dim=True, model=None)``."""
        if not isinstance(data, Mapping):
            raise TypeError(f"ActivationCache(cache_dict, model): cache_dict must be a dict, not {type(data).__name__}")
        if isinstance(n_layers, int) and not isinstance(n_layers, bool):
            pass
        elif n_layers is not None and isinstance(getattr(getattr(n_layers, "cfg", None), "n_layers", None), int):
            if model is not None and model is not n_layers:
                raise TypeError("ActivationCache(cache_dict, model, model=other): two different models given")
            n_layers, model = n_layers.cfg.n_layers, n_layers  # TransformerLens' ActivationCache(cache_dict, model)
        elif n_layers is None and model is not None and isinstance(getattr(model.cfg, "n_layers", None), int):
            n_layers = model.cfg.n_layers
        else:
            got = "nothing" if n_layers is None else f"a {type(n_layers).__name__}"
            raise TypeError(
                f"ActivationCache(cache_dict, model, has_batch_dim=True): the second argument must be the model "
                f"(a HookedModel) or the number of layers (an int), got {got}"
            )
        if not isinstance(has_batch_dim, bool):
            raise TypeError(f"ActivationCache: has_batch_dim must be a bool, not {type(has_batch_dim).__name__}")
        self._data = dict(data) if not isinstance(data, dict) else data
        self.n_layers = n_layers
        self.has_batch_dim = has_batch_dim
        self.model = model

    @property
    def cache_dict(self) -> dict[str, Tensor]:
        """The underlying ``name -> tensor`` dict (TransformerLens' attribute)."""
        return self._data

    @property
    def has_embed(self) -> bool:
        return "hook_embed" in self._data

    @property
    def has_pos_embed(self) -> bool:
        return "hook_pos_embed" in self._data

    def _key(self, key: Union[str, tuple]) -> str:
        if isinstance(key, str) and key in self._data:
            return key
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
        elif not isinstance(key, str):
            raise TypeError(
                f"cache keys are hook names (strings) or tuples like ('resid_pre', 3), not "
                f"{type(key).__name__} {key!r:.60}"
            )
        else:
            name, layer, layer_type = key, None, None
        try:
            full: Optional[str] = get_act_name(name, layer, layer_type)
        except KeyError:
            full = None
        if full is None or full not in self._data:
            tl_name = tl_get_act_name(name, layer, layer_type)  # TransformerLens' own shorthand ("k6", "attn_in"...)
            if tl_name in self._data or full is None:
                return tl_name
        return full

    def __getitem__(self, key: Union[str, tuple]) -> Tensor:
        full = self._key(key)
        try:
            return self._data[full]
        except KeyError:
            pass
        layered = self._needs_layer(key)
        if layered is not None:
            raise KeyError(
                f"cache[{key!r}]: {layered[0]!r} is a hook point of every block; give a layer index, such as "
                f"cache[{layered[0]!r}, 0] ({layered[1]})"
            )
        raise KeyError(
            f"{full!r} is not in the cache; cached names: {len(self._data)} "
            f"(pass names_filter to run_with_cache to choose them)"
        )

    def _needs_layer(self, key: Union[str, tuple]) -> Optional[tuple[str, str]]:
        """``(name, the name with layer 0)`` where ``key`` is a block point's short name given without a layer."""
        name = key if isinstance(key, str) else key[0] if isinstance(key, tuple) and len(key) == 1 else None
        if not isinstance(name, str) or name.startswith("blocks.") or self.n_layers < 1:
            return None
        try:
            full = self._key((name, 0))
        except (KeyError, TypeError, ValueError):
            return None
        known = set(self._data) | set(getattr(self.model, "hook_names", None) or ())
        return (name, full) if isinstance(full, str) and full.startswith("blocks.0.") and full in known else None

    def __contains__(self, key: object) -> bool:
        try:
            return self._key(key) in self._data  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self._data)} activations: {', '.join(list(self._data)[:4])}...)"

    def to(self, device: Any, move_model: bool = False) -> "ActivationCache":
        """Move every activation to ``device`` (in place, returning the cache, as TransformerLens);
        ``move_model`` moves the model too."""
        self._data = {k: v.to(device) for k, v in self._data.items()}
        if move_model and self.model is not None:
            self.model.to(device)
        return self

    def cpu(self) -> "ActivationCache":
        return self.to("cpu")

    def cuda(self, device: Any = None) -> "ActivationCache":
        return self.to(f"cuda:{device}" if isinstance(device, int) else device or "cuda")

    def remove_batch_dim(self) -> "ActivationCache":
        """Drop a batch dimension of size 1 from every activation (in place, returning the cache)."""
        if not self.has_batch_dim:
            return self
        for k, v in self._data.items():
            if v.shape[0] != 1:
                raise ValueError(f"remove_batch_dim needs batch size 1; {k} has batch size {v.shape[0]}")
        self._data = {k: v[0] for k, v in self._data.items()}
        self.has_batch_dim = False
        return self
