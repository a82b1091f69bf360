#!/usr/bin/env bash
# Every GPU test, on a CUDA machine where the package is importable together with torch, triton,
# pytest, hypothesis and a CUDA build of vLLM (the vLLM tests skip, with the reason, without it):
# the Triton backend, CUDA-graph semantics of a compiled model, the real vLLM CUDA engine end to
# end. Extra arguments go to pytest. Writes nothing but pytest's output.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER="${VLLM_USE_FLASHINFER_SAMPLER:-0}"
python -m pytest -q -p no:cacheprovider -rs -m gpu tests "$@"
