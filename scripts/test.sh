#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then lint, format check, type check, the import rules
# (import-linter contracts in pyproject.toml) and the test suite on two pytest-xdist workers (the
# tests that start a vLLM engine share one of them: tests/conftest.py). Extra arguments go to
# pytest (``-n 0`` runs everything in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy
.venv/bin/lint-imports
.venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
