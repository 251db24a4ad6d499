#!/usr/bin/env bash
# Build every distribution (sdist + wheel, standard build front end), then install lensadapters[ARCH] (the first
# architecture plugin among the root extras) and lensadapters[all] into fresh virtual environments from those files
# only, and check what a user receives. The plugins are discovered: the root extras, plugins/*/pyproject.toml.
# A deliberately incompatible dummy plugin distribution (requires lensadapters>=99) is built too and installed
# next to lensadapters[ARCH]: the registry must refuse it, naming both versions, and ARCH must keep working.
# Usage: scripts/check-wheels.sh [BUILD_VENV]   (default .venv: must have `build`; see scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
build_python="${1:-.venv}/bin/python"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
dist="$work/dist"
projects=(. plugins/*/ examples/*/)
# every distribution declares the core's [build-system] table, so the core and the first plugin built in isolated
# environments (the standard front end: a fresh venv with only the declared build requirements, sdist then wheel
# from the sdist) prove it for all; the others build from the sdist in the build venv (its setuptools satisfies the
# same requirement), a fresh venv each saves most of this step's time
"$build_python" - "${projects[@]}" <<'PY'
import pathlib, sys, tomllib
tables = {p: tomllib.loads((pathlib.Path(p) / "pyproject.toml").read_text()).get("build-system")
          for p in sys.argv[1:] if (pathlib.Path(p) / "pyproject.toml").is_file()}
core = tables["."]
assert core and core.get("requires") and core.get("build-backend"), "the core declares no [build-system]"
differ = [p for p, table in tables.items() if table != core]
assert not differ, f"these distributions' [build-system] differs from the core's {core}: {differ}"
print("build-system: one table for", len(tables), "distributions:", core)
PY
isolated=2
for project in "${projects[@]}"; do
  [ -f "$project/pyproject.toml" ] || continue
  isolation=()
  if [ "$isolated" -gt 0 ]; then isolated=$((isolated - 1)); else isolation=(--no-isolation); fi
  "$build_python" -m build "${isolation[@]}" --outdir "$dist" "$project" > "$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
done
ls "$dist"

# the built-in plugins: each root extra that installs one plugin folder's distribution. Prints the extra of the
# first architecture plugin (in the order of the extras), its entry-point name, its first architecture's name and
# its distribution, then every built-in plugin's entry-point name
read -r single_extra single_plugin single_arch single_dist all_plugins < <("$build_python" - <<'PY'
import importlib, pathlib, tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

extras = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["optional-dependencies"]
folders = {}
for pyproject in sorted(pathlib.Path("plugins").glob("*/pyproject.toml")):
    data = tomllib.loads(pyproject.read_text())
    folders[canonicalize_name(data["project"]["name"])] = (
        data["project"]["name"], data["tool"]["setuptools"]["packages"][0],
        list(data["project"]["entry-points"]["lensadapters"]))
builtin, single = [], None
for extra, requirements in extras.items():
    if len(requirements) != 1 or canonicalize_name(Requirement(requirements[0]).name) not in folders:
        continue
    dist, module, names = folders[canonicalize_name(Requirement(requirements[0]).name)]
    builtin += [name for name in names if name not in builtin]  # a distribution may have two extras (phi, phi3)
    archs = getattr(importlib.import_module(module), "lensadapters_architectures", lambda: [])()
    if single is None and archs:
        single = (extra, names[0], archs[0].name, dist)
assert single and builtin, "no built-in plugin found among the root extras"
print(*single, " ".join(builtin))
PY
)
echo "single-plugin install: lensadapters[$single_extra] ($single_plugin); all: $all_plugins"
# the core sdist carries the core only
core_sdist=$(ls "$dist"/lensadapters-[0-9]*.tar.gz)
if tar tzf "$core_sdist" | grep -E '^[^/]+/(plugins|tests|examples|benchmarks)/'; then
  echo "the core sdist swallowed plugins/, tests/, examples/ or benchmarks/"; exit 1
fi
# every wheel and sdist carries the license (PEP 639 license-files)
"$build_python" - "$dist" <<'PY'
import pathlib, sys, tarfile, zipfile
files = sorted(pathlib.Path(sys.argv[1]).iterdir())
for path in files:
    names = zipfile.ZipFile(path).namelist() if path.suffix == ".whl" else tarfile.open(path).getnames()
    assert any(n.endswith(("/licenses/LICENSE", "/LICENSE")) and n.count("/") <= 2 for n in names), f"{path.name}: no LICENSE"
print("licenses: ok,", len(files), "files")
PY

# a third-party plugin built for a core that does not exist yet: a real distribution, built and installed
dummy="$work/dummy-plugin"
mkdir -p "$dummy"
cat > "$dummy/pyproject.toml" <<'TOML'
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "lensadapters-dummy-incompatible"
version = "0.1.0"
description = "a plugin whose declared core range excludes every lensadapters release (check-wheels.sh)"
requires-python = ">=3.10"
dependencies = ["lensadapters>=99"]

[project.entry-points.lensadapters]
dummy_incompatible = "lensadapters_dummy_incompatible"

[tool.setuptools]
py-modules = ["lensadapters_dummy_incompatible"]
TOML
cat > "$dummy/lensadapters_dummy_incompatible.py" <<'PY'
"""A working plugin (it would load) whose distribution declares lensadapters>=99."""
from lensadapters import Architecture, hookimpl


@hookimpl
def lensadapters_architectures():
    return [Architecture("dummy_incompatible", ("dummy_incompatible",))]
PY
"$build_python" -m build --wheel --outdir "$work/dummy-dist" "$dummy" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
dummy_wheel=$(ls "$work"/dummy-dist/lensadapters_dummy_incompatible-0.1.0-*.whl)

check_install() {  # $1: the requirement to install; $2: the plugin names expected; $3 (optional): a dummy wheel
  local requirement="$1" expected="$2" incompatible="${3:-}" venv="$work/venv-${1//[^a-z0-9]/-}"
  python3 -m venv "$venv"
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install "torch==2.13.0"
  # third-party dependencies from the pinned constraints; lensadapters itself only from the built files
  "${pip[@]}" install -c constraints.txt transformers pluggy einops packaging peft accelerate bitsandbytes
  "${pip[@]}" install -c constraints.txt --no-index --find-links "$dist" "$requirement"
  "$venv/bin/lensadapters" plugins --json > "$venv/plugins.json"
  "$venv/bin/python" - "$venv/plugins.json" "$expected" <<'PY'
import importlib.metadata as md, json, sys
listed = json.load(open(sys.argv[1]))
names = sorted(p["name"] for p in listed["plugins"])
expected = sorted(sys.argv[2].split())
assert names == expected, f"plugins listed {names}, expected {expected}"
assert not listed["failures"], listed["failures"]
installed = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("lensadapters-"))
assert len(installed) == len(expected), f"installed plugin distributions {installed}"
for dist in installed:  # installed from wheels, not from the checkout
    assert "site-packages" in str(md.distribution(dist).locate_file("")), dist
print("ok:", sys.argv[2], "from", installed)
PY
  "$venv/bin/lensadapters" demo
  if [ -n "$incompatible" ]; then check_incompatible "$venv" "$incompatible" "$expected"; fi
  rm -rf "$venv"
}

check_incompatible() {  # $1: a venv with lensadapters installed from the wheels; $2: the dummy wheel; $3: plugins
  local venv="$1" wheel="$2" expected="$3"
  # --no-deps: pip itself would refuse lensadapters>=99; a user gets here with --no-deps, another installer, or a
  # core downgrade after the plugin was installed. The registry is the last line of defence.
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps "$wheel"
  "$venv/bin/lensadapters" plugins --json > "$venv/plugins.json"
  "$venv/bin/lensadapters" demo > "$venv/demo.log"
  cat "$venv/demo.log"
  "$venv/bin/python" - "$venv/plugins.json" "$expected" "$venv/demo.log" "- $single_arch ($single_dist):" <<'PY'
import importlib.metadata as md, json, sys
import lensadapters_dummy_incompatible  # installed and importable: only its declared core range is wrong
dist = md.distribution("lensadapters-dummy-incompatible")
assert "site-packages" in str(dist.locate_file("")), "the dummy plugin is not installed from its wheel"
assert [ep.name for ep in dist.entry_points if ep.group == "lensadapters"] == ["dummy_incompatible"]
core = md.version("lensadapters")
listed = json.load(open(sys.argv[1]))
names = sorted(p["name"] for p in listed["plugins"] if p["kind"] != "failed")
assert names == sorted(sys.argv[2].split()), f"plugins loaded {names}: the incompatible plugin must not load"
failed_rows = [p for p in listed["plugins"] if p["kind"] == "failed"]  # listed, with why it is not used
assert [p["name"] for p in failed_rows] == ["dummy_incompatible"], failed_rows
assert failed_rows[0]["distribution"] == "lensadapters-dummy-incompatible", failed_rows
assert list(listed["failures"]) == ["dummy_incompatible"], listed["failures"]
message = listed["failures"]["dummy_incompatible"]
for part in ("lensadapters-dummy-incompatible 0.1.0", "requires lensadapters>=99", f"installed lensadapters is {core}"):
    assert part in message, f"{part!r} not in the refusal message: {message}"
demo = open(sys.argv[3]).read()
assert sys.argv[4] in demo and "bitwise equal: yes" in demo, demo
assert f"! {message}" in demo, "the demo does not report the refused plugin"
print("ok: incompatible plugin refused:", message)
PY
}
# the two installs side by side (each is mostly pip unpacking wheels), each into its own log, printed in order
check_install "lensadapters[$single_extra]" "$single_plugin" "$dummy_wheel" > "$work/install-single.log" 2>&1 &
single=$!
check_install "lensadapters[all]" "$all_plugins" > "$work/install-all.log" 2>&1 &
all=$!
failed=0
wait "$single" || failed=1
cat "$work/install-single.log"
wait "$all" || failed=1
cat "$work/install-all.log"
[ "$failed" = 0 ] || { echo "wheels: an install from the built files failed (above)"; exit 1; }
echo "wheels: ok"
