#!/usr/bin/env bash
# The house checks that are configuration, not memory (pyproject.toml [tool.ruff], [tool.mypy]); scripts/test.sh
# runs them before the tests, .pre-commit-config.yaml on each commit.
#   ruff check    lint, clean on the whole tree
#   mypy          types of the torch-free layers ([tool.mypy] files)
#   ruff format   formatting (pyproject.toml [tool.ruff.format] lists the modules not formatted yet, and why)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
"$BIN/ruff" check .
"$BIN/mypy"
"$BIN/ruff" format --check .
