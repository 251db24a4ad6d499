"""Token streams packed into fixed-length contexts, as SAELens packs them for training.

Each row is tokenized without a BOS token and the rows are concatenated: every context starts with the
begin-of-context token (BOS, unless the row's next token already is one), a row that continues a context
is preceded by the separator token (BOS by default, unless the row starts with it), and a row longer than
the room left carries on in the next context. A final context that is not full is dropped, so no context
holds padding.

The packer's position between contexts is a :class:`Cursor` (a row and a token offset in it): contexts
packed from a cursor are exactly those that followed it, which makes a harvest restartable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from lensadapters.errors import LensAdaptersError
from lensadapters.integrations.harvest.sources import DataSourceError

#: ``sequence_separator``: ``"bos"``, ``"eos"``, a token id or ``None``
Separator = Union[str, int, None]

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class Cursor:
    """The next token to pack: token ``offset`` of row ``row``."""

    row: int = 0
    offset: int = 0


@dataclass(frozen=True)
class PackingRule:
    """Which tokens the packer inserts (``None``: none)."""

    context_size: int
    begin_context_token: Optional[int]
    separator_token: Optional[int]

    def __post_init__(self) -> None:
        if self.context_size < 2:
            raise ValueError(f"context_size must be at least 2, not {self.context_size}")


def pack(
    rows: Iterable[str], tokenize: Tokenize, rule: PackingRule, start: Cursor = Cursor()
) -> Iterator[tuple[torch.Tensor, Cursor]]:
    """``(context, cursor)`` pairs: each full context (``[context_size]`` int64) and the cursor after it.

    ``rows`` yields the texts from row ``start.row`` on; packing starts at token ``start.offset`` of that row
    with an empty context (as it is after every yielded context)."""
    size = rule.context_size
    context: list[int] = []
    for row, text in enumerate(rows, start.row):
        tokens = tokenize(text)
        offset = start.offset if row == start.row else 0
        while offset < len(tokens):
            if not context:
                if rule.begin_context_token is not None and tokens[offset] != rule.begin_context_token:
                    context.append(rule.begin_context_token)
            elif rule.separator_token is not None and tokens[offset] != rule.separator_token:
                context.append(rule.separator_token)
            take = size - len(context)
            context.extend(tokens[offset : offset + take])
            offset += take
            if len(context) == size:
                yield torch.tensor(context, dtype=torch.long), Cursor(row, min(offset, len(tokens)))
                context = []


def contexts_of_rows(
    rows: Iterable[list[int]], context_size: int, start: Cursor = Cursor()
) -> Iterator[tuple[torch.Tensor, Cursor]]:
    """Rows that are contexts already (a pretokenized dataset, as SAELens reads one): each row's first
    ``context_size`` tokens, used as they are."""
    for row, tokens in enumerate(rows, start.row):
        if len(tokens) < context_size:
            raise DataSourceError(
                f"row {row} of the pretokenized dataset has {len(tokens)} tokens, fewer than "
                f"context_size={context_size}: pretokenize with that context size, or lower it"
            )
        yield torch.tensor(list(tokens[:context_size]), dtype=torch.long), Cursor(row + 1, 0)


def packing_rule(tokenizer: Any, context_size: int, prepend_bos: bool, separator: Separator) -> PackingRule:
    """The packing of a harvest: contexts of ``context_size`` tokens that begin with BOS when ``prepend_bos``, rows
    joined by ``separator`` (``"bos"``/``"eos"`` from the tokenizer, a token id, or ``None``)."""
    begin = None
    if prepend_bos:
        begin = tokenizer.bos_token_id
        if begin is None:
            raise LensAdaptersError(
                "prepend_bos=True, but the tokenizer has no BOS token: pass prepend_bos=False (--no-prepend-bos)"
            )
    if separator in ("bos", "eos"):
        separator_id = getattr(tokenizer, f"{separator}_token_id")
        if separator_id is None:
            raise LensAdaptersError(
                f"sequence_separator={separator!r}, but the tokenizer has no {separator.upper()} "
                f"token: pass another separator, a token id or None"
            )
    elif separator is None or isinstance(separator, int):
        separator_id = separator
    else:
        raise ValueError(f"sequence_separator must be 'bos', 'eos', a token id or None, not {separator!r}")
    return PackingRule(context_size, begin, separator_id)
