"""FactoredMatrix against the dense product, and TransformerLens' utilities (get_act_name, Slice)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lensadapters import FactoredMatrix
from lensadapters.testing import assert_close
from lensadapters.utils import Slice, get_act_name


@st.composite
def factored(draw: st.DrawFn) -> FactoredMatrix:
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2), label="leading dims"))
    ldim, mdim, rdim = draw(st.integers(2, 6)), draw(st.integers(1, 4)), draw(st.integers(2, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    return FactoredMatrix(
        torch.randn(*lead, ldim, mdim, generator=g, dtype=torch.float64),
        torch.randn(*lead, mdim, rdim, generator=g, dtype=torch.float64),
    )


@settings(deadline=None)
@given(fm=factored())
def test_factored_matrix_agrees_with_its_product(fm: FactoredMatrix) -> None:
    dense = fm.A @ fm.B
    assert fm.shape == dense.shape and torch.equal(fm.AB, dense)
    assert_close(fm.U @ torch.diag_embed(fm.S) @ fm.Vh.transpose(-1, -2), dense, "svd")
    assert_close(fm.norm(), torch.linalg.matrix_norm(dense), "norm")
    assert_close(fm.T.AB, dense.transpose(-1, -2), "T")
    assert_close(fm.make_even().AB, dense, "make_even")
    assert_close(fm.collapse_r() @ fm.Vh.transpose(-1, -2), dense, "collapse_r")
    assert_close(fm.U @ fm.collapse_l(), dense, "collapse_l")
    right = torch.randn(fm.rdim, 3, dtype=torch.float64)
    assert_close((fm @ right).AB, dense @ right, "@ matrix")
    assert_close(fm @ right[:, 0], dense @ right[:, 0], "@ vector")
    left = torch.randn(2, fm.ldim, dtype=torch.float64)
    assert_close((left @ fm).AB, left @ dense, "matrix @")
    assert_close((fm * 3).AB, dense * 3, "* scalar")
    assert_close((fm @ fm.T).AB, dense @ dense.transpose(-1, -2), "@ FactoredMatrix")
    if fm.ldim == fm.rdim:
        ours = fm.eigenvalues
        big = ours.abs() > 1e-6
        theirs = torch.linalg.eigvals(dense)
        for value in ours[big].flatten().tolist():  # BA's non-zero eigenvalues are AB's
            assert (theirs - value).abs().min() < 1e-6
    if fm.ndim > 2:
        assert_close(fm[0].AB, dense[0], "index")
    else:  # rows, then rows and columns (an int keeps its dimension)
        assert_close(fm[1:2].AB, dense[1:2], "rows")
        assert_close(fm[1, 0].AB, dense[1:2, 0:1], "row and column")


def test_get_act_name_examples() -> None:
    assert get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"
    assert get_act_name("pre", 2) == "blocks.2.mlp.hook_pre"
    assert get_act_name("embed") == "hook_embed"
    assert get_act_name("normalized", 27, "ln2") == "blocks.27.ln2.hook_normalized"
    assert get_act_name("k6") == "blocks.6.attn.hook_k"
    assert get_act_name("scale4ln1") == "blocks.4.ln1.hook_scale"
    assert get_act_name("scale") == "ln_final.hook_scale"
    assert get_act_name("q_input", 3) == "blocks.3.hook_q_input"
    assert get_act_name("blocks.1.hook_resid_pre") == "blocks.1.hook_resid_pre"


def test_slice() -> None:
    t = torch.arange(10)
    assert Slice(None).apply(t).tolist() == t.tolist()
    assert Slice(3).apply(t).item() == 3
    assert Slice((2, 5)).apply(t).tolist() == [2, 3, 4]
    assert Slice([1, 4]).apply(t).tolist() == [1, 4]
    assert Slice.unwrap(3).apply(t).tolist() == [3]
    assert Slice((1, 8, 3)).indices(10).tolist() == [1, 4, 7]
    with pytest.raises(ValueError):
        Slice("a")
