"""TransformerLens' component surface on a HookedModel, computed by the Hugging Face modules themselves.

* ``hm.embed(tokens)`` -> ``[batch, pos, d_model]`` (the value of ``hook_embed``, which it fires);
* ``hm.pos_embed(tokens, past_kv_pos_offset=0, attention_mask=None)`` -> ``[batch, pos, d_model]`` (the value of
  ``hook_pos_embed``, which it fires; models with learned position embeddings only);
* ``hm.unembed(resid)`` -> logits ``[..., d_vocab]``: the model's language-model head (its bias included) and the
  final-logit softcap where the config has one (``cfg.output_logits_soft_cap``);
* ``hm.ln_final(resid)``, ``hm.blocks[i].ln1(x)``, ``hm.blocks[i].ln2(x)``: the norm module (firing its
  ``hook_scale``/``hook_normalized`` as in the forward);
* ``hm.blocks[i].attn.W_Q`` (``W_K``, ``W_V``, ``W_O``, ``b_Q``, ``b_K``, ``b_V``, ``b_O``), ``hm.blocks[i].mlp.W_in``
  (``W_gate``, ``W_out``, ``b_in``, ``b_gate``, ``b_out``), ``hm.blocks[i].ln1.w`` / ``.b``: one layer of the
  weights, read from the live parameters (``hm.W_Q[i]``...);
* ``hm.tl_named_parameters()`` / ``hm.tl_state_dict()``: TransformerLens' names (``blocks.0.attn.W_Q``...) for
  those weights, computed from the live parameters on each call; nothing is renamed in the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from lensadapters.analysis.utils import get_offset_position_ids
from lensadapters.hooks.offload import live_parameters
from lensadapters.wiring.names import non_attention_blocks
from lensadapters.wiring.weights import layer_weight, repeat_kv

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.analysis.model import HookedModelLike

Tensor = torch.Tensor

#: TransformerLens' per-block weight names under ``blocks.{i}.attn`` / ``blocks.{i}.mlp``
ATTN_WEIGHTS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")
MLP_WEIGHTS = ("W_in", "W_gate", "W_out", "b_in", "b_gate", "b_out")
# the order of TransformerLens' named_parameters()
_ATTN_ORDER = ("W_Q", "W_O", "b_Q", "b_O", "W_K", "W_V", "b_K", "b_V")
_MLP_ORDER = ("W_in", "b_in", "W_out", "b_out")
_GATED_ORDER = ("W_in", "W_out", "W_gate", "b_in", "b_out")


def block_weight(hm: "HookedModelLike", layer: int, part: str, name: str) -> Tensor:
    """``hm.blocks[layer].{part}.{name}``: one layer of a weight, TransformerLens' shape."""
    if part == "attn" and name in ("W_K", "W_V", "b_K", "b_V"):
        return repeat_kv(layer_weight(hm.wiring, "_" + name, layer)[None], hm.cfg.n_heads)[0]
    if part in ("ln1", "ln2"):
        spec = hm.wiring.norm_spec(hm.wiring.norm_module(f"blocks.{layer}.{part}"))
        return norm_param(spec, name, f"blocks.{layer}.{part}")
    return layer_weight(hm.wiring, name, layer)


def norm_param(spec: Any, name: str, where: str) -> Tensor:
    if name == "w":
        if spec.weight is None:
            raise AttributeError(f"{where} has no weight")
        return spec.weight + spec.weight_offset if spec.weight_offset else spec.weight
    if spec.bias is None:
        raise AttributeError(f"{where} has no bias ({spec.kind} norm)")
    return spec.bias


def weight_of(hm: "HookedModelLike", prefix: str, attr: str) -> Optional[Tensor]:
    """The weight ``prefix.attr`` if it is one of TransformerLens' per-block weights, else ``None``."""
    parts = prefix.split(".")
    if len(parts) != 3 or parts[0] != "blocks" or not parts[1].isdigit():
        return None
    part = parts[2]
    if (part == "attn" and attr in ATTN_WEIGHTS) or (part == "mlp" and attr in MLP_WEIGHTS):
        return block_weight(hm, int(parts[1]), part, attr)
    if part in ("ln1", "ln2") and attr in ("w", "b"):
        return block_weight(hm, int(parts[1]), part, attr)
    return None


def call_norm(hm: "HookedModelLike", prefix: str, x: Tensor) -> Tensor:
    """Run the norm module behind ``prefix`` (``ln_final``, ``blocks.0.ln1``) on ``x``."""
    hm.wiring.sync()
    return hm.wiring.norm_module(prefix)(x)


class _Component:
    """A TransformerLens component on a HookedModel (``hm.embed``...). The hook points under its name are its
    attributes, as on the TransformerLens module (HookedEncoder's ``hm.embed.hook_token_type_embed``,
    ``hm.embed.ln.hook_scale``): ``points(hm, prefix, attr)`` finds them (``hook_namespace.attribute``)."""

    prefix = ""

    def __init__(self, hm: "HookedModelLike", points: Optional[Callable[[Any, str, str], Any]] = None) -> None:
        self._hm = hm
        self._points = points

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        prop = getattr(type(self), attr, None)
        if isinstance(prop, property):  # a property that raised AttributeError (W_pos without learned positions)
            return prop.fget(self)  # type: ignore[misc]  # raises its own message again
        if self._points is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")
        return self._points(self._hm, self.prefix, attr)


class Embed(_Component):
    """``hm.embed(tokens)``: the token embeddings ``[batch, pos, d_model]``, firing ``hook_embed``."""

    prefix = "embed"

    @property
    def W_E(self) -> Tensor:
        return self._hm.W_E  # type: ignore[attr-defined]

    def __call__(self, tokens: Tensor) -> Tensor:
        hm = self._hm
        if tokens.dim() == 1:
            tokens = tokens[None]
        hm.wiring.sync()
        layout = hm.layout
        module = hm.hf_model.get_submodule(layout.embed)
        value = module(tokens.to(hm.device))
        if layout.embed_scale_after_module and layout.embed_scale != 1.0:  # the model scales after the module
            if layout.embed_scale_rounded:
                value = value * torch.tensor(layout.embed_scale, dtype=value.dtype, device=value.device)
            else:
                value = value * layout.embed_scale
            point = hm.wiring.hook_dict.get("hook_embed")
            if point is not None:
                value, _ = point.apply(value)
        return value


class PosEmbed(_Component):
    """``hm.pos_embed(tokens, past_kv_pos_offset=0, attention_mask=None)``: the learned position embeddings
    ``[batch, pos, d_model]``, firing ``hook_pos_embed`` (positions over the real tokens given a mask)."""

    prefix = "pos_embed"

    @property
    def W_pos(self) -> Tensor:
        return self._hm.W_pos  # type: ignore[attr-defined]

    def __call__(self, tokens: Tensor, past_kv_pos_offset: int = 0, attention_mask: Optional[Tensor] = None) -> Tensor:
        hm = self._hm
        if tokens.dim() == 1:
            tokens = tokens[None]
        batch, pos = tokens.shape
        W_pos = hm.W_pos  # type: ignore[attr-defined]  # refuses a model without learned positions
        if attention_mask is None:
            positions = torch.arange(past_kv_pos_offset, past_kv_pos_offset + pos, device=W_pos.device)
            value = W_pos[positions].unsqueeze(0).expand(batch, pos, -1)
        else:
            positions = get_offset_position_ids(past_kv_pos_offset, attention_mask.to(W_pos.device))
            value = W_pos[positions]
        point = hm.wiring.hook_dict.get("hook_pos_embed")
        if point is not None:
            value, _ = point.apply(value, protect=True)
        return value


class Unembed(_Component):
    """``hm.unembed(resid)``: the logits ``[..., d_vocab]``, computed by the model's language-model head (its
    bias included), then the final-logit softcap where the config sets one."""

    prefix = "unembed"

    @property
    def W_U(self) -> Tensor:
        return self._hm.W_U  # type: ignore[attr-defined]

    @property
    def b_U(self) -> Tensor:
        return self._hm.b_U  # type: ignore[attr-defined]

    def __call__(self, residual: Tensor) -> Tensor:
        hm = self._hm
        if hm.layout.unembed is None:
            raise AttributeError(f"this {type(hm.hf_model).__name__} has no unembedding (language-model head)")
        _ = self.W_U  # refused by name where final @ W_U is not the logits (a prediction head before the unembedding)
        module = hm.hf_model.get_submodule(hm.layout.unembed)
        with live_parameters(module):
            logits = module(residual)
        cap = hm.cfg.output_logits_soft_cap
        if cap is not None and cap > 0:
            logits = cap * torch.tanh(logits / cap)
        return logits


def tl_named_parameters(hm: "HookedModelLike") -> Iterator[tuple[str, Tensor]]:
    """TransformerLens' parameter names and the weights they name, from the live parameters (see module doc)."""
    model: Any = hm
    for name in ("W_E", "W_pos"):
        try:
            yield ("embed.W_E" if name == "W_E" else "pos_embed.W_pos"), getattr(model, name)
        except AttributeError:
            continue
    mixers = non_attention_blocks(hm)
    for layer in range(hm.cfg.n_layers):
        if hm.block_layouts[layer] is None:
            continue
        for part in ("ln1", "ln2"):
            if f"blocks.{layer}.{part}" not in hm.wiring._norm_modules:
                continue
            for attr in ("w", "b"):
                try:
                    yield f"blocks.{layer}.{part}.{attr}", block_weight(hm, layer, part, attr)
                except AttributeError:
                    continue
        grouped = hm.cfg.n_key_value_heads != hm.cfg.n_heads
        for attr in _ATTN_ORDER if layer not in mixers else ():  # no attention weights in another token mixer
            if grouped and attr in ("W_K", "W_V", "b_K", "b_V"):  # TransformerLens keeps the key/value heads' own
                yield f"blocks.{layer}.attn._{attr}", layer_weight(hm.wiring, "_" + attr, layer)
            else:
                yield f"blocks.{layer}.attn.{attr}", block_weight(hm, layer, "attn", attr)
        for attr in _GATED_ORDER if hm.cfg.gated_mlp else _MLP_ORDER:  # TransformerLens has no b_gate
            try:
                yield f"blocks.{layer}.mlp.{attr}", block_weight(hm, layer, "mlp", attr)
            except (AttributeError, KeyError, ValueError):
                continue
    if hm.layout.ln_final:
        spec = hm.wiring.norm_spec(hm.wiring.norm_module("ln_final"))
        for attr in ("w", "b"):
            try:
                yield f"ln_final.{attr}", norm_param(spec, attr, "ln_final")
            except AttributeError:
                continue
    if hm.layout.unembed is not None:
        yield "unembed.W_U", model.W_U
        yield "unembed.b_U", model.b_U
