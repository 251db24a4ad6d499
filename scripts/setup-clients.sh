#!/usr/bin/env bash
# Create (or reuse) the environment of the client tools that take a Hugging Face model: nnterp, tuned-lens and
# circuit-tracer's nnsight backend (and circuitsvis), pinned in constraints-clients.txt (their pins conflict with the main
# environment's transformers 5), with lensadapters and every plugin folder editable.
# Usage: scripts/setup-clients.sh [VENV_DIR]   (default .venv-clients); then
#   VENV_DIR/bin/python -m pytest tests/test_clients_on_hf_model.py
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-clients}"
source scripts/venv-lib.sh
venv_with_pip "$venv"
"${pip[@]}" install "torch==2.13.0"  # the CPU build first (see scripts/setup.sh)
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
grep -v -e '^transformers==' -e '^datasets==' -e '^transformer-lens==' -e '^numpy==' constraints.txt > "$constraints"
# every plugin folder, editable and without dependencies (as scripts/setup.sh finds them)
projects=()
for project in plugins/*/ examples/*/; do
  if [ -f "$project/pyproject.toml" ]; then projects+=(-e "$project"); fi
done
"${pip[@]}" install -c "$constraints" -c constraints-clients.txt -e ".[testing]" nnsight nnterp tuned-lens circuit-tracer
"${pip[@]}" install --no-deps "${projects[@]}"
# circuitsvis declares a torch requirement that pulls CUDA wheels: without its dependencies, numpy and
# importlib-metadata by hand
"${pip[@]}" install -c "$constraints" -c constraints-clients.txt importlib-metadata numpy
"${pip[@]}" install -c constraints-clients.txt --no-deps circuitsvis
"$venv/bin/python" -c "import circuitsvis, nnterp, tuned_lens, circuit_tracer, transformers; print('clients ok | transformers', transformers.__version__)"
