#!/usr/bin/env bash
# Set everything up (first run) and run the main job: lensadapters demo on built-in tiny models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv
.venv/bin/lensadapters demo
