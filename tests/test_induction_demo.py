"""The induction-head demo finds a real induction circuit: trained in seconds, detected by its attention pattern
and confirmed by activation patching (and, where matplotlib is installed, drawn)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lensadapters import induction_demo

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.one_environment
def test_the_demo_trains_detects_and_confirms_induction_heads(tmp_path) -> None:
    lines: list[str] = []
    png = tmp_path / "heads.png"
    result = induction_demo.run(echo=lines.append, plot=str(png) if HAS_MATPLOTLIB else None)
    heads = result.heads
    assert result.confirmed, "\n".join(lines)
    assert result.heads and all(layer > 0 for layer, _ in result.heads)  # induction needs an earlier layer...
    assert result.previous_head[0] < min(layer for layer, _ in result.heads)  # ... whose previous-token head it reads
    assert result.loss_copy < 0.25 * result.chance
    assert result.restored_together > 0.8
    assert "induction heads by their attention pattern and by what they carry" in "\n".join(lines)
    # attribution patching and EAP (one backward each) single out the same heads as activation patching
    others = [(layer, h) for layer in range(result.n_layers) for h in range(result.n_heads) if (layer, h) not in heads]
    for scores in (result.attributed, result.eap_heads):
        assert min(scores[h].item() for h in heads) > max(scores[h].item() for h in others), scores
    linear = torch.corrcoef(torch.stack([result.attributed.flatten(), result.restored.flatten()]))[0, 1]
    assert linear > 0.9 and (result.attributed - result.restored).abs().max() < 0.3
    # the circuit EAP extracts keeps the behaviour with few edges, among them the previous-token head feeding an
    # induction head's keys (K-composition)
    assert result.circuit_recovered >= 0.8 and result.circuit_edges < 0.25 * int(result.edges.valid.sum())
    prev = "A{}.{}".format(*result.previous_head)
    kept = [(result.edges.upstream[u], result.edges.downstream[d]) for u, d in result.circuit.nonzero().tolist()]
    assert any(u == prev and d.endswith(".k") and tuple(map(int, d[1:-2].split("."))) in heads for u, d in kept), kept
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"written to {png}" in "\n".join(lines)


def test_plot_without_matplotlib_is_refused_with_the_fix(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(SystemExit, match=r"pip install lensadapters\[plot\]"):
        induction_demo.run(plot=str(tmp_path / "x.png"))
