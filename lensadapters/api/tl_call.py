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
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, NamedTuple, Optional

import torch

from lensadapters.adapters.vlm import computes_image_positions, multimodal_inputs
from lensadapters.analysis.utils import get_attention_mask, lm_cross_entropy_loss, position_ids_from_mask
from lensadapters.api import tokens as _tokens
from lensadapters.errors import LensAdaptersError, NotCausalError
from lensadapters.hooks.sites import first_input, first_output, replace_first_input, replace_first_output

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


class TransformerLensKeywordError(LensAdaptersError, TypeError):
    """A TransformerLens keyword (or value) that lensadapters does not support, or a keyword that a
    TransformerLens-style call does not take; raised instead of letting the Hugging Face forward swallow it."""


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


class _Stop(Exception):
    """Raised inside the model to end a forward at ``stop_at_layer`` (caught here, never seen by users)."""


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


def _refuse_padded_image_positions(hm: "HookedModelLike") -> None:
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


@contextlib.contextmanager
def silenced_before(hm: "HookedModelLike", layer: int) -> Iterator[None]:
    """Hooks of every point that fires before block ``layer`` (block ``n_layers``: after the last block) do not
    run: those blocks only carry placeholder input when a forward starts at ``layer``."""
    names = hm.hook_names
    boundary = next((i for i, n in enumerate(names) if n.startswith(f"blocks.{layer}.")), None)
    if boundary is None:  # after the last block: every point up to the last block's
        last = hm.cfg.n_layers - 1
        boundary = max((i for i, n in enumerate(names) if n.startswith(f"blocks.{last}.")), default=-1) + 1
    saved = []
    for name in names[:boundary]:
        point = hm.point(name)
        if point.fwd_hooks or point.bwd_hooks:
            saved.append((point, point.fwd_hooks, point.bwd_hooks))
            point.fwd_hooks, point.bwd_hooks = [], []
    try:
        yield
    finally:
        for point, fwd, bwd in saved:
            point.fwd_hooks, point.bwd_hooks = fwd, bwd


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
        token_ids = _start_tokens(hm, first, tokens, batch, pos)
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
        _refuse_padded_image_positions(hm)
    kwargs.update(passed)
    captured: list[Tensor] = []
    with contextlib.ExitStack() as stack:
        if residual is not None:
            stack.enter_context(silenced_before(hm, first))
            stack.enter_context(_inject(hm, first, residual))
        if stop_at is not None:
            stack.enter_context(_capture(hm, stop_at, captured))
        elif return_type is None and hm.layout.unembed is not None:
            stack.enter_context(_skip_unembed(hm))
        try:
            out = hm.model(**kwargs)
        except _Stop:
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


def _start_tokens(hm: "HookedModelLike", first: int, tokens: Optional[Tensor], batch: int, pos: int) -> Tensor:
    """The token ids a run from the residual at block ``first`` gives the model. The blocks before ``first`` run
    with their hook points silenced and the residual replaces block ``first``'s input, so placeholders do where
    the residual stream is all the blocks from ``first`` on read. Where they also read what the model computes
    from the token ids (``ModelLayout.side_inputs``) or keys and values of a block before ``first``
    (``kv_from``), the run needs the token ids the residual was computed from (``tokens=``): it is then the
    model's run on them with block ``first``'s ``hook_resid_pre`` replaced by the residual."""
    n = hm.cfg.n_layers
    needs = [f"blocks.L.{name}" for name in hm.layout.side_inputs] if first < n else []
    needs += [
        f"block {i} attends with the keys and values of block {qkv.kv_from}"
        for i, qkv in enumerate(hm.wiring.qkv_layouts)
        if i >= first and getattr(qkv, "kv_from", None) is not None and qkv.kv_from < first
    ]
    if not needs:
        return torch.zeros(batch, pos, dtype=torch.long, device=hm.device)  # placeholders: replaced at `first`
    what = "; ".join(needs)
    if tokens is None:
        raise ValueError(
            f"from block {first} on, this model's blocks read more than the residual stream ({what}), which it "
            f"computes from the token ids: a residual alone does not determine the run; pass tokens= (the "
            f"[batch, pos] token ids the residual was computed from) with start_at_layer"
        )
    if not isinstance(tokens, Tensor) or tuple(tokens.shape) != (batch, pos) or tokens.is_floating_point():
        raise ValueError(
            f"tokens= must be the [batch, pos] = [{batch}, {pos}] token ids the residual was computed from (the "
            f"blocks read {what}), not {type(tokens).__name__} of shape {tuple(getattr(tokens, 'shape', ()))}"
        )
    return tokens.to(hm.device)


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


@contextlib.contextmanager
def _at_block(hm: "HookedModelLike", layer: int, pre: Callable[..., Any], post: Callable[..., Any]) -> Iterator[None]:
    """``pre`` as block ``layer``'s first forward pre-hook (before the block's own hook points), or ``post`` as a
    forward hook of the last block for ``layer == n_layers`` (after its own hooks), for the duration."""
    n = hm.cfg.n_layers
    if layer < n:
        handle = hm.block_modules[layer].register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    else:
        handle = hm.block_modules[n - 1].register_forward_hook(post)
    try:
        yield
    finally:
        handle.remove()


def _embed_site(hm: "HookedModelLike", layer: int) -> Any:
    """The site serving ``hook_embed`` at block 0's input (see ``Wiring.embed_at_first_block``), for ``layer == 0``."""
    return hm.wiring.embed_at_first_block() if layer == 0 else None


def _inject(hm: "HookedModelLike", layer: int, residual: Tensor) -> ContextManager[None]:
    """The residual stream enters at block ``layer`` (after the last block when ``layer == n_layers``); hook_resid_pre
    sees the given residual."""
    embed_site = _embed_site(hm, layer)

    def pre(module: Any, args: tuple, kwargs: dict) -> Any:
        if embed_site is not None:  # hook_embed served at block 0's input: the given residual is no embedding
            embed_site.skip()
        value = first_input(args, kwargs)
        return replace_first_input(args, kwargs, _conform(residual, value, "start_at_layer"))

    def post(module: Any, args: tuple, output: Any) -> Any:
        return replace_first_output(output, _conform(residual, first_output(output), "start_at_layer"))

    return _at_block(hm, layer, pre, post)


def _capture(hm: "HookedModelLike", layer: int, captured: list) -> ContextManager[None]:
    """Record the residual stream at the input of block ``layer`` (the model's output stream for
    ``n_layers``, after the last block's own hooks such as hook_resid_post) and end the forward there; none of
    block ``layer``'s hook points fires."""
    # where hook_embed is served at the first block's input (a model scaling its embeddings in its own forward),
    # stopping at block 0 serves it first: it fires and its edit is in the result, and no other hook of block 0 runs
    embed_site = _embed_site(hm, layer)

    def pre(module: Any, args: tuple, kwargs: dict) -> None:
        served = None if embed_site is None else embed_site.serve(module, args, kwargs)
        captured.append(first_input(*served) if served is not None else first_input(args, kwargs))
        raise _Stop()

    def post(module: Any, args: tuple, output: Any) -> None:
        captured.append(first_output(output))
        raise _Stop()

    return _at_block(hm, layer, pre, post)


@contextlib.contextmanager
def _skip_unembed(hm: "HookedModelLike") -> Iterator[None]:
    def pre(module: Any, args: tuple) -> None:
        raise _Stop()

    handle = hm.hf_model.get_submodule(hm.layout.unembed).register_forward_pre_hook(pre, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def _conform(residual: Tensor, like: Tensor, what: str) -> Tensor:
    if tuple(residual.shape) != tuple(like.shape):
        raise ValueError(
            f"{what}: the residual stream has shape {tuple(residual.shape)}, the model's is "
            f"{tuple(like.shape)} at that point"
        )
    return residual.to(dtype=like.dtype, device=like.device)


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
        _refuse_padded_image_positions(hm)
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
