#!/usr/bin/env bash
# Install the TransformerLens 2.x reference (HookedTransformer), SAELens and matplotlib into a transformers-4.57
# environment made by scripts/setup.sh, for the comparisons in tests/test_tl_reference.py and the SAELens tests
# (they skip where these are missing). TransformerLens 2.x and SAELens need transformers 4.x, numpy < 2 and
# pyarrow < 20 (so an older datasets); the pins are constraints.txt's (torch, transformers) and
# benchmarks/constraints-bench-tl2.txt's (transformer-lens, sae-lens, datasets).
# Usage: scripts/setup-reference.sh VENV_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:?usage: scripts/setup-reference.sh VENV_DIR (a transformers-4.57 environment from scripts/setup.sh)}"
python="$venv/bin/python"
version="$("$python" -c 'import transformers; print(transformers.__version__)')"
case "$version" in
  4.*) ;;
  *) echo "scripts/setup-reference.sh: $venv has transformers $version; TransformerLens 2.x needs 4.x" >&2; exit 1 ;;
esac
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
grep -v -e '^transformers==' -e '^datasets==' constraints.txt > "$constraints"
echo "transformers==$version" >> "$constraints"
"$python" -m pip --disable-pip-version-check -q install -c "$constraints" -c benchmarks/constraints-bench-tl2.txt \
  transformer-lens sae-lens datasets matplotlib "numpy<2" "pyarrow<20"  # matplotlib: the demo's --plot is tested here too
"$python" -c "import transformer_lens, transformers; print('transformer_lens', transformer_lens.__version__ if hasattr(transformer_lens, '__version__') else '2.x', '| transformers', transformers.__version__)"
