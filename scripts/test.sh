#!/usr/bin/env bash
# Set everything up (first run) and run the tests: the whole suite on the pinned transformers 5.x, then the
# equivalence suites again on transformers 4.57 in a second environment, which also has TransformerLens 2.x for the
# comparisons of tests/test_tl_reference.py.
# HYPOTHESIS_PROFILE=dev|ci|thorough picks the number of examples (ci by default here).
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
bash scripts/setup.sh .venv
echo "== tests on $(.venv/bin/python -c 'import transformers; print("transformers", transformers.__version__)')"
.venv/bin/python -m pytest -q -p no:cacheprovider tests examples/gptj/tests
bash scripts/setup.sh .venv-tf457 4.57.6
bash scripts/setup-reference.sh .venv-tf457  # TransformerLens 2.x: the analysis layer is compared with it there
echo "== equivalence tests on $(.venv-tf457/bin/python -c 'import transformers; print("transformers", transformers.__version__)')"
.venv-tf457/bin/python -m pytest -q -p no:cacheprovider -m "not transformers5_only" tests examples/gptj/tests
echo "== distributions: build wheels and install lensadapters[llama] / [all] from them"
bash scripts/check-wheels.sh .venv
