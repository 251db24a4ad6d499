"""TransformerLens' ``generate`` on a HookedModel (``hm.generate("text", max_new_tokens=...)``): TransformerLens'
sampler, each step a forward of the wrapped model with every attached hook active."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from lensadapters.adapters.vlm import multimodal_inputs
from lensadapters.analysis.utils import position_ids_from_mask
from lensadapters.api import tokens as _tokens
from lensadapters.api.tl_inputs import (
    TransformerLensKeywordError,
    accepts_position_ids,
    cache_argument,
    refuse_padded_image_positions,
    resolve_tokens,
    returned_cache,
)
from lensadapters.errors import LensAdaptersError
from lensadapters.hooks.sites import first_output

if TYPE_CHECKING:  # pragma: no cover
    from lensadapters.analysis.model import HookedModelLike

Tensor = torch.Tensor


#: keywords of ``HookedTransformer.generate`` that Hugging Face's ``generate`` does not take
GENERATE_KEYWORDS = (
    "stop_at_eos",
    "eos_token_id",
    "freq_penalty",
    "use_past_kv_cache",
    "prepend_bos",
    "padding_side",
    "return_type",
    "verbose",
)
GENERATE_RETURN_TYPES = ("input", "str", "tokens", "embeds")


def wants_transformer_lens_generate(args: tuple, kwargs: dict) -> bool:
    """Whether a ``generate`` call uses TransformerLens' signature (one of its own keywords, or text input)."""
    if any(k in kwargs for k in GENERATE_KEYWORDS):
        return True
    first = args[0] if args else kwargs.get("input")
    return _tokens.is_text(first)


def generate(
    hm: "HookedModelLike",
    input: Any = "",
    max_new_tokens: int = 10,
    stop_at_eos: bool = True,
    eos_token_id: Any = None,
    do_sample: bool = True,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    temperature: float = 1.0,
    freq_penalty: float = 0.0,
    use_past_kv_cache: bool = True,
    prepend_bos: Optional[bool] = None,
    padding_side: Optional[str] = None,
    return_type: Optional[str] = "input",
    verbose: bool = True,
    **model_inputs: Any,
) -> Any:
    """``HookedTransformer.generate``: sample ``max_new_tokens`` tokens (greedy with ``do_sample=False``) with
    TransformerLens' sampler (:func:`lensadapters.utils.sample_logits`), each step a forward of the wrapped model
    with every attached hook active (with ``use_past_kv_cache`` the steps after the first see only the new
    position, through the model's own key/value cache). Text in, text out (one string for one prompt, a list for
    several); token ids in, token ids ``[batch, pos + new]`` out (``return_type="str"``/``"tokens"`` to choose).
    Sequences that reach ``eos_token_id`` are padded with it until all have (``stop_at_eos``). ``verbose`` draws
    no progress bar here. A vision-language model's own inputs (``pixel_values``...: see
    :func:`~lensadapters.adapters.vlm.multimodal_inputs`) go to the first forward, which reads the whole prompt."""
    from lensadapters.analysis.utils import sample_logits

    unknown = sorted(set(model_inputs) - multimodal_inputs(hm.hf_model))
    if unknown:
        raise TypeError(f"generate() got unexpected keyword arguments {unknown}")
    if model_inputs and not use_past_kv_cache:
        raise TransformerLensKeywordError(
            f"generate with {', '.join(sorted(model_inputs))} needs use_past_kv_cache=True: the image is read once, "
            f"by the first forward, and the later steps reuse its keys and values"
        )

    if return_type not in GENERATE_RETURN_TYPES:
        raise ValueError(f"return_type must be one of {list(GENERATE_RETURN_TYPES)}, not {return_type!r}")
    if isinstance(input, Tensor) and input.is_floating_point() or return_type == "embeds":
        raise TransformerLensKeywordError(
            "generate from (or to) embeddings is not supported: pass text or token ids (HF's generate takes "
            "inputs_embeds: hm.hf_model.generate)"
        )
    text_in = _tokens.is_text(input)
    if return_type == "input":
        return_type = "str" if text_in else "tokens"
    if (text_in or return_type == "str") and hm.tokenizer is None:
        raise LensAdaptersError("generate with text needs a tokenizer: set hm.tokenizer")
    tokens, mask = resolve_tokens(hm, input, prepend_bos, padding_side, None)
    batch = tokens.shape[0]
    mask = torch.ones_like(tokens) if mask is None else mask.to(tokens.device)
    stop_tokens: list[int] = []
    eos_pad = 0
    if stop_at_eos:
        tok_eos = getattr(hm.tokenizer, "eos_token_id", None) if hm.tokenizer is not None else None
        if eos_token_id is None:
            if tok_eos is None:
                raise ValueError("generate(stop_at_eos=True) needs eos_token_id= (the tokenizer has no EOS token)")
            eos_token_id = tok_eos
        if isinstance(eos_token_id, int):
            stop_tokens, eos_pad = [eos_token_id], eos_token_id
        else:
            stop_tokens = list(eos_token_id)
            eos_pad = tok_eos if tok_eos is not None else stop_tokens[0]
    if model_inputs and bool((mask == 0).any()):
        refuse_padded_image_positions(hm)
    finished = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    positions = accepts_position_ids(hm.hf_model)
    past: Any = None
    sampled_list: list[Tensor] = []
    was_training = hm.hf_model.training
    hm.model.eval()
    try:
        for _ in range(max_new_tokens):
            step = tokens[:, -1:] if (use_past_kv_cache and past is not None) else tokens
            kwargs: dict[str, Any] = {"input_ids": step, "use_cache": use_past_kv_cache}
            if past is not None:
                kwargs[cache_argument(hm.hf_model)] = past
            else:
                kwargs.update(model_inputs)
            # a vision-language model given its image continues its own positions on an unpadded batch (they need
            # not be the tokens' indices: multimodal RoPE gives an image's tokens grid positions)
            padded = bool((mask == 0).any())
            if padded or (past is not None and not model_inputs):
                kwargs["attention_mask"] = mask
                if positions:
                    kwargs["position_ids"] = position_ids_from_mask(mask)[:, -step.shape[1] :]
            with torch.no_grad():
                out = hm.model(**kwargs)
            past = returned_cache(out) if use_past_kv_cache else None
            final = (out.logits if hasattr(out, "logits") else first_output(out))[:, -1, :]
            if do_sample:
                sampled = sample_logits(final, top_k, top_p, temperature, freq_penalty, tokens)
            else:
                sampled = final.argmax(-1)
            sampled = sampled.to(tokens.device)
            if stop_at_eos:
                sampled[finished] = eos_pad
                finished |= torch.isin(sampled, torch.tensor(stop_tokens, device=tokens.device))
            sampled_list.append(sampled[:, None])
            tokens = torch.cat([tokens, sampled[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if stop_at_eos and bool(finished.all()):
                break
    finally:
        hm.model.train(was_training)
    if return_type == "tokens":
        return tokens
    texts = [hm.tokenizer.decode(row, skip_special_tokens=True) for row in tokens]
    return texts[0] if len(texts) == 1 else texts
