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
    ``--section MemoryWorkloadAnalysis_Tables`` did on the H100 in the thirty-fourth round), and
    the profiled program's own log lines on the same stdout (vLLM's Marlin warning came before the
    table in the forty-first round's ``rivals`` report)."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 1\n==WARNING== Unable to access the following 6 metrics\n")
    out.write("WARNING 12-07 09:46:12 [marlin_utils_fp4.py:352] Your GPU does not have native FP4, ...\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(HEADER)
    for launch_id, (name, duration) in enumerate(launches):
        for metric, unit, value in (("Duration", "ns", duration), ("DRAM Frequency", "hz", "1")):
            writer.writerow((launch_id, 1, name, "(256, 1, 1)", "(8, 2, 1)", "SOL", metric, unit, value))
        out.write("==WARNING== No metrics to show for section(s): MemoryWorkloadAnalysis_Tables.\n")
        out.write("INFO 12-07 09:46:13 [loader.py:1] a log line of the profiled program\n")
    path.write_text(out.getvalue())
    return path


def test_the_summary_keeps_every_gemm_launch_in_launch_order(profile, tmp_path):
    """Before: the Hopper prefill GEMMs (``grouped_w4_gemm*``) were left out, so the profile of
    4096-16384 tokens had Marlin's rows and none of the package's; and until the thirty-fourth
    round a warning line of ncu's between the rows stopped the summary (``AttributeError``: a
    row without a kernel name); until the forty-first round a log line of the profiled program
    before the table was read as the header (``KeyError: 'Kernel Name'``)."""
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


def test_the_summary_names_each_launchs_busiest_pipe_and_keeps_humming(profile, tmp_path):
    """Nsight Compute names the busiest pipe only in its ``HighPipeUtilization`` rule's text: the
    summary keeps it per launch (``"ALU 55.7%"``), ignores other rules, keeps the executed
    instructions, and counts Humming's GEMM (``humming<...>``) among the GEMMs but not its input
    kernel. Before: no ``"highest pipe"`` and no Humming row."""
    header = (*HEADER, "Rule Name", "Rule Type", "Rule Description")
    launches = (
        (
            "grouped_w4_gemm_ws_kernel",
            "ALU is the highest-utilized pipeline (55.7%) based on elapsed cycles.",
        ),
        (
            "void humming<MmaOpSM90, Shape<1>>(CUtensorMap)",
            "Tensor is the highest-utilized pipeline (70.2%).",
        ),
        ("process_input_kernel", "ALU is the highest-utilized pipeline (9.0%)."),
    )
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(header)
    for launch_id, (name, rule) in enumerate(launches):
        base = (launch_id, 1, name, "(384, 1, 1)", "(132, 1, 1)")
        writer.writerow(
            (*base, "InstructionStats", "Executed Instructions", "inst", f"{launch_id + 1}000", "", "", "")
        )
        writer.writerow(
            (*base, "ComputeWorkloadAnalysis", "", "", "", "SOLBottleneck", "OPT", "Compute is 90% busy")
        )
        writer.writerow((*base, "ComputeWorkloadAnalysis", "", "", "", "HighPipeUtilization", "INF", rule))
    path = tmp_path / "ncu.csv"
    path.write_text(out.getvalue())
    rows = profile.ncu_summary(str(path))
    assert [(row["highest pipe"], row["Executed Instructions (inst)"]) for row in rows] == [
        ("ALU 55.7%", "1000"),
        ("Tensor 70.2%", "2000"),
    ]
    assert rows[0]["kernel"] == "grouped_w4_gemm_ws_kernel" and rows[1]["kernel"].startswith("void humming<")


def test_humming_asked_for_where_it_cannot_run_is_an_error_naming_the_option(profile, monkeypatch):
    """``--humming`` where ``humming_moe`` has nothing to offer (humming-kernels not importable or
    no sm_90 GPU: it returns ``None``) stops with an error naming ``--humming``, not a profile
    without its column; where it runs, its call is profiled with its tiles compiled for the
    profiled token counts."""
    import humming_baseline

    class Weights:
        w13_input_scale = w2_input_scale = None

        def experts(self):
            return None

    monkeypatch.setattr(profile, "random_weights", lambda *args: Weights())
    monkeypatch.setattr(profile, "marlin_moe", lambda weights: None)
    monkeypatch.setattr(humming_baseline, "humming_moe", lambda weights, token_counts: None)
    shape = profile.SHAPES["glm53flash_tp2"]
    assert sorted(profile.implementations(shape)) == ["w4a16"]
    with pytest.raises(RuntimeError, match="--humming: expected humming-kernels"):
        profile.implementations(shape, humming_tokens=[512, 1024])
    compiled_for = []
    monkeypatch.setattr(
        humming_baseline,
        "humming_moe",
        lambda weights, token_counts: compiled_for.append(token_counts) or print,
    )
    assert profile.implementations(shape, humming_tokens=[512, 1024])["humming"] is print
    assert compiled_for == [[512, 1024]]


def test_a8_asked_for_where_it_cannot_run_is_an_error_naming_the_option(profile, monkeypatch):
    """``--a8`` where the package's A8 cannot run (here: no sm_90 GPU) stops with an error naming
    ``--a8`` and the reason, not a profile without its column; where it can, the A8 call is
    ``fused_moe_a8`` on the same experts with the size's own schedule (none given)."""
    from a4prefill.ops.backends.triton import fused_a8

    class Weights:
        w13_input_scale = w2_input_scale = None

        def experts(self):
            return "the experts"

    monkeypatch.setattr(profile, "random_weights", lambda *args: Weights())
    monkeypatch.setattr(profile, "marlin_moe", lambda weights: None)
    shape = profile.SHAPES["glm53flash_tp2"]
    with pytest.raises(RuntimeError, match=r"--a8: .*sm_90"):
        profile.implementations(shape, a8=True)
    monkeypatch.setattr(fused_a8, "a8_refusal", lambda *args: None)
    call = profile.implementations(shape, a8=True)["a8"]
    assert call.func is fused_a8.fused_moe_a8
    assert call.keywords == {"experts": "the experts", "swiglu_limit": None}
