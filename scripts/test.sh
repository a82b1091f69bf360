#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then lint, format check, type check, the import rules
# (import-linter contracts in pyproject.toml) and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports
.venv/bin/python -m pytest -q "$@"
