"""The GPU clock sampler of ``benchmarks/bench_moe.py`` (``benchmarks/gpu_clocks.py``, no GPU):
what it reads from ``nvidia-smi`` lines, how it runs the tool, and that a machine without the
tool gets no clocks and no error."""

from __future__ import annotations

import math
import stat
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.scripts import load_benchmark

clocks = load_benchmark("gpu_clocks")


def test_the_summary_reads_clock_power_temperature_and_reasons_and_skips_what_does_not_parse():
    """Three busy samples (the H200 at the power cap in two), an idle one, a line of ``[N/A]`` and
    a stray line: nearest-rank quantiles of the busy three, the largest power and temperature,
    samples per reason, the idle sample counted apart."""
    lines = [
        "1980, 650.0, 55, 0x0000000000000000\n",
        "1965, 690.5, 58, 0x0000000000000004\n",
        "[N/A], [N/A], 60, 0x0000000000000000\n",
        "345, 80.0, 40, 0x0000000000000001\n",
        "1770, 703.2, 62, 0x0000000000000004\n",
        "Failed to initialize NVML\n",
    ]
    assert clocks.summarize(lines) == {
        "samples": 3,
        "sm_mhz_p10_p50_p90": [1770.0, 1965.0, 1980.0],
        "power_w_p50_max": [690.5, 703.2],
        "temperature_c_max": 62.0,
        "clock_event_reasons": {"0x0": 1, "0x4 (SW power cap)": 2},
        "idle_samples": 1,
    }
    assert clocks.summarize(lines[2:4] + lines[5:]) is None  # nothing busy


def test_a_window_summarizes_only_the_lines_that_arrived_in_it():
    sampler = clocks.ClockSampler("unused")
    sampler.samples = [
        (1.0, "1980, 600.0, 50, 0x0\n"),
        (2.0, "1800, 700.0, 60, 0x4\n"),
        (3.0, "1900, 650.0, 55, 0x0\n"),
    ]
    window = sampler.summary(1.5, 2.5)
    assert window is not None and window["samples"] == 1 and window["sm_mhz_p10_p50_p90"] == [1800.0] * 3
    everything = sampler.summary()
    assert everything is not None and everything["samples"] == 3
    assert sampler.summary(3.5, 4.0) is None


@pytest.mark.parametrize(
    ("mask", "name"),
    [
        (0x0, "0x0"),
        (0x4, "0x4 (SW power cap)"),
        (0x44, "0x44 (SW power cap, HW thermal slowdown)"),
        (0x100, "0x100"),
    ],
)
def test_reason_bits_are_named(mask, name):
    assert clocks.reason_names(mask) == name


@given(
    values=st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=50),
    q=st.floats(min_value=0.0, max_value=1.0),
)
def test_a_quantile_is_the_smallest_value_with_at_least_that_share_at_or_below_it(values, q):
    result = clocks.quantile(values, q)
    need = max(1, math.ceil(len(values) * q))
    assert result in values
    assert sum(v <= result for v in values) >= need
    assert all(sum(v <= smaller for v in values) < need for smaller in values if smaller < result)


def test_the_sampler_runs_the_query_in_a_loop_and_stops_it_when_the_block_ends(tmp_path):
    """A stand-in ``nvidia-smi`` that records its arguments, prints two samples and would run on:
    the block's summary has both, the tool was asked for the four fields in a loop on one GPU,
    and it is not running after the block."""
    arguments = tmp_path / "arguments"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {arguments}\n'
        'echo "1830, 699.0, 61, 0x0000000000000004"\n'
        'echo "1845, 698.0, 61, 0x0000000000000004"\n'
        "exec sleep 30\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with clocks.ClockSampler(str(fake)) as sampler:
        deadline = time.monotonic() + 10
        while len(sampler.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    process = sampler._process
    assert process is not None and process.poll() is not None
    summary = sampler.summary()
    assert summary is not None
    assert summary["samples"] == 2 and summary["sm_mhz_p10_p50_p90"] == [1830.0, 1830.0, 1845.0]
    recorded = arguments.read_text().split()
    assert f"--query-gpu={clocks.QUERY}" in recorded
    assert f"--loop-ms={clocks.INTERVAL_MS}" in recorded and "--format=csv,noheader,nounits" in recorded
    assert any(argument.startswith("--id=") for argument in recorded)


def test_without_nvidia_smi_the_sampler_gives_no_clocks_and_no_error(monkeypatch):
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    with clocks.ClockSampler() as sampler:
        assert sampler.command is None
    assert sampler.summary() is None


def test_an_nvidia_smi_that_cannot_run_gives_no_clocks_and_no_error(tmp_path):
    tool = tmp_path / "nvidia-smi"
    tool.write_text("not a program")  # not executable
    with clocks.ClockSampler(str(tool)) as sampler:
        time.sleep(0.05)
    assert sampler.summary() is None


def test_the_benchmark_table_shows_the_w4a16_clock_in_a_column_of_its_own(monkeypatch):
    """``bench_moe.py --table``: every line of a shape's table has the header's number of cells,
    the last one W4A16's SM clock (p10 / p50 / p90 MHz) or ``-`` for a row without clocks."""
    from helpers.scripts import BENCHMARKS

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # bench_moe imports its sibling modules
    bench = load_benchmark("bench_moe")
    busy = clocks.summarize(["1770, 703.2, 62, 0x4", "1965, 690.5, 58, 0x4", "1980, 650.0, 55, 0x0"])
    rows = [
        {"tokens": 512, "experts_hit": 288, "w4a16_us": 1100.0, "w4a16_clocks": busy},
        {"tokens": 1024, "experts_hit": 288, "w4a16_us": 1400.0},
    ]
    shape = {"hidden": 4096, "intermediate": 1024, "experts": 288, "top_k": 8}
    table = bench.markdown_table({"copy_GBps": 4200.0, "shapes": {"glm": {"shape": shape, "rows": rows}}})
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len(lines) == 4
    assert len({line.count("|") for line in lines}) == 1
    assert lines[0].rstrip(" |").endswith("SM MHz p10 / p50 / p90")
    assert lines[2].rstrip(" |").endswith("| 1770 / 1965 / 1980")
    assert lines[3].rstrip(" |").endswith("| -")
