"""The model a harvest runs: the given :class:`~lensadapters.HookedModel`, the wrapper a Hugging Face model already
has, or one made for the call (and unwrapped after it) from a model or a checkpoint folder."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator


@contextlib.contextmanager
def hooked(model: Any, tokenizer: Any) -> Iterator[Any]:
    """A HookedModel for ``model``; one made here is unwrapped at the end."""
    from lensadapters.api.hooked_model import HookedModel

    if isinstance(model, HookedModel):
        yield model
        return
    if isinstance(model, (str, os.PathLike)):
        hm = HookedModel.from_pretrained(os.fspath(model), tokenizer=tokenizer, _hf_defaults=True)
        hm.hf_model.eval()
    else:
        existing = HookedModel.wrap(model) if _is_wrapped(model) else None
        if existing is not None:
            yield existing
            return
        hm = HookedModel.wrap(model)
    try:
        yield hm
    finally:
        hm.unwrap()


def _is_wrapped(model: Any) -> bool:
    from lensadapters.api.hooked_model import _wrapper_of

    return _wrapper_of(model) is not None
