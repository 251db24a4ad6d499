"""Shared by the tests of the analysis layer against TransformerLens 2.x on the same weights: a tiny model drawn
by Hypothesis wrapped by lensadapters with the TransformerLens model of its weights (``pair``), drawn tokens and
texts, the comparison within 1e-4 (``check``), and both caches' method values side by side (``both_methods``)."""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any, Callable, Literal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lensadapters import HookedModel, get_registry
from lensadapters.testing.models import reinit
from lensadapters.testing.tl_reference import (
    REFERENCE_MODEL_TYPES,
    hooked_transformer,
    reference_configs,
    transformer_lens_available,
    word_tokenizer,
)

#: TransformerLens 2.x is installed (the tests compare with it)
needs_transformer_lens = pytest.mark.skipif(
    not transformer_lens_available(),
    reason="TransformerLens 2.x is not installed (CI's transformers-4.57 environment has it: "
    "scripts/setup-reference.sh)",
)


_installed = {
    mt for info in get_registry().architecture_plugins() for arch in info.architectures for mt in arch.model_types
}
MODEL_TYPES = [mt for mt in REFERENCE_MODEL_TYPES if mt in _installed]
EXAMPLES = settings().max_examples  # the current profile's
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# the sweeps run hundreds of forwards in both libraries: fewer examples
HEAVY = settings(SETTINGS, max_examples=max(1, EXAMPLES // 6))
TOL = 1e-4


def each_model_type(test: Callable[..., Any]) -> Any:
    """``test(model_type, data)`` run for each of ``MODEL_TYPES``, with Hypothesis' ``data`` under ``SETTINGS``."""
    return pytest.mark.parametrize("model_type", MODEL_TYPES)(SETTINGS(given(data=st.data())(test)))


def check(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Within 1e-4 (absolute and relative); NaN where both are NaN (a loss over no tokens) counts as equal."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if not torch.allclose(a, b, atol=TOL, rtol=TOL, equal_nan=True):
        finite = torch.isfinite(a) & torch.isfinite(b)
        worst = (a - b)[finite].abs().max().item() if finite.any() else float("nan")
        raise AssertionError(f"{what}: max abs difference {worst:.3g} (tolerance {TOL})")


@functools.lru_cache(maxsize=None)
def tokenizer(vocab: int, adds_bos: bool = False) -> Any:
    """One saved tokenizer per kind for the whole session (TransformerLens reloads it from its folder)."""
    return word_tokenizer(vocab, adds_bos=adds_bos)


@contextlib.contextmanager
def pair(data: st.DataObject, model_type: str, tokenizer: Any = None, max_layers: int = 2, **tl_fields: Any):
    """A tiny model wrapped by lensadapters and the TransformerLens model with its weights."""
    config = data.draw(reference_configs(model_type, max_layers=max_layers), label="config")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    reinit(model, seed)  # unit-scale weights: tiny models with 0.02 init compute almost nothing
    tl = hooked_transformer(model, tokenizer=tokenizer, **tl_fields)
    hm = HookedModel.wrap(model, tokenizer=tokenizer)
    try:
        yield hm, tl
    finally:
        hm.unwrap()


def draw_tokens(data: st.DataObject, vocab: int, max_batch: int = 2, max_len: int = 7) -> torch.Tensor:
    batch = data.draw(st.integers(1, max_batch), label="batch")
    length = data.draw(st.integers(2, max_len), label="length")
    seed = data.draw(st.integers(0, 2**16), label="token seed")
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_mask(data: st.DataObject, tokens: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(tokens)
    for row in range(tokens.shape[0]):
        mask[row, : data.draw(st.integers(0, tokens.shape[1] - 1), label="pads")] = 0
    return mask


def quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args, **kwargs)


def draw_texts(data: st.DataObject, vocab: int) -> list[str]:
    n = data.draw(st.integers(1, 3), label="texts")
    return [
        " ".join(f"w{i}" for i in data.draw(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=6), label="words"))
        for _ in range(n)
    ]


def la_tokens(hm: HookedModel, texts: list[str], side: Literal["left", "right"]) -> tuple[torch.Tensor, torch.Tensor]:
    from lensadapters.tokens import tokenize

    return tokenize(hm, texts, padding_side=side)


def both_methods(ours: Any, theirs: Any, method: str, **kw: Any) -> tuple:
    """``method`` of both caches with ``kw`` (and the labels, which must agree, as the shapes must)."""
    a, la = getattr(ours, method)(return_labels=True, **kw)
    b, lb = quiet(getattr(theirs, method), return_labels=True, **kw)
    assert la == lb, f"labels differ for {kw}: {la} vs {lb}"
    assert a.shape == b.shape, f"shapes differ for {kw}: {tuple(a.shape)} vs {tuple(b.shape)}"
    return a, b


def norm_weight(hm: HookedModel, layer: int, mlp_input: bool) -> torch.Tensor:
    n = hm.cfg.n_layers
    prefix = "ln_final" if layer == n else f"blocks.{layer}.ln{2 if mlp_input else 1}"
    spec = hm.norm_spec(hm.norm_module(prefix))
    return spec.weight.float() + spec.weight_offset
