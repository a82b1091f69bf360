"""Launch the Hopper prefill GEMM core (``triton.prefill_kernels``, issue 23) once per case
between ``cudaProfilerStart``/``Stop``, for Nsight Compute (a script, sm_90 GPU).

Usage (GLM-5.3-Flash TP2 FC1 shape: 288 experts, ``[T*8, 4096] x [2048, 4096]^T``, rows gathered
by token, random routing and bytes)::

    ncu --profile-from-start off -k regex:grouped_w4 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section SchedulerStats --page details --csv \
        env PYTHONPATH=src python benchmarks/profile_prefill.py [--case 512:rs_w128_t32_d4 \
            --case 8192:rs_w128_t256_d4_ws_x2_h2] > ncu.csv

The package is imported from ``PYTHONPATH`` (as in the other benchmarks), so ``PYTHONPATH=DIR``
profiles another tree's ``src`` (until the forty-fifth round the script put this checkout's
``src`` first whatever the path said). Each ``--case`` is ``TOKENS:SCHEDULE[:MODE]`` with a
label of ``schedules.PREFILL_SCHEDULES`` (or ``default``: the FC1 schedule that the MoE call of
that size runs in MODE, given; ``default_a8``: the A8 one, launched as ``TOKENS:LABEL`` of that
label is, without an epilogue; the summaries name the schedule found, and two cases of one
schedule and size are refused) (without ``MODE``: W4A16 without an epilogue; with ``MODE``
``w4a16``, ``a4`` or ``split``: the MoE's FC1 in that precision mode, SwiGLU epilogue and A4
re-quantization included, the split with the second half of the tokens A4), or ``TOKENS:LABEL``
with a label of ``schedules.A8_SCHEDULES`` for the A8 GEMM (``a8``, ``a8_t256``, ``a8_rs``,
``a8_t256_rs``, ...: ``A8_PREFILL``, ``A8_PREFILL_WIDE`` and the others with the weights in
registers, on e4m3 rows and their scales, ``fused_a8.quantize_rows`` in the schedule's column
order; sm_90);
every case runs once before the profiled region (compilation and warm caches stay outside it).
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
from typing import Any

import torch

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 288, 4096, 1024, 8
DEFAULT_CASES = ["512:rs_w128_t32_d4", "8192:rs_w128_t256_d4_ws_x2_h2"]
TOP_INSTRUCTIONS = 30
MODE_NAMES = ("w4a16", "a4", "split")  # a case's optional third field: the MoE FC1 in that mode


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


def default_label(tokens: int, mode_name: str | None) -> str | None:
    """The label of the FC1 schedule that a MoE call of ``tokens`` tokens of this shape runs in
    ``mode_name`` (:data:`MODE_NAMES`, all three the same schedule; None: A8) on sm_90:
    ``schedules.choose_prefill_tiles``' (``choose_a8_schedule``'s for A8), or None where no
    prefill schedule runs (the decode kernels' sizes)."""
    from a4prefill.ops.backends.triton.schedules import (
        A8_SCHEDULES,
        PREFILL_SCHEDULES,
        choose_a8_schedule,
        choose_prefill_tiles,
    )

    routes = tokens * TOP_K
    if mode_name is None:
        chosen = choose_a8_schedule(routes, EXPERTS, HIDDEN)
        return next(label for label, schedule in A8_SCHEDULES.items() if schedule == chosen)
    tiles = choose_prefill_tiles(routes, EXPERTS, HIDDEN, INTERMEDIATE)
    if tiles is None:
        return None
    return next(label for label, schedule in PREFILL_SCHEDULES.items() if schedule == tiles.fc1)


def parse_case(case: str) -> tuple[int, str, str | None]:
    """A ``--case`` ``TOKENS:SCHEDULE[:MODE]`` (module docstring) -> ``(tokens, label, mode)``,
    ``mode`` one of :data:`MODE_NAMES` or None; SCHEDULE ``default`` (with a MODE) and
    ``default_a8`` give the label :func:`default_label` finds. ``SystemExit`` naming the case and
    what was expected otherwise."""
    from a4prefill.ops.backends.triton.schedules import A8_SCHEDULES, PREFILL_SCHEDULES

    fields = case.split(":")
    if len(fields) not in (2, 3):
        raise SystemExit(f"--case {case}: expected TOKENS:SCHEDULE[:MODE]")
    tokens_text, label, *mode_field = fields
    if not tokens_text.isdigit() or int(tokens_text) == 0:
        raise SystemExit(f"--case {case}: TOKENS must be a positive integer")
    if label in ("default", "default_a8"):
        if (label == "default") != bool(mode_field) or (mode_field and mode_field[0] not in MODE_NAMES):
            raise SystemExit(f"--case {case}: default takes a MODE of {MODE_NAMES}, default_a8 none")
        resolved = default_label(int(tokens_text), mode_field[0] if mode_field else None)
        if resolved is None:
            raise SystemExit(
                f"--case {case}: no prefill schedule runs {tokens_text} tokens (the decode kernels do: "
                "benchmarks/profile_decode.py)"
            )
        label = resolved
    if label not in PREFILL_SCHEDULES and label not in A8_SCHEDULES:
        choices = [*A8_SCHEDULES, *sorted(PREFILL_SCHEDULES)]
        raise SystemExit(f"--case {case}: SCHEDULE must be one of {choices}")
    if mode_field and (mode_field[0] not in MODE_NAMES or label in A8_SCHEDULES):
        raise SystemExit(f"--case {case}: MODE must be one of {MODE_NAMES}, after a W4A16 schedule")
    return int(tokens_text), label, mode_field[0] if mode_field else None


def main() -> None:
    from a4prefill.ops.backends.triton.fused_a8 import quantize_rows
    from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
    from a4prefill.ops.backends.triton.routing import build_routing
    from a4prefill.ops.backends.triton.schedules import A8_SCHEDULES, PREFILL_SCHEDULES
    from a4prefill.ops.precision import MODE_A4, MODE_SPLIT, MODE_W4A16

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", action="append", help="TOKENS:SCHEDULE[:MODE] (repeatable)")
    parser.add_argument("--ncu-summary", help="summarize this ncu CSV of the same cases (no GPU)")
    parser.add_argument("--ncu-source", help="summarize this ncu source-page CSV of the same cases (no GPU)")
    parser.add_argument("--out", default=".", help="folder of the summaries' JSON")
    args = parser.parse_args()
    cases = args.case or DEFAULT_CASES
    parsed = [parse_case(case) for case in cases]  # before anything runs
    # the summaries' keys: each case with the schedule it runs (``default`` resolved)
    case_names = [":".join(str(field) for field in case if field is not None) for case in parsed]
    if len(set(case_names)) != len(case_names):
        raise SystemExit(f"--case: two cases run the same schedule at the same size: {case_names}")
    os.makedirs(args.out, exist_ok=True)
    if args.ncu_source:
        kernels = source_summary(args.ncu_source)
        if len(kernels) != len(cases):
            raise SystemExit(f"{args.ncu_source} has {len(kernels)} launches for {len(cases)} cases")
        with open(os.path.join(args.out, "profile_prefill_source_ncu.json"), "w") as handle:
            json.dump(dict(zip(case_names, kernels, strict=True)), handle, indent=1)
        return
    if args.ncu_summary:
        from profile_decode import ncu_summary

        launches = ncu_summary(args.ncu_summary, kernels=("grouped_w4",))
        if len(launches) != len(cases):
            raise SystemExit(f"{args.ncu_summary} has {len(launches)} launches for {len(cases)} cases")
        with open(os.path.join(args.out, "profile_prefill_ncu.json"), "w") as handle:
            json.dump(dict(zip(case_names, launches, strict=True)), handle, indent=1)
        return
    n, k = 2 * INTERMEDIATE, HIDDEN
    codes = torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0x28, 0x48, (EXPERTS, n, k // 16), dtype=torch.uint8, device="cuda")
    launches = []
    for tokens, label, mode_name in parsed:
        schedule = A8_SCHEDULES[label] if label in A8_SCHEDULES else PREFILL_SCHEDULES[label]
        ids = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=1).indices.int()
        x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
        options: dict[str, Any] = {}  # launch_prefill_gemm's keyword arguments beyond the schedule's
        if label in A8_SCHEDULES:  # the rows in the column order the schedule reads
            x, options["x_row_scales"] = quantize_rows(x, schedule.a8_register_weights)
            options["x_mma_order"] = schedule.a8_register_weights
        if mode_name is not None:  # the MoE's FC1: SwiGLU into h in the next GEMM's column order
            mode = {"w4a16": MODE_W4A16, "a4": MODE_A4, "split": MODE_SPLIT}[mode_name]
            out = torch.empty(tokens * TOP_K, n // 2, dtype=torch.bfloat16, device="cuda")
            options |= {"epilogue": "swiglu", "scale2": torch.ones(EXPERTS, 2, device="cuda"), "mode": mode}
            options["out_mma_order"] = True
            if mode != MODE_W4A16:
                options["encode_scales"] = (torch.ones(1, device="cuda"), torch.ones(EXPERTS, device="cuda"))
            if mode == MODE_SPLIT:
                options["row_flags"] = (torch.arange(tokens, device="cuda") >= tokens // 2).to(torch.uint8)
                options["routes_per_token"] = TOP_K
        else:
            out = torch.empty(tokens * TOP_K, n, dtype=torch.bfloat16, device="cuda")
        routing = build_routing(ids, EXPERTS, schedule.routes)
        arguments = (x, codes, scales, routing, out, schedule, TOP_K)
        launch_prefill_gemm(*arguments, **options)
        launches.append((arguments, options))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for arguments, options in launches:
        launch_prefill_gemm(*arguments, **options)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
