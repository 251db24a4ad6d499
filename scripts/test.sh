#!/usr/bin/env bash
# Set everything up (first run), lint (scripts/lint.sh: ruff and mypy, first: it fails in about a minute) and run
# the tests: the whole suite (tests/ and every plugins/*/tests, examples/*/tests)
# on the pinned transformers 5.x, then again on transformers 4.57 in a second environment (without the tests marked
# transformers5_only, and those marked one_environment: subprocess jobs of lensadapters' own machinery), then
# sae-bench's, auto-circuit's and sae-dashboard's tests layered over that environment (scripts/setup-tl-clients.sh),
# the client tools' tests in their own environment (scripts/setup-clients.sh), then the wheel check.
# HYPOTHESIS_PROFILE=dev|ci|thorough picks the number of examples (ci by default here); the second environment runs
# HYPOTHESIS_PROFILE_SECOND (ci-short by default: the same derandomized examples, fewer of them).
set -euo pipefail
cd "$(dirname "$0")/.."
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# the two big suites run on every core (pytest-xdist; LENSADAPTERS_TEST_WORKERS=0 runs them in one process), a test
# module or class to a worker (its fixtures are built once)
workers=(-n "${LENSADAPTERS_TEST_WORKERS:-auto}" --dist loadscope)
report=(--durations=25)  # the slowest tests, in the log: where CI time goes
if [ "${LENSADAPTERS_TEST_WORKERS:-auto}" = "0" ]; then workers=(); fi
# the core's tests and every plugin folder's own (found by glob: a new plugin's tests/ runs without a change here)
suites=(tests)
for suite in plugins/*/tests examples/*/tests; do
  if [ -d "$suite" ]; then suites+=("$suite"); fi
done
stage() { printf '== [%d:%02d elapsed] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }  # CI's log times each step
stage "set-up of .venv"
bash scripts/setup.sh .venv
stage "lint"
bash scripts/lint.sh .venv
stage "tests on $(.venv/bin/python -c 'import transformers; print("transformers", transformers.__version__)'): ${suites[*]}"
.venv/bin/python -m pytest -q -p no:cacheprovider "${report[@]}" "${workers[@]}" "${suites[@]}"
stage "set-up of .venv-tf457"
bash scripts/setup.sh .venv-tf457 4.57.6
bash scripts/setup-reference.sh .venv-tf457  # TransformerLens 2.x: the analysis layer is compared with it there
stage "tests again on $(.venv-tf457/bin/python -c 'import transformers; print("transformers", transformers.__version__)')"
HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE_SECOND:-ci-short}" \
  .venv-tf457/bin/python -m pytest -q -p no:cacheprovider "${report[@]}" "${workers[@]}" -m "not transformers5_only and not one_environment" "${suites[@]}"
stage "sae-bench, auto-circuit and sae-dashboard over the TransformerLens environment"
bash scripts/setup-tl-clients.sh .venv-tl-clients .venv-tf457
.venv-tl-clients/bin/python -m pytest -q -p no:cacheprovider tests/test_sae_bench.py tests/test_auto_circuit.py \
  tests/test_client_tools.py
stage "the client tools that take a Hugging Face model (nnterp, tuned-lens, circuit-tracer), in their own environment"
bash scripts/setup-clients.sh .venv-clients
.venv-clients/bin/python -m pytest -q -p no:cacheprovider tests/test_clients_on_hf_model.py
stage "distributions: build wheels and install lensadapters[the first architecture plugin] and [all] from them"
bash scripts/check-wheels.sh .venv
stage "done"
