"""How a TransformerLens-style call's input becomes the Hugging Face forward's keywords: text or token ids to
tokens and the attention mask TransformerLens would use, positions counted over a padded batch's real tokens, the
key/value cache's name in this transformers, and the refusals of what such a call cannot do on a model (the
next-token loss or ``generate`` of a bidirectional one, a padded batch with an image under multimodal RoPE).
Shared by :mod:`.tl_call` (the forward) and :mod:`.tl_generate`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Optional

import torch

from lensadapters.adapters.vlm import computes_image_positions
from lensadapters.analysis.utils import get_attention_mask, position_ids_from_mask
from lensadapters.api import tokens as _tokens
from lensadapters.errors import LensAdaptersError, NotCausalError

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.analysis.model import HookedModelLike

Tensor = torch.Tensor


class TransformerLensKeywordError(LensAdaptersError, TypeError):
    """A TransformerLens keyword (or value) that lensadapters does not support, or a keyword that a
    TransformerLens-style call does not take; raised instead of letting the Hugging Face forward swallow it."""


_POSITION_IDS: dict[type, bool] = {}
_CACHE_ARGUMENT: dict[type, str] = {}


def accepts_position_ids(model: Any) -> bool:
    """Whether the model's forward takes ``position_ids`` (then padded batches get real-token positions)."""
    cls = type(model)
    if cls not in _POSITION_IDS:
        try:
            _POSITION_IDS[cls] = "position_ids" in inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):  # pragma: no cover - an unintrospectable forward
            _POSITION_IDS[cls] = False
    return _POSITION_IDS[cls]


def cache_argument(model: Any) -> str:
    """The name the model's forward takes its key/value cache under: ``cache`` from transformers 5.24
    (``past_key_values`` is deprecated there, and goes in 5.40), ``past_key_values`` before."""
    cls = type(model)
    if cls not in _CACHE_ARGUMENT:
        try:
            parameters = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):  # pragma: no cover - an unintrospectable forward
            parameters = {}
        _CACHE_ARGUMENT[cls] = "cache" if "cache" in parameters else "past_key_values"
    return _CACHE_ARGUMENT[cls]


def returned_cache(out: Any) -> Any:
    """The key/value cache a forward returned (``out.cache`` from transformers 5.24, ``out.past_key_values``
    before), ``None`` if it returned none."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def hf_inputs(hm: "HookedModelLike", tokens: Tensor, attention_mask: Optional[Tensor]) -> dict[str, Any]:
    """Keyword arguments of the Hugging Face forward for these tokens (mask and positions only where padded)."""
    kwargs: dict[str, Any] = {"input_ids": tokens}
    if attention_mask is not None:
        attention_mask = attention_mask.to(tokens.device)
        if bool((attention_mask == 0).any()):
            kwargs["attention_mask"] = attention_mask
            # a causal LM's positions count from each row's first token (left padding); an encoder keeps its own
            # (TransformerLens' HookedEncoder: 0, 1, ... whatever the mask)
            if hm.cfg.attention_dir == "causal" and accepts_position_ids(hm.hf_model):
                kwargs["position_ids"] = position_ids_from_mask(attention_mask)
    return kwargs


def refuse_padded_image_positions(hm: "HookedModelLike") -> None:
    if computes_image_positions(hm.hf_model):
        raise TransformerLensKeywordError(
            f"{type(hm.hf_model).__name__} computes its language model's positions from the image grids (multimodal "
            f"RoPE): a padded batch with an image is not supported by TransformerLens-style calls, whose positions "
            f"count the mask's tokens; call the model with Hugging Face's keywords (hm(input_ids=..., "
            f"attention_mask=..., ...), hm.generate(input_ids=..., ...)) or pass one sequence at a time"
        )


def resolve_tokens(
    hm: "HookedModelLike",
    input: Any,
    prepend_bos: Optional[bool],
    padding_side: Optional[str],
    attention_mask: Optional[Tensor],
) -> tuple[Tensor, Optional[Tensor]]:
    """Tokens ``[batch, pos]`` on the model's device and the attention mask TransformerLens would use."""
    if _tokens.is_text(input):
        tokens, mask = _tokens.tokenize(hm, input, prepend_bos, padding_side)
        if attention_mask is not None:
            mask = attention_mask
    elif isinstance(input, Tensor):
        if input.is_floating_point():
            raise ValueError(
                f"a float input of shape {tuple(input.shape)} is a residual stream: pass start_at_layer "
                f"(or token ids for a full forward)"
            )
        tokens = input[None] if input.dim() == 1 else input
        mask = attention_mask
        if mask is None and hm.tokenizer is not None:
            bos = hm.default_prepend_bos if prepend_bos is None else prepend_bos
            side = hm.default_padding_side if padding_side is None else padding_side
            if side == "left":  # TransformerLens infers the mask of left-padded tokens from the pad token
                mask = get_attention_mask(hm.tokenizer, tokens, bos, side)
    else:
        raise TypeError(
            f"a TransformerLens-style call takes text, a list of texts or token ids [batch, pos], "
            f"not {type(input).__name__}"
        )
    if mask is not None and tuple(mask.shape) != tuple(tokens.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, the tokens {tuple(tokens.shape)}")
    return tokens.to(hm.device), mask


def refuse_bidirectional(hm: "HookedModelLike", what: str) -> None:
    """Refuse ``what``, which needs a causal language model, on a model whose attention is bidirectional."""
    if getattr(getattr(hm.hf_model, "config", None), "is_encoder_decoder", False):
        raise NotCausalError(
            f"{what} needs a causal language model; {type(hm.hf_model).__name__} is an encoder-decoder: its "
            f"loss is the model's own forward with labels=... (hm(**batch, labels=...).loss), its generation "
            f"hm.generate(input_ids=..., max_new_tokens=...) (Hugging Face's, hooks active)"
        )
    if hm.cfg.attention_dir != "causal":
        raise NotCausalError(
            f"{what} needs a causal language model; {hm.cfg.original_architecture or 'this model'} attends "
            f"bidirectionally (cfg.attention_dir={hm.cfg.attention_dir!r}, an encoder). Use the logits (a masked-LM "
            f"loss from them and the masked positions' labels, or the model's own forward with labels=...)"
        )
