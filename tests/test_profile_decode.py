"""The Nsight Compute summary of ``benchmarks/profile_decode.py`` (no GPU): which launches of an
``ncu --csv`` report it keeps, in which order, with which metrics."""

from __future__ import annotations

import csv
import io

import pytest

from helpers.scripts import load_benchmark

HEADER = (
    "ID",
    "Process ID",
    "Kernel Name",
    "Block Size",
    "Grid Size",
    "Section Name",
    "Metric Name",
    "Metric Unit",
    "Metric Value",
)


@pytest.fixture(scope="module")
def profile():
    return load_benchmark("profile_decode")


def _ncu_csv(path, launches):
    """An ``ncu --csv`` report: lines ncu prints before the table, then one row per metric, and
    after each launch's rows the warning ncu prints for a section with nothing to show (as
    ``--section MemoryWorkloadAnalysis_Tables`` did on the H100 in the thirty-fourth round)."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 1\n==WARNING== Unable to access the following 6 metrics\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(HEADER)
    for launch_id, (name, duration) in enumerate(launches):
        for metric, unit, value in (("Duration", "ns", duration), ("DRAM Frequency", "hz", "1")):
            writer.writerow((launch_id, 1, name, "(256, 1, 1)", "(8, 2, 1)", "SOL", metric, unit, value))
        out.write("==WARNING== No metrics to show for section(s): MemoryWorkloadAnalysis_Tables.\n")
    path.write_text(out.getvalue())
    return path


def test_the_summary_keeps_every_gemm_launch_in_launch_order(profile, tmp_path):
    """Before: the Hopper prefill GEMMs (``grouped_w4_gemm*``) were left out, so the profile of
    4096-16384 tokens had Marlin's rows and none of the package's; and until the thirty-fourth
    round a warning line of ncu's between the rows stopped the summary (``AttributeError``: a
    row without a kernel name)."""
    report = _ncu_csv(
        tmp_path / "ncu.csv",
        [
            ("route_prep_kernel", "3,000"),
            ("grouped_w4_gemm_rs_kernel", "2,000,000"),
            ("grouped_w4_gemm_kernel", "1,000,000"),
            ("fc1_decode_kernel", "500,000"),
            ("void marlin_moe_wna16::Marlin<...>(...)", "900,000"),
            ("combine_kernel", "70,000"),
        ],
    )
    rows = profile.ncu_summary(str(report))
    assert [row["kernel"] for row in rows] == [
        "grouped_w4_gemm_rs_kernel",
        "grouped_w4_gemm_kernel",
        "fc1_decode_kernel",
        "void marlin_moe_wna16::Marlin<...>(...)",
    ]
    assert [row["Duration (ns)"] for row in rows] == ["2,000,000", "1,000,000", "500,000", "900,000"]
    assert all("DRAM Frequency (hz)" not in row and row["grid"] == "(8, 2, 1)" for row in rows)


def test_prefill_tiles_add_the_package_calls_with_those_tiles_in_place_of_the_default(profile):
    """``--prefill-tiles``: each label pair the shape fits becomes a W4A16 and an A4 call (where
    those are profiled) whose config runs that pair and no decode schedule; Marlin is not
    repeated, and no pair adds nothing."""
    from a4prefill.ops.backends.triton.schedules import PREFILL_SCHEDULES

    def package(*args, config=None):
        return config

    fns = {"w4a16": package, "a4": package, "marlin": package}
    shape = profile.SHAPES["glm53flash_tp2"]
    tiles = [("rs_w128_t256_d4_ws_x2_h2_tok", "rs_w128_t256_d4_ws_x2_h2")]
    calls = profile.calls_with_tiles(fns, 8192, shape, tiles)
    fc1, fc2 = (PREFILL_SCHEDULES[label] for label in tiles[0])
    assert sorted(calls) == sorted(f"{p}_prefill_fc1_{fc1}_fc2_{fc2}" for p in ("w4a16", "a4"))
    for fn in calls.values():
        config = fn()
        assert config.decode is None and (config.prefill.fc1, config.prefill.fc2) == (fc1, fc2)
    assert profile.calls_with_tiles(fns, 8192, shape, None) == {}
