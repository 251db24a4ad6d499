"""Release consistency: versions agree, plugin core ranges are enforced, distributions are well formed."""

import re
import textwrap
import tomllib
from pathlib import Path

import pytest

import lensadapters
from lensadapters import Registry
from lensadapters.registry import PluginLoadWarning

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml")) + sorted(
    p.parent for p in ROOT.glob("examples/*/pyproject.toml"))


def _module_version(plugin_dir: Path) -> str:
    project = tomllib.loads((plugin_dir / "pyproject.toml").read_text())
    module = project["tool"]["setuptools"]["packages"][0]
    text = (plugin_dir / module / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def test_every_distribution_has_the_core_version_and_a_compatible_core_range():
    from packaging.requirements import Requirement

    assert PLUGIN_DIRS, "no plugin distributions found"
    for plugin_dir in PLUGIN_DIRS:
        assert _module_version(plugin_dir) == lensadapters.__version__, plugin_dir.name
        project = tomllib.loads((plugin_dir / "pyproject.toml").read_text())["project"]
        core = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "lensadapters"]
        assert core and core[0].specifier.contains(lensadapters.__version__), plugin_dir.name
        assert (plugin_dir / "README.md").exists(), f"{plugin_dir.name} needs a README (its long description)"
        assert project.get("readme") == "README.md", plugin_dir.name
        assert project.get("urls", {}).get("Homepage"), f"{plugin_dir.name} needs project URLs"
        assert any(c.startswith("Development Status") for c in project.get("classifiers", ())), plugin_dir.name
        assert project.get("requires-python") and project.get("license"), plugin_dir.name


def test_changelog_names_the_current_version():
    assert f"## {lensadapters.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_root_extras_point_at_plugin_floors():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra in ("gpt2", "gpt-neox", "opt", "llama"):
        (req,) = [Requirement(r) for r in extras[extra]]
        assert req.name == f"lensadapters-{extra}" and req.specifier.contains(lensadapters.__version__)
    assert {Requirement(r).name for r in extras["all"]} >= {f"lensadapters-{e}" for e in ("gpt2", "gpt-neox", "opt", "llama")}


def _install_dummy(path: Path, requires: str) -> None:
    """A plugin distribution installed into ``path`` (dist-info + module), as pip would lay it out."""
    (path / "lensadapters_dummy.py").write_text(textwrap.dedent("""
        from lensadapters import Architecture, hookimpl

        @hookimpl
        def lensadapters_architectures():
            return [Architecture("dummy", ("dummy",))]
    """))
    info = path / "lensadapters_dummy-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: lensadapters-dummy\nVersion: 0.1.0\n"
                                   f"Requires-Dist: {requires}\n")
    (info / "entry_points.txt").write_text("[lensadapters]\ndummy = lensadapters_dummy\n")
    (info / "RECORD").write_text("")


def test_plugin_built_for_an_incompatible_core_is_refused_naming_both_versions(tmp_path, monkeypatch):
    _install_dummy(tmp_path, "lensadapters>=99,<100")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry()
    with pytest.warns(PluginLoadWarning) as warned:
        registry.load_entry_points()
    message = " ".join(str(w.message) for w in warned)
    assert "lensadapters-dummy 0.1.0 requires lensadapters<100,>=99" in message
    assert f"installed lensadapters is {lensadapters.__version__}" in message
    assert "dummy" not in registry.infos


def test_plugin_with_a_compatible_core_range_loads(tmp_path, monkeypatch):
    _install_dummy(tmp_path, f"lensadapters>={lensadapters.__version__},<1")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry()
    registry.load_entry_points()
    assert registry.infos["dummy"].distribution == "lensadapters-dummy"
    assert registry.infos["dummy"].architectures[0].name == "dummy"
