#!/usr/bin/env bash
# Run the tests that need vLLM, in .venv-vllm (scripts/setup-vllm.sh builds it): the `vllm`-marked
# end-to-end tests with the real engine (the connector in one process, and `kvhub serve`'s two
# servers), plus the transformers-compatibility and serving unit tests under the transformers version
# vLLM pins.  Extra arguments go to pytest (`-k serve` runs the kvhub serve test only).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
  echo "no $VENV: run scripts/setup-vllm.sh first" >&2
  exit 2
fi
pytest_group() {  # exit status 5 = a -k filter selected nothing in this group, which is not a failure
  "$VENV/bin/python" -m pytest -q "$@" || [ $? -eq 5 ]
}
pytest_group tests/core/test_capture_compat.py tests/serving/test_serving_kvstore.py "$@"
pytest_group -m vllm tests/serving/test_vllm_connector.py tests/serving/test_vllm_serve.py tests/serving/test_forced.py "$@"
