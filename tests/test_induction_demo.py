"""The induction-head demo finds a real induction circuit: trained in seconds, detected by its attention pattern
and confirmed by activation patching."""

from __future__ import annotations

import pytest

from lensadapters import induction_demo


def test_the_demo_trains_detects_and_confirms_induction_heads(tmp_path) -> None:
    lines: list[str] = []
    result = induction_demo.run(echo=lines.append)
    assert result.confirmed, "\n".join(lines)
    assert result.heads and all(layer > 0 for layer, _ in result.heads)  # induction needs an earlier layer
    assert result.previous_head[0] < min(layer for layer, _ in result.heads)  # ... whose previous-token head it reads
    assert result.loss_copy < 0.25 * result.chance
    assert result.restored_together > 0.8
    text = "\n".join(lines)
    assert "induction heads by their attention pattern and by what they carry" in text


def test_plot_needs_matplotlib_and_says_so(monkeypatch, tmp_path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match=r"pip install lensadapters\[plot\]"):
            induction_demo.run(plot=str(tmp_path / "x.png"))
        return
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(SystemExit, match=r"pip install lensadapters\[plot\]"):
        induction_demo.require_matplotlib()
