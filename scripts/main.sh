#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then runs the built-in default job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m a4prefill e2e "$@"
