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
    """An ``ncu --csv`` report: a line ncu prints before the table, then one row per metric."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 1\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(HEADER)
    for launch_id, (name, duration) in enumerate(launches):
        for metric, unit, value in (("Duration", "ns", duration), ("DRAM Frequency", "hz", "1")):
            writer.writerow((launch_id, 1, name, "(256, 1, 1)", "(8, 2, 1)", "SOL", metric, unit, value))
    path.write_text(out.getvalue())
    return path


def test_the_summary_keeps_every_gemm_launch_in_launch_order(profile, tmp_path):
    """Before: the Hopper prefill GEMMs (``grouped_w4_gemm*``) were left out, so the profile of
    4096-16384 tokens had Marlin's rows and none of the package's."""
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
