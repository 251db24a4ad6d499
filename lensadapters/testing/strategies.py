"""Hypothesis strategies for plugin tests: token inputs with left padding, seeds, keyword overrides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from hypothesis import strategies as st


@dataclass
class Inputs:
    """A batch of token ids with an attention mask; ``pad`` holds each row's number of left pad tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    pad: list[int]

    @property
    def valid(self) -> torch.Tensor:
        """``[b, p]`` boolean: positions that are real tokens."""
        return self.attention_mask.bool()

    def kwargs(self) -> dict:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


@st.composite
def token_inputs(
    draw: st.DrawFn, vocab_size: int, max_batch: int = 3, min_len: int = 2, max_len: int = 10, left_padding: bool = True
) -> Inputs:
    """Random token ids; with ``left_padding`` some rows start with padding (at least one real token per row)."""
    batch = draw(st.integers(1, max_batch))
    length = draw(st.integers(min_len, max_len))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, length), generator=generator)
    pads = [draw(st.integers(0, length - 2)) if left_padding else 0 for _ in range(batch)]
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return Inputs(ids, mask, pads)


def as_strategy(value: Any) -> st.SearchStrategy:
    """``value`` itself if it is a strategy, else a strategy that always gives ``value``.

    Config strategies take their keyword overrides through it, so each override may be a fixed value
    (``d_model=64``) or a narrower strategy (``n_layers=st.integers(1, 2)``).
    """
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**16)


def pick(draw: st.DrawFn, options: list, label: Optional[str] = None):  # pragma: no cover - convenience
    return draw(st.sampled_from(options), label=label)
