#!/usr/bin/env bash
# Layer the TransformerLens clients sae-bench 0.6.0, auto-circuit 1.0.1 and sae-dashboard 0.8.0 over an environment with lensadapters, TransformerLens 2.x and sae-lens (the second CI
# environment, .venv-tf457, made by scripts/setup.sh + scripts/setup-reference.sh), for tests/test_sae_bench.py,
# tests/test_auto_circuit.py and tests/test_client_tools.py.
# sae-bench's declared requirements cannot be resolved next to that environment (it wants pandas >= 2.1.2,
# TransformerLens 2.18 declares pandas < 2.1; and datasets < 4), so sae-bench and sae-probes are installed without
# their dependencies, and the ones the tested paths import are installed by name; auto-circuit too (it pins
# kaleido==0.2.1 and pulls tracr and word2word, which its EAP does not import), and sae-dashboard (it declares
# transformers < 4.57; its feature dashboards run unchanged on 4.57.6): datasets 3.6 in the overlay,
# everything else at the base's versions (torch, transformers, TransformerLens, sae-lens, pandas 2.0).
# Usage: scripts/setup-tl-clients.sh [VENV_DIR] [BASE_VENV]   (defaults .venv-tl-clients, .venv-tf457)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-tl-clients}"
base="${2:-.venv-tf457}"
source scripts/venv-lib.sh
venv_with_pip "$venv"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# the base's site directory with its own .pth files (its editable installs of lensadapters and the plugins)
"$base/bin/python" -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
  > "$site/base-environment.pth"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$base/bin/python" -m pip --disable-pip-version-check freeze --exclude-editable | grep -v -e '@' \
  -e '^datasets==' -e '^pandas==' > "$constraints"
"${pip[@]}" install --no-deps "sae-bench==0.6.0" "sae-probes==0.4.2" "auto-circuit==1.0.1" "sae-dashboard==0.8.0" \
  "eindex-callum==0.1.2" "decode-clt==0.0.1"
"${pip[@]}" install -c "$constraints" "datasets==3.6.0" beartype collectibles jaxtyping openai plotly pydantic \
  scikit-learn seaborn tabulate ordered-set blobfile vscode-tqdm dataclasses-json rich typer
"$venv/bin/python" -c "import auto_circuit.prune_algos.mask_gradient, sae_bench, sae_dashboard, transformer_lens, lensadapters, transformers; print('sae-bench, auto-circuit, sae-dashboard ok | transformers', transformers.__version__)"
