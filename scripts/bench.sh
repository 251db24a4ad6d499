#!/usr/bin/env bash
# The benchmark against raw Hugging Face and the peers (benchmarks/bench_peers.py), on this machine.
# Sets up two environments on first run:
#   .venv-bench      transformers of constraints.txt, lensadapters, TransformerLens 4 (TransformerBridge), nnsight
#   .venv-bench-tl2  transformers 4.57.6, lensadapters, TransformerLens 2.18 (HookedTransformer needs transformers 4.x)
# Runs twice: glibc defaults, then --keep-freed-memory (timings only).
# Extra arguments go to bench_peers.py (e.g. --rounds 7 --models gpt2). Not part of the tests: run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv-bench > /dev/null
pip=(.venv-bench/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install -c constraints.txt -c benchmarks/constraints-bench.txt -e ".[bench]"
if [ ! -x .venv-bench-tl2/bin/python ]; then
  python3 -m venv .venv-bench-tl2
fi
pip2=(.venv-bench-tl2/bin/python -m pip --disable-pip-version-check -q)
"${pip2[@]}" install "torch==2.13.0"
grep -v '^transformers==' constraints.txt > .venv-bench-tl2/constraints.txt
"${pip2[@]}" install -c .venv-bench-tl2/constraints.txt -c benchmarks/constraints-bench-tl2.txt \
  "transformers==4.57.6" transformer-lens matplotlib "pyarrow<20" -e . $(for p in plugins/*/; do printf -- '-e %s ' "$p"; done)
.venv-bench/bin/python benchmarks/bench_peers.py --tl2-python .venv-bench-tl2/bin/python "$@"
# the same timings with freed memory kept in the process: the libraries' cost without the kernel's page faults
.venv-bench/bin/python benchmarks/bench_peers.py --tl2-python .venv-bench-tl2/bin/python --keep-freed-memory --no-memory "$@"
