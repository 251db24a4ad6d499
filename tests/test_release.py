"""Release consistency: versions agree, plugin core ranges are enforced, distributions are well formed."""

import re
import textwrap
from pathlib import Path

import pytest
import tomllib

import lensadapters
from lensadapters import Registry
from lensadapters.registry import PluginLoadWarning

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml")) + sorted(
    p.parent for p in ROOT.glob("examples/*/pyproject.toml")
)


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


def _plugin_projects() -> dict[str, Path]:
    return {tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"]: d for d in PLUGIN_DIRS}


def test_root_extras_point_at_plugin_floors():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    builtin = {name for name, d in _plugin_projects().items() if d.parent.name == "plugins"}
    assert builtin, "no plugin folder (plugins/*/pyproject.toml) found"
    floors = {}
    for dist in sorted(builtin):  # one extra per plugin distribution of this repository, named after it
        extra = dist.removeprefix("lensadapters-")
        assert extra in extras, f"the core has no extra {extra!r} for {dist}"
        (req,) = [Requirement(r) for r in extras[extra]]
        assert req.name == dist and req.marker is None and not req.extras, req
        # a floor at the current release line, capped below the next minor (0.x: minors may break)
        assert req.specifier.contains(lensadapters.__version__), req
        assert any(s.operator == ">=" for s in req.specifier), f"{req} has no floor"
        assert any(s.operator == "<" for s in req.specifier), f"{req} has no cap"
        floors[dist] = req.specifier
    # `all` is every plugin extra, with the same ranges, and nothing else
    everything = [Requirement(r) for r in extras["all"]]
    assert len(everything) == len({r.name for r in everything}), "duplicate requirement in the `all` extra"
    assert {r.name: r.specifier for r in everything} == floors
    assert all(r.marker is None and not r.extras for r in everything)


def test_every_distribution_ships_its_license_and_the_same_python_classifiers():
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    python = sorted(c for c in root["project"]["classifiers"] if c.startswith("Programming Language :: Python ::"))
    assert "Programming Language :: Python :: 3.10" in python  # requires-python = ">=3.10"
    for directory in [ROOT, *PLUGIN_DIRS]:
        pyproject = tomllib.loads((directory / "pyproject.toml").read_text())
        project = pyproject["project"]
        # PEP 639 license expressions (`license = "MIT"`) and `license-files` need setuptools >= 77
        assert pyproject["build-system"]["requires"] == ["setuptools>=77"], directory
        assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"], directory
        assert (directory / "LICENSE").read_text() == (ROOT / "LICENSE").read_text(), directory
        assert project["requires-python"] == root["project"]["requires-python"], directory
        assert (
            sorted(c for c in project["classifiers"] if c.startswith("Programming Language :: Python ::")) == python
        ), directory
        assert not any(c.startswith("License ::") for c in project["classifiers"]), "PEP 639: no license classifiers"


def test_core_readme_links_work_on_pypi():
    """The core README is the core's long description: its links and images must not be relative."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    relative = [link for link in links if not re.match(r"(https?://|mailto:|#)", link)]
    assert not relative, f"README.md has relative links: {relative}"
    for link in links:  # links into this repository name files that exist
        for kind in ("blob/main/", "tree/main/", "raw.githubusercontent.com/lensadapters/lensadapters/main/"):
            if kind in link:
                path = link.split(kind, 1)[1].split("#")[0]
                assert (ROOT / path).exists(), f"README.md links {link}, but {path} is not in the repository"


@pytest.mark.parametrize("plugin_dir", PLUGIN_DIRS, ids=lambda d: d.name)
def test_plugin_readme_is_a_long_description_that_works_on_pypi(plugin_dir):
    from packaging.requirements import Requirement

    project = tomllib.loads((plugin_dir / "pyproject.toml").read_text())["project"]
    text = (plugin_dir / "README.md").read_text()
    assert text.startswith(f"# {project['name']}\n"), plugin_dir.name
    # which transformers versions it is tested with: the supported floor and the pinned CI version
    (transformers,) = [
        Requirement(r)
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if r.startswith("transformers")
    ]
    floor = next(s.version for s in transformers.specifier if s.operator == ">=")
    pinned = re.search(r"^transformers==(\d+\.\d+)", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    assert "transformers" in text and floor in text and pinned in text, f"{plugin_dir.name}: name tested versions"
    # links must not be relative: on PyPI the README is rendered without the repository around it
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    relative = [link for link in links if not re.match(r"(https?://|mailto:|#)", link)]
    assert not relative, f"{plugin_dir.name}/README.md has relative links: {relative}"
    # the architecture it adds, by model type (a cross-cutting plugin claims none)
    module = pytest.importorskip(
        tomllib.loads((plugin_dir / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][0]
    )
    archs = module.lensadapters_architectures() if hasattr(module, "lensadapters_architectures") else ()
    for arch in archs:
        for model_type in arch.model_types:
            assert (
                model_type.replace("_", "").replace("-", "").lower() in text.replace("_", "").replace("-", "").lower()
            ), f"{plugin_dir.name}/README.md does not name model type {model_type!r}"


def _requiring(requires: list[str]):
    """A stand-in for an installed distribution with these Requires-Dist lines."""

    class Dist:
        version = "0.1.0"
        metadata = {"Name": "lensadapters-dummy"}

    dist = Dist()
    dist.requires = requires
    return dist


def test_core_range_with_an_environment_marker_counts_when_the_marker_holds():
    from lensadapters.registry import _check_core_range

    with pytest.raises(
        ImportError,
        match=r"lensadapters-dummy 0\.1\.0 requires lensadapters>=99, but the installed "
        rf"lensadapters is {re.escape(lensadapters.__version__)}",
    ):
        _check_core_range(_requiring(['lensadapters>=99; python_version >= "3"']))
    with pytest.raises(ImportError, match="requires lensadapters>=99"):
        _check_core_range(_requiring(["torch", 'lensadapters>=99 ; python_version >= "3.0" and extra != "x"']))
    # markers that do not hold here: not a requirement of this installation
    _check_core_range(_requiring(['lensadapters>=99; python_version < "3"']))
    _check_core_range(_requiring(['lensadapters>=99; sys_platform == "no-such-platform"']))
    _check_core_range(_requiring(['lensadapters[testing]>=99; extra == "testing"']))  # only with the plugin's extra
    # compatible, with or without a marker
    _check_core_range(_requiring([f'lensadapters>={lensadapters.__version__}; python_version >= "3"']))
    _check_core_range(_requiring(["lensadapters<1", 'lensadapters[testing]; extra == "testing"']))


def _install_dummy(path: Path, requires: str) -> None:
    """A plugin distribution installed into ``path`` (dist-info + module), as pip would lay it out.

    A fast in-process check; scripts/check-wheels.sh builds a real incompatible dummy distribution and
    pip-installs it next to the lensadapters[llama] wheels."""
    (path / "lensadapters_dummy.py").write_text(
        textwrap.dedent("""
        from lensadapters import Architecture, hookimpl

        @hookimpl
        def lensadapters_architectures():
            return [Architecture("dummy", ("dummy",))]
    """)
    )
    info = path / "lensadapters_dummy-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: lensadapters-dummy\nVersion: 0.1.0\nRequires-Dist: {requires}\n"
    )
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
