"""TransformerLens' call conventions on a HookedModel: ``hm(input, return_type=..., stop_at_layer=...)``.

``hm(...)`` is exactly the Hugging Face forward unless the call is TransformerLens-style: a TransformerLens
keyword is given (``return_type``, ``loss_per_token``, ``prepend_bos``, ``padding_side``, ``start_at_layer``,
``stop_at_layer``, ``tokens``, ...) or the input is a string or a list of strings. A TransformerLens-style call
returns what ``HookedTransformer.forward`` returns:

* ``return_type="logits"`` (the default): the logits ``[batch, pos, d_vocab]``;
* ``"loss"``: the mean next-token loss (a scalar), or ``[batch, pos - 1]`` with ``loss_per_token=True``;
* ``"both"``: ``Output(logits, loss)`` (a named tuple);
* ``None``: ``None`` (the unembedding is not computed);
* with ``stop_at_layer``: the residual stream ``[batch, pos, d_model]`` at the input of that block (the blocks
  from there on do not run: the forward is stopped, not masked).

With ``start_at_layer`` the input is the residual stream at that block's input; ``tokens=`` gives the token ids for
the loss and, on a model whose blocks read more than the residual stream (inputs it computes from the token ids,
``ModelLayout.side_inputs``: Gemma 4's per-layer input embeddings; keys and values of an earlier block,
``kv_from``), for those: there it is required, and the run is the model's run on ``tokens`` with that block's
``hook_resid_pre`` replaced by the given residual (the blocks before it run with their hook points silenced).

``run_with_hooks`` and ``run_with_cache`` take the same keywords and return the same values (their
Hugging Face-style calls return the logits tensor, as before).

Text is tokenized with ``hm.tokenizer`` (see :mod:`lensadapters.tokens`); padded batches get an attention mask,
and, when the model's forward takes ``position_ids``, positions counted over the real tokens (as ``generate``
does), so a left-padded row's real tokens give the values of the unpadded row on every architecture (GPT-2
does not derive positions from the mask by itself).

The input handling is :mod:`.tl_inputs`, running from or to a block :mod:`.tl_layers` and ``generate``
:mod:`.tl_generate`; this module re-exports their public names.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from lensadapters.adapters.vlm import multimodal_inputs
from lensadapters.analysis.utils import lm_cross_entropy_loss
from lensadapters.api import tokens as _tokens
from lensadapters.api.tl_generate import (  # noqa: F401  (re-exported: this module's public names)
    GENERATE_KEYWORDS,
    GENERATE_RETURN_TYPES,
    generate,
    wants_transformer_lens_generate,
)
from lensadapters.api.tl_inputs import (  # noqa: F401  (re-exported: this module's public names)
    TransformerLensKeywordError,
    accepts_position_ids,
    cache_argument,
    hf_inputs,
    refuse_bidirectional,
    refuse_padded_image_positions,
    resolve_tokens,
    returned_cache,
)
from lensadapters.api.tl_layers import Stop, capture, inject, silenced_before, skip_unembed, start_tokens
from lensadapters.hooks.sites import first_output

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.analysis.model import HookedModelLike

Tensor = torch.Tensor

#: keywords of ``HookedTransformer.forward`` (besides ``input`` and ``attention_mask``, which HF shares)
FORWARD_KEYWORDS = (
    "return_type",
    "loss_per_token",
    "prepend_bos",
    "padding_side",
    "start_at_layer",
    "tokens",
    "shortformer_pos_embed",
    "stop_at_layer",
    "past_kv_cache",
    "one_zero_attention_mask",
)
#: TransformerLens keywords of ``run_with_cache``/``run_with_hooks`` that lensadapters accepts only with the
#: value that asks for what it does anyway (anything else is refused, never silently dropped)
NO_OP_KEYWORDS = {"reset_hooks_end": True, "clear_contexts": False, "return_cache_object": True, "pos_slice": None}
RETURN_TYPES = ("logits", "loss", "both", None)


class Output(NamedTuple):
    """``return_type="both"``: logits and loss, as TransformerLens' ``Output``."""

    logits: Tensor
    loss: Tensor


def wants_transformer_lens(args: tuple, kwargs: dict) -> bool:
    """Whether a call uses TransformerLens conventions (a TL keyword, or text as the input)."""
    if any(k in kwargs for k in FORWARD_KEYWORDS) or any(k in kwargs for k in NO_OP_KEYWORDS):
        return True
    if "decoder_input" in kwargs:  # HookedEncoderDecoder's decoder tokens
        return True
    first = args[0] if args else kwargs.get("input", kwargs.get("input_ids"))
    return _tokens.is_text(first)


def _check_extra(kwargs: dict) -> None:
    for key, value in kwargs.items():
        if key in NO_OP_KEYWORDS:
            wanted = NO_OP_KEYWORDS[key]
            if not (value is wanted or (isinstance(value, bool) and value == wanted)):
                raise TransformerLensKeywordError(
                    f"{key}={value!r} is not supported by lensadapters (only {key}={wanted!r}, what it always "
                    f"does): {_NO_OP_HINTS[key]}"
                )
            continue
        raise TransformerLensKeywordError(
            f"{key!r} is not a keyword of a TransformerLens-style call (TransformerLens' forward takes input, "
            f"{', '.join(FORWARD_KEYWORDS)} and attention_mask). For the Hugging Face forward, call hm(input_ids, "
            f"{key}=...) with no TransformerLens keyword"
        )


_NO_OP_HINTS = {
    "reset_hooks_end": "it is a keyword of run_with_cache and run_with_hooks, not of the forward",
    "clear_contexts": "lensadapters' hook points keep no hook contexts (hook.ctx) to clear",
    "return_cache_object": "run_with_cache returns an ActivationCache, a Mapping (dict(cache) gives a dict)",
    "pos_slice": "slice the cached tensors (or use the pos_slice of the ActivationCache methods)",
}


def _decoder_input(
    hm: "HookedModelLike", input: Any, decoder_input: Optional[Tensor], start: Optional[int], stop: Optional[int]
) -> Optional[Tensor]:
    """HookedEncoderDecoder's ``decoder_input`` (the decoder's token ids) for an encoder-decoder: given, or for text
    input one decoder start token per row (TransformerLens starts with the pad token, T5's decoder start token);
    ``None`` for another model, which must not be given one."""
    config = getattr(hm.hf_model, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        if decoder_input is not None:
            raise TransformerLensKeywordError(
                "decoder_input is HookedEncoderDecoder's keyword, for encoder-decoders; this model has one stack"
            )
        return None
    if start is not None or stop is not None:
        raise TransformerLensKeywordError(
            "start_at_layer/stop_at_layer are HookedTransformer's; HookedEncoderDecoder has neither (an "
            "encoder-decoder's blocks are two stacks): read or patch encoder.{i}/decoder.{i} points instead"
        )
    if decoder_input is None:
        if not _tokens.is_text(input):
            raise ValueError("an encoder-decoder's TransformerLens-style call with token ids needs decoder_input=")
        start_id = getattr(config, "decoder_start_token_id", None)
        start_id = getattr(config, "pad_token_id", 0) if start_id is None else start_id
        return torch.tensor([[start_id]])
    if not isinstance(decoder_input, Tensor) or decoder_input.is_floating_point() or decoder_input.dim() != 2:
        raise ValueError(f"decoder_input must be [batch, decoder_pos] token ids, not {decoder_input!r:.80}")
    return decoder_input


def _layer_range(n: int, start: Optional[int], stop: Optional[int]) -> tuple[int, int]:
    for name, value in (("start_at_layer", start), ("stop_at_layer", stop)):
        if value is not None and not isinstance(value, int):
            raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    first, end, _ = slice(start, stop).indices(n)
    return first, max(first, end)


def forward(
    hm: "HookedModelLike",
    input: Any = None,
    return_type: Optional[str] = "logits",
    loss_per_token: bool = False,
    prepend_bos: Optional[bool] = None,
    padding_side: Optional[str] = None,
    start_at_layer: Optional[int] = None,
    tokens: Optional[Tensor] = None,
    shortformer_pos_embed: Optional[Tensor] = None,
    attention_mask: Optional[Tensor] = None,
    stop_at_layer: Optional[int] = None,
    past_kv_cache: Any = None,
    **extra: Any,
) -> Any:
    """``HookedTransformer.forward`` on the wrapped model (see the module docstring for what it returns)."""
    if input is None:
        input = extra.pop("input_ids", None)
    one_zero = extra.pop("one_zero_attention_mask", None)  # HookedEncoder's name of the attention mask
    if one_zero is not None:
        if attention_mask is not None:
            raise TypeError("give attention_mask or one_zero_attention_mask (HookedEncoder's name for it), not both")
        attention_mask = one_zero
    token_type_ids = extra.pop("token_type_ids", None)  # HookedEncoder's segment ids, for models that take them
    decoder_input = extra.pop("decoder_input", None)  # HookedEncoderDecoder's decoder tokens (checked below)
    image_inputs = multimodal_inputs(hm.hf_model) if extra else frozenset()  # pixel_values...
    passed = {k: extra.pop(k) for k in list(extra) if k in image_inputs}
    _check_extra(extra)
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type must be one of {RETURN_TYPES}, not {return_type!r}")
    if return_type in ("loss", "both"):
        refuse_bidirectional(hm, f"return_type={return_type!r} (the next-token loss)")
    decoder_input = _decoder_input(hm, input, decoder_input, start_at_layer, stop_at_layer)
    if shortformer_pos_embed is not None:
        raise TransformerLensKeywordError(
            "shortformer_pos_embed is not supported: no Hugging Face architecture "
            "adds positions to attention inputs only"
        )
    if past_kv_cache is not None:
        raise TransformerLensKeywordError(
            "past_kv_cache (TransformerLens' HookedTransformerKeyValueCache) is not supported: use model.generate "
            "or the Hugging Face forward's past_key_values; hooks run at every step either way"
        )
    if input is None:
        raise TypeError("a TransformerLens-style call needs an input (text, a list of texts or token ids)")
    n = hm.cfg.n_layers
    first, end = _layer_range(n, start_at_layer, stop_at_layer)
    if start_at_layer is not None:
        if not isinstance(input, Tensor) or input.dim() != 3:
            raise ValueError(
                f"with start_at_layer the input is the residual stream [batch, pos, d_model], not "
                f"{type(input).__name__} of shape {tuple(getattr(input, 'shape', ()))}"
            )
        if stop_at_layer is not None and end <= first:
            return input  # no block between start and stop (as TransformerLens: the residual, unchanged)
        residual = input
        batch, pos = input.shape[:2]
        mask = attention_mask
        token_ids = start_tokens(hm, first, tokens, batch, pos)
        loss_tokens = tokens
    else:
        residual = None
        token_ids, mask = resolve_tokens(hm, input, prepend_bos, padding_side, attention_mask)
        loss_tokens = token_ids if tokens is None else tokens
    stop_at = end if stop_at_layer is not None else None
    if stop_at is None and return_type in ("loss", "both") and loss_tokens is None:
        raise ValueError("return_type='loss'/'both' with start_at_layer needs tokens= (the token ids, for the loss)")
    kwargs = hf_inputs(hm, token_ids, mask)  # use_cache as the model's default: the numbers of its own forward
    if token_type_ids is not None:
        kwargs["token_type_ids"] = token_type_ids.to(token_ids.device)
    if decoder_input is not None:  # an encoder-decoder: the encoder's mask is given whether or not it pads
        kwargs["decoder_input_ids"] = decoder_input.expand(token_ids.shape[0], -1).to(token_ids.device)
        if mask is not None:
            kwargs["attention_mask"] = mask.to(token_ids.device)
    if passed and "position_ids" in kwargs:
        refuse_padded_image_positions(hm)
    kwargs.update(passed)
    captured: list[Tensor] = []
    with contextlib.ExitStack() as stack:
        if residual is not None:
            stack.enter_context(silenced_before(hm, first))
            stack.enter_context(inject(hm, first, residual))
        if stop_at is not None:
            stack.enter_context(capture(hm, stop_at, captured))
        elif return_type is None and hm.layout.unembed is not None:
            stack.enter_context(skip_unembed(hm))
        try:
            out = hm.model(**kwargs)
        except Stop:
            out = None
    if stop_at is not None:
        return captured[0]
    if return_type is None:
        return None
    logits = out.logits if hasattr(out, "logits") else first_output(out)
    if return_type == "logits":
        return logits
    loss = lm_cross_entropy_loss(logits, loss_tokens, mask, per_token=loss_per_token)
    return loss if return_type == "loss" else Output(logits, loss)
