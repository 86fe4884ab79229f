#!/usr/bin/env bash
# Create .venv (if missing) and install kvhub with its test extras.
# torch is pinned to the local CPU wheel (2.13.0) unless a CUDA GPU is present, so a fresh machine
# without a GPU never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q "torch<=2.14.1"
  else
    .venv/bin/pip install -q "torch==2.13.0"
  fi
fi
.venv/bin/pip install -q -e ".[dev]"
