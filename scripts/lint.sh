#!/usr/bin/env bash
# Lint and type-check: ruff (lint rules and formatting, configured in pyproject.toml) over the repository, mypy over
# the core and every plugin package (plugins/*/, examples/*/: found by glob). Needs a venv from scripts/setup.sh.
# Usage: scripts/lint.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
echo "== lint: ruff check, ruff format --check, mypy"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
packages=(lensadapters)
for package in plugins/*/lensadapters_*/ examples/*/lensadapters_*/; do
  if [ -f "$package/__init__.py" ]; then packages+=("$package"); fi
done
"$venv/bin/python" -m mypy "${packages[@]}"
