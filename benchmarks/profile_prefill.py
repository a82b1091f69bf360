"""Launch the Hopper prefill GEMM core (``triton.prefill_kernels``, issue 23) once per case
between ``cudaProfilerStart``/``Stop``, for Nsight Compute (a script, sm_90 GPU).

Usage (GLM-5.3-Flash TP2 FC1 shape: 288 experts, ``[T*8, 4096] x [2048, 4096]^T``, rows gathered
by token, random routing and bytes)::

    ncu --profile-from-start off -k regex:grouped_w4 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section SchedulerStats --page details --csv \
        python benchmarks/profile_prefill.py [--case 512:w128_t64_d4 --case 8192:w128_t256_d4] > ncu.csv

Each ``--case`` is ``TOKENS:SCHEDULE`` with a label of ``schedules.PREFILL_SCHEDULES``; every case
runs once before the profiled region (compilation and warm caches stay outside it).
``--ncu-summary ncu.csv --out DIR`` (no GPU) turns that CSV into ``DIR/profile_prefill_ncu.json``:
one entry per case, in the order given, with ``profile_decode.NCU_METRICS``. Nsight
Compute locks the clocks to base, so its durations are longer than the timed ones
(``bench_prefill_gemm.py``); compare percentages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 288, 4096, 1024, 8
DEFAULT_CASES = ["512:w128_t64_d4", "8192:w128_t256_d4"]


def main() -> None:
    from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
    from a4prefill.ops.backends.triton.routing import build_routing
    from a4prefill.ops.backends.triton.schedules import PREFILL_SCHEDULES

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", action="append", help="TOKENS:SCHEDULE (repeatable)")
    parser.add_argument("--ncu-summary", help="summarize this ncu CSV of the same cases (no GPU)")
    parser.add_argument("--out", default=".", help="folder of profile_prefill_ncu.json")
    args = parser.parse_args()
    cases = args.case or DEFAULT_CASES
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
        if label not in PREFILL_SCHEDULES:
            raise SystemExit(f"--case {case}: schedule must be one of {sorted(PREFILL_SCHEDULES)}")
        tokens, schedule = int(tokens_text), PREFILL_SCHEDULES[label]
        ids = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=1).indices.int()
        x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(tokens * TOP_K, n, dtype=torch.bfloat16, device="cuda")
        routing = build_routing(ids, EXPERTS, schedule.routes)
        arguments = (x, codes, scales, routing, out, schedule, TOP_K)
        launch_prefill_gemm(*arguments)
        launches.append(arguments)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for arguments in launches:
        launch_prefill_gemm(*arguments)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
