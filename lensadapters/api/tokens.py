"""Text to tokens and back, with TransformerLens' methods and semantics (``to_tokens``, ``to_str_tokens``...).

The tokenizer is the user's (``HookedModel.wrap(model, tokenizer=...)``) and is never changed: the BOS token,
the padding side and a missing pad token are handled per call. Defaults as in TransformerLens:
``default_prepend_bos=True`` (a BOS token in front of every string, whether or not the tokenizer adds one
itself: none is added twice) and ``default_padding_side="right"``; ``prepend_bos=None`` / ``padding_side=None``
mean "the default".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Literal, Optional, Union

import numpy as np
import torch

from lensadapters.errors import LensAdaptersError

Tensor = torch.Tensor
TextInput = Union[str, list]
PaddingSide = Optional[Literal["left", "right"]]


class NoTokenizerError(LensAdaptersError, ValueError):
    """A method needs a tokenizer and the HookedModel has none."""


def is_text(value: Any) -> bool:
    """A string or a non-empty list of strings (what ``hm(...)`` tokenizes)."""
    return isinstance(value, str) or (
        isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, str) for v in value)
    )


def require_tokenizer(owner: Any, what: str) -> Any:
    tokenizer = getattr(owner, "tokenizer", None)
    if tokenizer is None:
        raise NoTokenizerError(
            f"{what} needs a tokenizer: HookedModel.wrap(model, tokenizer=AutoTokenizer.from_pretrained(...)), "
            f"HookedModel.from_pretrained(path), or set hm.tokenizer = ..."
        )
    return tokenizer


def tokenizer_prepends_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts a BOS token in front by itself (TransformerLens: ``len(encode("")) > 0``)."""
    return len(tokenizer.encode("")) > 0


def _resolve(owner: Any, prepend_bos: Optional[bool], padding_side: PaddingSide) -> tuple[bool, str]:
    bos = owner.default_prepend_bos if prepend_bos is None else bool(prepend_bos)
    side = owner.default_padding_side if padding_side is None else padding_side
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', not {side!r}")
    return bos, side


@contextlib.contextmanager
def _pad_token(tokenizer: Any) -> Iterator[None]:
    """A tokenizer without a pad token pads with its EOS (BOS) token for this call, as TransformerLens sets it."""
    if tokenizer.pad_token is not None:
        yield
        return
    filler = tokenizer.eos_token or tokenizer.bos_token
    if filler is None:
        raise LensAdaptersError(
            "the tokenizer has no pad, EOS or BOS token to pad a batch of strings with; set tokenizer.pad_token"
        )
    tokenizer.pad_token = filler
    try:
        yield
    finally:
        tokenizer.pad_token = None


def pad_token_id(tokenizer: Any) -> Optional[int]:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id


def _drop_first_real(tokens: Tensor, mask: Tensor, side: str) -> tuple[Tensor, Tensor]:
    """Remove each row's first real token (the tokenizer's own BOS), keeping the rows aligned."""
    if side == "right":
        return tokens[..., 1:], mask[..., 1:]
    first = mask.long().argmax(-1)  # left padding: the first real position of each row
    keep = torch.ones_like(mask, dtype=torch.bool)
    keep[torch.arange(tokens.shape[0]), first] = False
    shape = (tokens.shape[0], tokens.shape[1] - 1)
    return tokens[keep].view(shape), mask[keep].view(shape)


def tokenize(
    owner: Any,
    input: TextInput,
    prepend_bos: Optional[bool] = None,
    padding_side: PaddingSide = None,
    truncate: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(tokens, attention_mask)`` of a string or list of strings, ``[batch, pos]`` each (on the CPU)."""
    tokenizer = require_tokenizer(owner, "tokenizing text")
    bos, side = _resolve(owner, prepend_bos, padding_side)
    if isinstance(input, tuple):
        input = list(input)
    adds_bos = tokenizer_prepends_bos(tokenizer)
    if bos and not adds_bos:
        if tokenizer.bos_token is None:
            raise LensAdaptersError(
                "prepend_bos=True, but the tokenizer has no BOS token: pass prepend_bos=False "
                "or set hm.default_prepend_bos = False"
            )
        input = tokenizer.bos_token + input if isinstance(input, str) else [tokenizer.bos_token + s for s in input]
    n_ctx = getattr(getattr(owner, "cfg", None), "n_ctx", None)
    with _pad_token(tokenizer):
        encoded = tokenizer(
            input,
            return_tensors="pt",
            padding=True,
            truncation=truncate and n_ctx is not None,
            max_length=n_ctx if truncate else None,
            padding_side=side,
        )
    tokens, mask = encoded["input_ids"], encoded["attention_mask"]
    if not bos and adds_bos:
        tokens, mask = _drop_first_real(tokens, mask, side)
    return tokens, mask


def to_tokens(
    owner: Any,
    input: TextInput,
    prepend_bos: Optional[bool] = None,
    padding_side: PaddingSide = None,
    move_to_device: bool = True,
    truncate: bool = True,
) -> Tensor:
    tokens, _ = tokenize(owner, input, prepend_bos, padding_side, truncate)
    return tokens.to(owner.device) if move_to_device else tokens


def to_string(owner: Any, tokens: Any) -> Union[str, list[str]]:
    tokenizer = require_tokenizer(owner, "to_string")
    if not isinstance(tokens, Tensor):
        tokens = torch.tensor(np.asarray(tokens) if isinstance(tokens, np.ndarray) else tokens)
    if tokens.ndim == 2:
        return tokenizer.batch_decode(tokens, clean_up_tokenization_spaces=False)
    if tokens.ndim <= 1:
        return tokenizer.decode(tokens, clean_up_tokenization_spaces=False)
    raise ValueError(f"to_string takes tokens of shape [pos] or [batch, pos], not {tuple(tokens.shape)}")


def to_str_tokens(
    owner: Any, input: Any, prepend_bos: Optional[bool] = None, padding_side: PaddingSide = None
) -> Union[list[str], list[list[str]]]:
    tokenizer = require_tokenizer(owner, "to_str_tokens")
    if isinstance(input, list):
        return [to_str_tokens(owner, item, prepend_bos, padding_side) for item in input]  # type: ignore[misc]
    if isinstance(input, str):
        tokens: Any = to_tokens(owner, input, prepend_bos, padding_side, move_to_device=False)[0]
    elif isinstance(input, Tensor):
        tokens = input.squeeze()
        if tokens.dim() == 0:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 1:
            raise ValueError(f"to_str_tokens takes tokens of shape [pos] or [1, pos], not {tuple(input.shape)}")
    elif isinstance(input, np.ndarray):
        tokens = input.squeeze()
        if tokens.ndim == 0:
            tokens = np.expand_dims(tokens, axis=0)
        if tokens.ndim != 1:
            raise ValueError(f"to_str_tokens takes tokens of shape [pos] or [1, pos], not {input.shape}")
    else:
        raise ValueError(f"to_str_tokens takes a string, a list, a tensor or an array, not {type(input).__name__}")
    # one string per token (as TransformerLens' batch_decode over a 1-D tensor gives on transformers 4.x)
    return [tokenizer.decode([int(t)], clean_up_tokenization_spaces=False) for t in tokens.tolist()]


def to_single_token(owner: Any, string: str) -> int:
    token = to_tokens(owner, string, prepend_bos=False, move_to_device=False).squeeze()
    if token.shape:
        raise ValueError(f"{string!r} is not a single token (it is {token.numel()} tokens)")
    return int(token.item())


def to_single_str_token(owner: Any, int_token: int) -> str:
    if not isinstance(int_token, int):
        raise TypeError(f"to_single_str_token takes an int, not {type(int_token).__name__}")
    token = to_str_tokens(owner, torch.tensor([int_token]))
    return token[0]  # type: ignore[return-value]


def get_token_position(
    owner: Any,
    single_token: Union[str, int, Tensor],
    input: Union[str, Tensor],
    mode: str = "first",
    prepend_bos: Optional[bool] = None,
    padding_side: PaddingSide = None,
) -> int:
    tokens = to_tokens(owner, input, prepend_bos, padding_side) if isinstance(input, str) else input
    if tokens.ndim == 2:
        if tokens.shape[0] != 1:
            raise ValueError(f"get_token_position takes tokens of shape [pos] or [1, pos], not {tuple(tokens.shape)}")
        tokens = tokens[0]
    if isinstance(single_token, str):
        single_token = to_single_token(owner, single_token)
    elif isinstance(single_token, Tensor):
        single_token = int(single_token.item())
    indices = torch.arange(len(tokens), device=tokens.device)[tokens == single_token]
    if len(indices) == 0:
        raise ValueError(f"token {single_token} does not occur in the input")
    if mode == "first":
        return int(indices[0].item())
    if mode == "last":
        return int(indices[-1].item())
    raise ValueError(f"mode must be 'first' or 'last', not {mode!r}")


class TokenizerMixin:
    """``hm.tokenizer`` and TransformerLens' tokenizer methods on a HookedModel."""

    tokenizer: Any = None
    #: TransformerLens' ``cfg.default_prepend_bos``: prepend a BOS token to text inputs
    default_prepend_bos: bool = True
    #: TransformerLens' ``cfg.default_padding_side``
    default_padding_side: Literal["left", "right"] = "right"

    def to_tokens(
        self,
        input: TextInput,
        prepend_bos: Optional[bool] = None,
        padding_side: PaddingSide = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> Tensor:
        """Tokens ``[batch, pos]`` of a string or list of strings (padded on ``padding_side``)."""
        return to_tokens(self, input, prepend_bos, padding_side, move_to_device, truncate)

    def to_string(self, tokens: Any) -> Union[str, list[str]]:
        """The text of tokens ``[pos]`` (a string) or ``[batch, pos]`` (a list of strings)."""
        return to_string(self, tokens)

    def to_str_tokens(
        self, input: Any, prepend_bos: Optional[bool] = None, padding_side: PaddingSide = None
    ) -> Union[list[str], list[list[str]]]:
        """Each token as a string: of a string, a list (one list each) or tokens ``[pos]``/``[1, pos]``."""
        return to_str_tokens(self, input, prepend_bos, padding_side)

    def to_single_token(self, string: str) -> int:
        """The id of a string that is one token (an error otherwise)."""
        return to_single_token(self, string)

    def to_single_str_token(self, int_token: int) -> str:
        return to_single_str_token(self, int_token)

    def get_token_position(
        self,
        single_token: Union[str, int, Tensor],
        input: Union[str, Tensor],
        mode: str = "first",
        prepend_bos: Optional[bool] = None,
        padding_side: PaddingSide = None,
    ) -> int:
        """Position of ``single_token`` in ``input`` (its first or last occurrence)."""
        return get_token_position(self, single_token, input, mode, prepend_bos, padding_side)
