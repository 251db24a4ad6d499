"""The wrap-time verification's tolerance (:func:`lensadapters.adapters.generic.verify._same`): a served point whose
value, or whose edit, is off by a relative ``1e-4`` in float32 is refused, not taken for rounding. The error is
planted in the probe's reference path for ``attn.hook_result`` (one head's share of the output projection scaled by
``1 + 1e-4``, or the reference's edit scaled by it); the unplanted check holds."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from lensadapters.adapters.generic import plain_references
from lensadapters.adapters.generic.verify import _same, check_points, tolerance
from lensadapters.testing.every_model_type import input_ids
from tests.branch_helpers import tiny_model, wrap_generic

Tensor = torch.Tensor
POINT = "blocks.0.attn.hook_result"


@pytest.fixture(scope="module")
def wrapped() -> Any:
    hm = wrap_generic(tiny_model("llama"))
    assert POINT in hm.hook_dict
    yield hm
    hm.unwrap()


def _scaled_head(relative: float) -> Callable[..., Tensor]:
    """``_per_head`` with the head holding the largest value scaled by ``1 + relative``."""
    original = plain_references._per_head

    def per_head(module: torch.nn.Module, x: Tensor, heads: int) -> Tensor:
        parts = original(module, x, heads)
        head = int(parts.abs().amax(dim=tuple(i for i in range(parts.dim()) if i != parts.dim() - 2)).argmax())
        factor = torch.ones(heads, 1, dtype=parts.dtype)
        factor[head] += relative
        return parts * factor

    return per_head


def _scaled_edit(relative: float) -> Callable[..., Any]:
    """``_edit_at`` with the edit of a per-head reference scaled by ``1 + relative``."""
    original = plain_references._edit_at

    def edit_at(ref: Any, delta: Tensor) -> Any:
        made = original(ref, delta)
        return (lambda t: made(t) * (1 + relative)) if ref.kind == "result" else made

    return edit_at


def test_the_unplanted_check_holds(wrapped: Any) -> None:
    assert check_points(wrapped.wiring, input_ids(), [POINT]) == {POINT: None}


@pytest.mark.parametrize("relative", [1e-4, -1e-4, 1e-2])
def test_a_value_off_by_a_relative_1e_4_is_refused(wrapped: Any, monkeypatch: Any, relative: float) -> None:
    monkeypatch.setattr(plain_references, "_per_head", _scaled_head(relative))
    why = check_points(wrapped.wiring, input_ids(), [POINT])[POINT]
    assert why is not None and why.startswith("its value is not the reference's"), why


@pytest.mark.parametrize("relative", [1e-4, -1e-4, 1e-2])
def test_an_edit_off_by_a_relative_1e_4_is_refused(wrapped: Any, monkeypatch: Any, relative: float) -> None:
    monkeypatch.setattr(plain_references, "_edit_at", _scaled_edit(relative))
    why = check_points(wrapped.wiring, input_ids(), [POINT])[POINT]
    assert why == "an edit at it does not move the logits as the same edit at the reference", why


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [64, 4096])
def test_the_tolerance_is_roundings_of_the_dtype_and_of_the_reductions(dtype: torch.dtype, width: int) -> None:
    """Within the tolerance passes, twice it does not (the whole value's size: no allowance per element), and in
    float32 or float64 a relative ``1e-4`` is refused at either width."""
    b = torch.randn(4, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    scale = float(b.float().abs().max())
    tol = tolerance([dtype], width)
    eps = max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)
    assert tol >= 8 * (eps if eps == torch.finfo(torch.float32).eps else torch.finfo(torch.bfloat16).eps)
    if dtype in (torch.float32, torch.float64):
        assert tol < 1e-4
    i = int(b.float().abs().argmax())
    for factor, same in ((0.5, True), (2.0, False)):
        off = b.double().clone()
        off.view(-1)[i] += factor * tol * scale * (1 if off.view(-1)[i] > 0 else -1)
        assert _same(off.to(torch.float64), b.double(), scale, rounding=dtype, width=width) == same, factor
    assert _same(b, b, scale, rounding=dtype, width=width)


def test_the_tolerance_is_of_the_model_s_precision() -> None:
    """A float32 value of a float16 model (a norm computing in float32) is allowed the model's rounding, and the
    model's width widens the float32 tolerance as the square root of its reductions' length."""
    assert tolerance([torch.float32, torch.float16], 64) == tolerance([torch.bfloat16], 64)
    assert tolerance([torch.float32], 4096) > tolerance([torch.float32], 64)
    assert tolerance([torch.float64], 64) == tolerance([torch.float32], 64)  # norms compute in float32
