"""Launch the Hopper prefill GEMM core (``triton.prefill_kernels``, issue 23) once per case
between ``cudaProfilerStart``/``Stop``, for Nsight Compute (a script, sm_90 GPU).

Usage (GLM-5.3-Flash TP2 FC1 shape: 288 experts, ``[T*8, 4096] x [2048, 4096]^T``, rows gathered
by token, random routing and bytes)::

    ncu --profile-from-start off -k regex:grouped_w4 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section SchedulerStats --page details --csv \
        python benchmarks/profile_prefill.py [--case 512:rs_w128_t32_d4 \
            --case 8192:rs_w128_t256_d4_ws_x2_h2] > ncu.csv

Each ``--case`` is ``TOKENS:SCHEDULE`` with a label of ``schedules.PREFILL_SCHEDULES``, or
``TOKENS:a8`` for the A8 GEMM (``schedules.A8_PREFILL`` on e4m3 rows and their block scales,
``fused_a8.quantize_rows``; sm_90); every case runs once before the profiled region (compilation
and warm caches stay outside it).
``--ncu-summary ncu.csv --out DIR`` (no GPU) turns that CSV into ``DIR/profile_prefill_ncu.json``:
one entry per case, in the order given, with ``profile_decode.NCU_METRICS``. Nsight
Compute locks the clocks to base, so its durations are longer than the timed ones
(``bench_prefill_gemm.py``); compare percentages.

Where the warps wait: profile with ``--section SourceCounters -o prof`` as well, export the
SASS page with ``ncu --import prof.ncu-rep --page source --csv --print-source sass >
source.csv``, and ``--ncu-source source.csv --out DIR`` (no GPU) writes
``DIR/profile_prefill_source_ncu.json``: per case, the warp-stall samples by reason, the
:data:`TOP_INSTRUCTIONS` instructions with the most samples (address, SASS, samples, times
executed by warps, their two largest reasons) and every mbarrier wait's executions. An mbarrier
wait is a ``SYNCS.PHASECHK`` test, then (out of line) a retry loop of another one: the retry
runs only while a warp waits, so its executions against the test's count how often warps wait.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 288, 4096, 1024, 8
DEFAULT_CASES = ["512:rs_w128_t32_d4", "8192:rs_w128_t256_d4_ws_x2_h2"]
A8_LABEL = "a8"  # a case's label for the A8 GEMM (``schedules.A8_PREFILL``, e4m3 rows and scales)
TOP_INSTRUCTIONS = 30


def source_summary(csv_path: str) -> list[dict[str, Any]]:
    """Per kernel launch of an ``ncu --page source --csv --print-source sass`` export, in order:
    ``{"kernel", "samples", "stall_share" (reason -> share of the samples, largest first),
    "top" (the :data:`TOP_INSTRUCTIONS` instructions with the most samples), "mbarrier_waits"
    (every ``SYNCS.PHASECHK``: address, times executed by warps)}``."""
    import csv

    with open(csv_path) as handle:
        lines = handle.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    launches = []
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        kernel = next(csv.reader([lines[start]]))[1]
        records = list(csv.DictReader(lines[start + 1 : end]))
        reasons = [c for c in records[0] if c.startswith("stall_") and "Not Issued" not in c]
        samples = [int(r["Warp Stall Sampling (All Samples)"] or 0) for r in records]
        total = sum(samples)
        by_reason = {c: sum(int(r[c] or 0) for r in records) for c in reasons}
        top = sorted(zip(samples, range(len(records)), strict=True), reverse=True)[:TOP_INSTRUCTIONS]
        launches.append(
            {
                "kernel": kernel,
                "samples": total,
                "stall_share": {
                    c.removeprefix("stall_"): round(v / total, 4)
                    for c, v in sorted(by_reason.items(), key=lambda item: -item[1])
                    if v
                },
                "top": [
                    {
                        "address": records[i]["Address"][-5:],
                        "sass": records[i]["Source"].strip(),
                        "samples": n,
                        "executed": int(records[i]["Instructions Executed"] or 0),
                        "reasons": [c.removeprefix("stall_") for _, c in sorted(counts, reverse=True)[:2]],
                    }
                    for n, i in top
                    for counts in [[(int(records[i][c] or 0), c) for c in reasons]]
                ],
                "mbarrier_waits": [
                    {"address": r["Address"][-5:], "executed": int(r["Instructions Executed"] or 0)}
                    for r in records
                    if "SYNCS.PHASECHK" in r["Source"]
                ],
            }
        )
    return launches


def main() -> None:
    from a4prefill.ops.backends.triton.fused_a8 import quantize_rows
    from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
    from a4prefill.ops.backends.triton.routing import build_routing
    from a4prefill.ops.backends.triton.schedules import A8_PREFILL, PREFILL_SCHEDULES

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", action="append", help="TOKENS:SCHEDULE (repeatable)")
    parser.add_argument("--ncu-summary", help="summarize this ncu CSV of the same cases (no GPU)")
    parser.add_argument("--ncu-source", help="summarize this ncu source-page CSV of the same cases (no GPU)")
    parser.add_argument("--out", default=".", help="folder of the summaries' JSON")
    args = parser.parse_args()
    cases = args.case or DEFAULT_CASES
    if args.ncu_source:
        kernels = source_summary(args.ncu_source)
        if len(kernels) != len(cases):
            raise SystemExit(f"{args.ncu_source} has {len(kernels)} launches for {len(cases)} cases")
        with open(os.path.join(args.out, "profile_prefill_source_ncu.json"), "w") as handle:
            json.dump(dict(zip(cases, kernels, strict=True)), handle, indent=1)
        return
    if args.ncu_summary:
        from profile_decode import ncu_summary

        launches = ncu_summary(args.ncu_summary, kernels=("grouped_w4",))
        if len(launches) != len(cases):
            raise SystemExit(f"{args.ncu_summary} has {len(launches)} launches for {len(cases)} cases")
        with open(os.path.join(args.out, "profile_prefill_ncu.json"), "w") as handle:
            json.dump(dict(zip(cases, launches, strict=True)), handle, indent=1)
        return
    n, k = 2 * INTERMEDIATE, HIDDEN
    codes = torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0x28, 0x48, (EXPERTS, n, k // 16), dtype=torch.uint8, device="cuda")
    launches = []
    for case in cases:
        tokens_text, label = case.split(":")
        if label not in PREFILL_SCHEDULES and label != A8_LABEL:
            choices = [A8_LABEL, *sorted(PREFILL_SCHEDULES)]
            raise SystemExit(f"--case {case}: schedule must be one of {choices}")
        tokens = int(tokens_text)
        schedule = A8_PREFILL if label == A8_LABEL else PREFILL_SCHEDULES[label]
        ids = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=1).indices.int()
        x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
        a8: dict[str, Any] = {}
        if label == A8_LABEL:
            x, a8["x_block_scales"] = quantize_rows(x)
        out = torch.empty(tokens * TOP_K, n, dtype=torch.bfloat16, device="cuda")
        routing = build_routing(ids, EXPERTS, schedule.routes)
        arguments = (x, codes, scales, routing, out, schedule, TOP_K)
        launch_prefill_gemm(*arguments, **a8)
        launches.append((arguments, a8))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for arguments, a8 in launches:
        launch_prefill_gemm(*arguments, **a8)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
