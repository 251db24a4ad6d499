"""``scripts/run-tl-notebook.py``: TransformerLens notebooks run on TransformerLens and, with only the
construction line changed, on lensadapters; every value compared.

The first tests check the runner's own parts (the one-line change, what it skips, how it compares) without models;
the last runs a small notebook written in TransformerLens' idiom end to end (TransformerLens 2.x needed: CI's
transformers-4.57 environment has it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lensadapters.testing.tl_reference import transformer_lens_available

RUNNER = Path(__file__).resolve().parents[1] / "scripts" / "run-tl-notebook.py"


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_tl_notebook", RUNNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_port_changes_only_the_construction_call(runner: ModuleType) -> None:
    src = (
        'text = "use HookedTransformer.from_pretrained(NAME)"  # HookedTransformer.from_pretrained(\n'
        'model = HookedTransformer.from_pretrained(\n    "gpt2-small", fold_ln=True)\n'
        "other = HookedTransformer.from_pretrained_no_processing('gpt2')\n"
        "cfg = HookedTransformer.cfg\n"
    )
    assert runner.port(src) == (
        'text = "use HookedTransformer.from_pretrained(NAME)"  # HookedTransformer.from_pretrained(\n'
        'model = HookedModel.from_pretrained(\n    "gpt2-small", fold_ln=True)\n'
        "other = HookedModel.from_pretrained('gpt2')\n"
        "cfg = HookedTransformer.cfg\n"
    )


def test_static_skips_name_their_reason(runner: ModuleType) -> None:
    assert runner.static_skip("%pip install transformer_lens\n!nvidia-smi") == "notebook magics / shell commands only"
    assert "dataset" in runner.static_skip('ds = load_dataset("NeelNanda/pile-10k")')
    assert "checkpoints" in runner.static_skip('HookedTransformer.from_pretrained("solu-2l", checkpoint_index=3)')
    # an import of datasets, or the word in a string, needs no network
    assert runner.static_skip('import datasets\ntext = "trained on datasets."') is None
    # magics inside Python become pass, keeping the block valid
    assert runner.strip_magics("if IN_COLAB:\n    %pip install x\n") == "if IN_COLAB:\n    pass"


def test_differences_within_tolerance_and_beyond(runner: ModuleType) -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    assert runner.differences(a, a + 5e-5, "x") == []
    assert runner.differences(a, a + 1e-2, "x") == ["x: max abs difference 0.01 (values up to 3)"]
    assert runner.differences(a, a[:2], "x") == ["x: shape (3,) vs (2,)"]
    assert runner.differences({"<cache>": {"k": a}}, {"<cache>": {}}, "cache")[0].startswith("cache: cache lacks 1")
    # printed numbers: within one unit of the last printed digit
    assert runner.differences("loss 1.234\n", "loss 1.235\n", "printed") == []
    assert runner.differences("loss 1.234\n", "loss 1.240\n", "printed") != []
    assert runner.differences("Mary\n", "John\n", "printed") == ["printed: text differs at line 0: 'Mary' vs 'John'"]


NOTEBOOK = [
    "import torch\nfrom transformer_lens import HookedTransformer, utils",
    "%pip install transformer_lens",
    'model = HookedTransformer.from_pretrained("distilgpt2", fold_ln=True)',
    'tokens = model.to_tokens("When Mary and John went to the store, John gave a drink to")\n'
    "logits, cache = model.run_with_cache(tokens)\n"
    'print(f"{logits[0, -1].max().item():.4f}")\n'
    'resid = cache["resid_post", -1]\n'
    "logits[0, -1].topk(3).indices",
    'utils.test_prompt("When Mary and John went to the store, John gave a drink to", " Mary", model)',
    'ds = load_dataset("NeelNanda/pile-10k")',
]


@pytest.mark.skipif(not transformer_lens_available(), reason="TransformerLens 2.x is not installed")
def test_a_notebook_runs_equal_on_both(tmp_path: Path) -> None:
    import subprocess

    notebook = tmp_path / "demo.ipynb"
    cells = [{"cell_type": "code", "source": src, "metadata": {}, "outputs": []} for src in NOTEBOOK]
    notebook.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, str(RUNNER), str(notebook), "--json", str(out)], env=env, check=False, timeout=900)
    (report,) = json.loads(out.read_text())
    assert report["failed"] == [] and report["differ"] == []
    assert (report["run"], report["equal"]) == (4, 4)
    assert [(s["cell"], s["why"]) for s in report["skipped"]] == [
        (1, "notebook magics / shell commands only"),
        (5, "needs the network: loads a dataset from the Hugging Face hub"),
    ]
