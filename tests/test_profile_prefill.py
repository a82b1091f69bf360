"""The Nsight Compute source-page summary of ``benchmarks/profile_prefill.py`` (no GPU): per
launch, the stall samples by reason, the instructions with the most samples, the mbarrier waits."""

from __future__ import annotations

import csv
import io

import pytest

from helpers.scripts import load_benchmark

COLUMNS = ("Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")
REASONS = ("stall_long_sb", "stall_barrier", "stall_wait")


@pytest.fixture(scope="module")
def profile():
    return load_benchmark("profile_prefill")


def _source_csv(path, kernels):
    """An ``ncu --page source --csv`` export: per kernel a name line, a header, one row per SASS
    instruction ``(address, sass, executed, samples per reason)``; the not-issued columns empty."""
    out = io.StringIO()
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for name, rows in kernels:
        out.write(f'"Kernel Name","{name}",\n')
        writer.writerow((*COLUMNS, *REASONS, *(f"{r} (Not Issued)" for r in REASONS)))
        for address, sass, executed, per_reason in rows:
            writer.writerow((address, sass, sum(per_reason), executed, *per_reason, *("",) * len(REASONS)))
    path.write_text(out.getvalue())


def test_each_launch_gets_its_stall_shares_top_instructions_and_mbarrier_waits(profile, tmp_path):
    path = tmp_path / "source.csv"
    first = [
        ("0x7f0000000010", "      SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6], R20", 10, (1, 0, 0)),
        ("0x7f0000000020", "      HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR16], R24", 10, (0, 0, 2)),
        ("0x7f0000000030", "      WARPGROUP.DEPBAR.LE gsb0, 0x0", 10, (0, 6, 1)),
        ("0x7f0000000040", "      SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6], R20", 95, (0, 0, 0)),
    ]
    second = [("0x7f0000000050", "      BRA 0x7f0000000050", 3, (4, 0, 0))]
    _source_csv(path, [("grouped_w4_gemm_ws_kernel", first), ("grouped_w4_gemm_rs_kernel", second)])
    ws, rs = profile.source_summary(str(path))
    assert ws["kernel"] == "grouped_w4_gemm_ws_kernel" and ws["samples"] == 10
    assert list(ws["stall_share"].items()) == [("barrier", 0.6), ("wait", 0.3), ("long_sb", 0.1)]
    assert [(t["address"], t["samples"], t["reasons"][0]) for t in ws["top"][:3]] == [
        ("00030", 7, "barrier"),
        ("00020", 2, "wait"),
        ("00010", 1, "long_sb"),
    ]
    assert ws["top"][0]["sass"] == "WARPGROUP.DEPBAR.LE gsb0, 0x0" and ws["top"][0]["executed"] == 10
    waits = [(wait["address"], wait["executed"]) for wait in ws["mbarrier_waits"]]
    assert waits == [("00010", 10), ("00040", 95)]
    assert rs["kernel"] == "grouped_w4_gemm_rs_kernel" and rs["stall_share"] == {"long_sb": 1.0}
    assert rs["mbarrier_waits"] == []


def test_a_case_names_tokens_a_schedule_and_optionally_the_moe_fc1_mode(profile):
    """``TOKENS:SCHEDULE[:MODE]``: a W4A16 schedule with or without a mode, an A8 schedule
    without; anything else exits naming the case before the GPU is touched."""
    assert profile.parse_case("4096:rs_w256_t128_d6_ws") == (4096, "rs_w256_t128_d6_ws", None)
    assert profile.parse_case("4096:rs_w128_t128_d6_ws:a4") == (4096, "rs_w128_t128_d6_ws", "a4")
    assert profile.parse_case("8192:a8_rs") == (8192, "a8_rs", None)
    wrong = ("4096", "4096:nope", "4096:a8:a4", "4096:rs_w128_t128_d6_ws:a8", "x:a8", "0:a8", "1:a8:w4a16:a4")
    for case in wrong:
        with pytest.raises(SystemExit, match=f"--case {case}"):
            profile.parse_case(case)


def test_a_default_case_names_the_schedule_the_moe_call_of_that_size_runs(profile):
    """``TOKENS:default:MODE`` resolves to the FC1 schedule of ``choose_prefill_tiles`` for a call
    of that size (GLM-5.3-Flash TP2: 288 experts, top-8) in that mode, ``TOKENS:default_a8`` to
    ``choose_a8_schedule``'s; sizes below the prefill tiles (the decode kernels run them), a
    default without its mode or with one after ``default_a8`` exit naming the case."""
    from a4prefill.ops.backends.triton.schedules import (
        A8_SCHEDULES,
        PREFILL_SCHEDULES,
        choose_a8_schedule,
        choose_prefill_tiles,
    )

    for tokens, mode in ((1024, "w4a16"), (2048, "split"), (4096, "w4a16"), (4096, "a4"), (16384, "w4a16")):
        parsed_tokens, label, parsed_mode = profile.parse_case(f"{tokens}:default:{mode}")
        assert (parsed_tokens, parsed_mode) == (tokens, mode)
        assert PREFILL_SCHEDULES[label] == choose_prefill_tiles(tokens * 8, 288, 4096, 1024).fc1, tokens
    for tokens in (1024, 8192):
        parsed_tokens, label, parsed_mode = profile.parse_case(f"{tokens}:default_a8")
        assert (parsed_tokens, parsed_mode) == (tokens, None)
        assert A8_SCHEDULES[label] == choose_a8_schedule(tokens * 8, 288, 4096), tokens
    assert choose_prefill_tiles(384 * 8, 288, 4096, 1024) is None
    for case in (
        "384:default:w4a16",
        "1024:default",
        "1024:default_a8:w4a16",
        "1024:default:a8",
        "0:default:a4",
    ):
        with pytest.raises(SystemExit, match=f"--case {case}"):
            profile.parse_case(case)
