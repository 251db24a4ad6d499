#!/usr/bin/env bash
# Build every distribution (sdist + wheel, standard build front end), then install lensadapters[llama] and
# lensadapters[all] into fresh virtual environments from those files only, and check what a user receives.
# Usage: scripts/check-wheels.sh [BUILD_VENV]   (default .venv: must have `build`; see scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
build_python="${1:-.venv}/bin/python"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
dist="$work/dist"
projects=(. plugins/*/ examples/*/)
for project in "${projects[@]}"; do
  [ -f "$project/pyproject.toml" ] || continue
  "$build_python" -m build --outdir "$dist" "$project" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
done
ls "$dist"
# the core sdist carries the core only
core_sdist=$(ls "$dist"/lensadapters-[0-9]*.tar.gz)
if tar tzf "$core_sdist" | grep -E '^[^/]+/(plugins|tests|examples|benchmarks)/'; then
  echo "the core sdist swallowed plugins/, tests/, examples/ or benchmarks/"; exit 1
fi

check_install() {  # $1: the requirement to install; $2: the plugin names expected
  local requirement="$1" expected="$2" venv="$work/venv-$RANDOM"
  python3 -m venv "$venv"
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install "torch==2.13.0"
  # third-party dependencies from the pinned constraints; lensadapters itself only from the built files
  "${pip[@]}" install -c constraints.txt transformers pluggy einops packaging peft accelerate bitsandbytes
  "${pip[@]}" install -c constraints.txt --no-index --find-links "$dist" "$requirement"
  "$venv/bin/lensadapters" plugins --json > "$work/plugins.json"
  "$venv/bin/python" - "$work/plugins.json" "$expected" <<'PY'
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
  rm -rf "$venv"
}
check_install "lensadapters[llama]" "llama"
check_install "lensadapters[all]" "gpt2 gpt_neox opt llama peft bnb"
echo "wheels: ok"
