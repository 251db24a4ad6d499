"""One CPU thread for a stretch of work on tiny models (:func:`single_thread`): for models that small, more threads
only add synchronization (and contend with whatever else runs); the census and the induction demo use it."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["single_thread"]


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Runs the block with ``torch.set_num_threads(1)``; the caller's thread count is restored afterwards, also
    when the block raises."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
