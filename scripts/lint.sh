#!/usr/bin/env bash
# Lint and type-check: ruff (lint rules and formatting, configured in pyproject.toml) over the repository, the core's
# layers and the absence of import cycles (import-linter: [tool.importlinter] in pyproject.toml), mypy over the core
# and every plugin package (plugins/*/, examples/*/: found by glob). Needs a venv from scripts/setup.sh.
# Usage: scripts/lint.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
echo "== lint: ruff check, ruff format --check, lint-imports, mypy"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/lint-imports"  # the layers of lensadapters/ (README, "Architecture") and no import cycles
packages=(lensadapters)
for package in plugins/*/lensadapters_*/ examples/*/lensadapters_*/; do
  if [ -f "$package/__init__.py" ]; then packages+=("$package"); fi
done
"$venv/bin/python" -m mypy "${packages[@]}"
