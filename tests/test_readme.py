"""Every ```python block of README.md runs as pasted, each in a fresh namespace (on the tiny models it builds).

A block that cannot run here (it downloads a checkpoint, or needs a library of another environment) is preceded by
``<!-- not run: REASON -->``; the reason must say why and which test runs the same calls instead. The quick start
and the mixture-of-experts example always run."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- not run: (?P<reason>.*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks() -> list[tuple[int, str | None, str]]:
    text = (ROOT / "README.md").read_text()
    return [
        (text.count("\n", 0, m.start("code")) + 1, m.group("reason"), m.group("code")) for m in BLOCK.finditer(text)
    ]


BLOCKS = _blocks()
RUN = [(line, code) for line, reason, code in BLOCKS if reason is None]


def test_most_readme_snippets_run_and_the_others_say_why():
    assert len(BLOCKS) == (ROOT / "README.md").read_text().count("```python")
    skipped = [(line, reason) for line, reason, _ in BLOCKS if reason is not None]
    assert len(RUN) >= 2 and BLOCKS[0][1] is None, f"the quick start and the MoE example must run: {skipped}"
    for line, reason in skipped:
        assert len(reason.split()) >= 5 and "test" in reason, (
            f"README.md line {line}: say why the snippet cannot run and which test runs the same calls"
        )


@pytest.mark.parametrize(("line", "code"), RUN, ids=[f"README.md:{line}" for line, _ in RUN])
def test_readme_snippet_runs_as_pasted(line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything a snippet writes stays out of the checkout
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": f"readme_{line}"})
