#!/usr/bin/env bash
# Compiles every kernel the b12x backend's preparation compiles, for the tiny layer and the
# GLM-5.3-Flash TP2 expert shape, for SM120 (RTX PRO 6000) and SM121 (DGX Spark), on this machine
# (no GPU needed: b12x's compile pool fakes the device), and checks each program's device code.
# Writes benchmarks/results/b12x_compile.json (programs, targets, kernels, seconds). Extra
# arguments go to `python -m a4prefill b12x-compile`. CI compiles a subset (tests/test_b12x_compile.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CUDA_VISIBLE_DEVICES=""
.venv/bin/python -m a4prefill b12x-compile --json benchmarks/results/b12x_compile.json "$@"
