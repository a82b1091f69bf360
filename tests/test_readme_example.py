"""The README's plain torch.compile example, run as written, twice in a row with caches on."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.slow


def readme_example() -> str:
    """The first python block under the README's "Plain torch.compile" heading."""
    section = README.read_text().split("## Plain torch.compile", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_plain_torch_compile_example_runs_twice_with_a_warm_cache(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_FORCE_DISABLE_CACHES"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor-cache")
    outputs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        outputs.append(done.stdout)
    for stdout in outputs:
        counters = ast.literal_eval(stdout.splitlines()[0])
        assert counters == {
            (f"model.layers.{i}.mlp.experts", precision): rows
            for i in (0, 1)
            for precision, rows in (("w4a16", 2), ("a4", 700))
        }
    assert "rewrote 2 of 2 MoE nodes" in outputs[0]
    assert "split pass" not in outputs[1]  # served from the warm cache: the pass did not run
    assert any((tmp_path / "inductor-cache").rglob("*")), "the cache folder stayed empty: caching was off"
