#!/usr/bin/env bash
# The Triton backend's CPU tests (interpreter runs of every kernel against the references, and the
# sm_90a compiles with their SASS checks) under another Triton than .venv's: the one a GPU
# machine has (the H200 of issue 23 runs Triton 3.6; .venv has the version torch pins). Catches a
# Gluon or Triton API a kernel module uses that the GPU's Triton lacks, which on the GPU would
# switch that module's kernels off with a warning (kernel_modules), without spending device time.
#
#   bash scripts/test_triton_version.sh 3.6.0 [pytest arguments]
#
# Downloads that Triton's wheel for .venv's Python into .triton/VERSION (ignored by git; about
# 190 MB, once) and puts it before .venv's own on PYTHONPATH; .venv itself is not changed. Needs
# the package index (pip) for the first run.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: bash scripts/test_triton_version.sh VERSION [pytest arguments], e.g. 3.6.0}
shift
site=.triton/$version
if [ ! -f "$site/triton/__init__.py" ]; then
    .venv/bin/python -m pip install -q --no-deps --target "$site" "triton==$version"
fi
PYTHONPATH=$site:src .venv/bin/python -c "import sys, triton
assert triton.__version__ == sys.argv[1], f'imported triton {triton.__version__}, expected {sys.argv[1]}'" "$version"
PYTHONPATH=$site:src exec .venv/bin/python -m pytest -q -p no:cacheprovider -rs \
    tests/test_triton_*.py "$@"
