"""The induction-head demo finds a real induction circuit: trained in seconds, detected by its attention pattern
and confirmed by activation patching (and, where matplotlib is installed, drawn)."""

from __future__ import annotations

import importlib.util

import pytest

from lensadapters import induction_demo

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_the_demo_trains_detects_and_confirms_induction_heads(tmp_path) -> None:
    lines: list[str] = []
    png = tmp_path / "heads.png"
    result = induction_demo.run(echo=lines.append, plot=str(png) if HAS_MATPLOTLIB else None)
    assert result.confirmed, "\n".join(lines)
    assert result.heads and all(layer > 0 for layer, _ in result.heads)  # induction needs an earlier layer...
    assert result.previous_head[0] < min(layer for layer, _ in result.heads)  # ... whose previous-token head it reads
    assert result.loss_copy < 0.25 * result.chance
    assert result.restored_together > 0.8
    assert "induction heads by their attention pattern and by what they carry" in "\n".join(lines)
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"written to {png}" in "\n".join(lines)


def test_plot_without_matplotlib_is_refused_with_the_fix(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(SystemExit, match=r"pip install lensadapters\[plot\]"):
        induction_demo.run(plot=str(tmp_path / "x.png"))
