"""``benchmarks/bench_gather.py`` (no GPU): what it refuses before anything runs, and the plot
helper it shares with ``bench_routing.py``."""

from __future__ import annotations

import json
import sys

import pytest

from helpers.scripts import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as patch:  # bench_gather imports its siblings
        patch.syspath_prepend(str(BENCHMARKS))
        return load_benchmark("bench_gather")


@pytest.mark.parametrize("tokens", ["0", "-8"])
def test_a_token_count_below_one_is_refused_naming_the_argument(bench, monkeypatch, tmp_path, tokens):
    """``--tokens`` with a count below 1 exits naming ``--tokens`` before any CUDA call (this
    machine has no GPU: a CUDA call would raise something else)."""
    monkeypatch.setattr(sys, "argv", ["bench_gather.py", "--out", str(tmp_path), "--tokens", "4096", tokens])
    with pytest.raises(SystemExit, match="--tokens: positive token counts expected"):
        bench.main()


def test_the_result_and_its_plot_are_saved_side_by_side(bench, tmp_path):
    """``line_plot.save_result_and_plot`` writes the result as JSON unchanged and a PNG beside it,
    whatever keys some rows lack."""
    from line_plot import save_result_and_plot

    result = {
        "device": "test",
        "rows": [{"tokens": 1024, "rows_GBps": 2.0, "copy_GBps": 3.0}, {"tokens": 4096, "copy_GBps": 2.5}],
    }
    save_result_and_plot(
        str(tmp_path), "bench_gather", result, "tokens", ["rows_GBps", "copy_GBps"], "tokens", "GB/s"
    )
    assert json.loads((tmp_path / "bench_gather.json").read_text()) == result
    assert (tmp_path / "bench_gather.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
