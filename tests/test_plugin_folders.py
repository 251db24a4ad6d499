"""A built-in plugin is one folder: outside ``plugins/<name>/`` only the root ``pyproject.toml`` (its extra) names
it. Scripts, CI, the demo, the CLI and the test matrices find plugins by discovery (entry points, a glob over
``plugins/*/``, the contract variants plugins declare); a plugin names no other plugin.

"Naming" a plugin is writing its module (``lensadapters_<name>``), its distribution (``lensadapters-<name>``,
underscores as dashes) or its folder (``plugins/<name>``). The root README, the changelog, ``docs/`` and
``benchmarks/`` (prose and measurements about the plugins) are left out.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.parent.name for p in ROOT.glob("plugins/*/pyproject.toml"))
ALLOWED = {"pyproject.toml"}


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (the tracked files are unknown)")
    return [f for f in out.decode().split("\0") if f]


def _prose_or_measurements(path: str) -> bool:
    return path in ("README.md", "CHANGELOG.md") or path.startswith(("docs/", "benchmarks/"))


def places_naming(name: str, files: list[str]) -> list[str]:
    """The tracked files outside ``plugins/<name>/`` (prose and measurements aside) that name plugin ``name``."""
    # the lookahead applies to every spelling: a plugin is not named by a longer name it prefixes
    pattern = re.compile(
        "(?:"
        + "|".join(
            re.escape(s) for s in (f"lensadapters_{name}", f"lensadapters-{name.replace('_', '-')}", f"plugins/{name}")
        )
        + r")(?![\w-])"
    )
    found = []
    for path in files:
        if path.startswith(f"plugins/{name}/") or _prose_or_measurements(path) or not (ROOT / path).is_file():
            continue
        try:
            text = (ROOT / path).read_text()
        except UnicodeDecodeError:  # binary files (images) name nothing
            continue
        if pattern.search(text):
            found.append(path)
    return found


def test_a_plugin_is_not_named_by_a_longer_name_it_prefixes(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("import lensadapters_fam_moe  # lensadapters-fam-moe, plugins/fam_moe\n")
    (tmp_path / "b.py").write_text("import lensadapters_fam.testing\n")
    monkeypatch.setitem(places_naming.__globals__, "ROOT", tmp_path)
    assert places_naming("fam", ["a.py", "b.py"]) == ["b.py"]


def test_plugins_are_found():
    assert PLUGINS, "no plugin folder (plugins/*/pyproject.toml)"


@pytest.mark.parametrize("name", PLUGINS)
def test_a_builtin_plugin_is_named_only_by_its_folder_and_the_root_extras(name):
    found = places_naming(name, _tracked_files())
    assert set(found) <= ALLOWED, (
        f"plugins/{name} is named outside its folder in {sorted(set(found) - ALLOWED)}: discover it instead (entry "
        f"points, a glob over plugins/*/, lensadapters_contract_variants)"
    )
    assert "pyproject.toml" in found, f"the root pyproject.toml has no extra for plugins/{name}"
