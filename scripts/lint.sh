#!/usr/bin/env bash
# The house checks that are configuration, not memory (pyproject.toml [tool.ruff], [tool.mypy]); scripts/test.sh
# runs them before the tests, .pre-commit-config.yaml on each commit.
#   ruff check    lint, clean on the whole tree
#   mypy          types of the torch-free layers ([tool.mypy] files)
#   ruff format   formatting: checked once the tree is formatted (see FORMAT_CHECK below)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
"$BIN/ruff" check .
"$BIN/mypy"
# FORMAT_CHECK: 0 until the tree is formatted in one commit (`.venv/bin/ruff format .`); then set it to 1,
# so a badly formatted file fails CI like a lint error.  Until then it only reports how many files differ.
FORMAT_CHECK=0
if [ "$FORMAT_CHECK" = 1 ]; then
  "$BIN/ruff" format --check .
else
  "$BIN/ruff" format --check --quiet . >/dev/null 2>&1 || echo "lint: ruff format --check is not enforced yet" >&2
fi
