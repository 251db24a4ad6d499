#!/usr/bin/env bash
# Create (or reuse) a virtual environment with lensadapters, every plugin folder (plugins/*/, examples/*/) and the
# pinned dependencies.
# Usage: scripts/setup.sh [VENV_DIR] [TRANSFORMERS_PIN]   (defaults: .venv, the version in constraints.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
transformers_pin="${2:-}"
source scripts/venv-lib.sh
venv_with_pip "$venv"
# torch first: the CPU build of 2.13.0 (a bare "torch" requirement would pull a multi-GB CUDA build)
"${pip[@]}" install "torch==2.13.0"
constraints=constraints.txt
if [ -n "$transformers_pin" ]; then
  constraints="$(mktemp)"
  grep -v -e '^transformers==' -e '^datasets==' constraints.txt > "$constraints"
  echo "transformers==$transformers_pin" >> "$constraints"
  # the pinned datasets needs huggingface-hub 1.x, transformers 4.x needs < 1: the TransformerLens environment's pin
  grep '^datasets==' benchmarks/constraints-bench-tl2.txt >> "$constraints"
fi
# every plugin folder of the checkout (the built-in plugins and the example third-party one), editable
projects=()
for project in plugins/*/ examples/*/; do
  if [ -f "$project/pyproject.toml" ]; then projects+=(-e "$project"); fi
done
"${pip[@]}" install -c "$constraints" -e ".[all,testing]" "${projects[@]}"
"${pip[@]}" install -c "$constraints" build setuptools ruff mypy import-linter pytest-xdist  # wheel check; scripts/lint.sh; scripts/test.sh runs the suites on every core
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
