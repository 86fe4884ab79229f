#!/usr/bin/env bash
# Run the tests that need vLLM, in .venv-vllm (scripts/setup-vllm.sh builds it): the `vllm`-marked
# end-to-end tests with the real engine, plus the transformers-compatibility and serving unit tests
# under the transformers version vLLM pins.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  echo "no $VENV: run scripts/setup-vllm.sh first" >&2
  exit 2
fi
"$VENV/bin/python" -m pytest -q tests/test_capture_compat.py tests/test_serving_kvstore.py "$@"
"$VENV/bin/python" -m pytest -q -m vllm tests/test_vllm_connector.py "$@"
