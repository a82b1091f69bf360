"""Where decode time goes: per-kernel breakdown of the package's W4A16 and vLLM's Marlin MoE (a
script, CUDA GPU; Marlin needs CUDA vLLM), and with ``--humming`` Humming's (``humming_baseline.py``:
humming-kernels 0.1.19 on sm_90; an error where it cannot run).

Usage: ``PYTHONPATH=src python benchmarks/profile_decode.py --out DIR [--shape glm53flash_tp2]
[--tokens 1,16,64,256] [--prefill-tiles FC1[:FC2],...] [--a4] [--a8] [--humming]`` writes
``profile_decode.json``: per
implementation and token count, every GPU kernel of one call (name, launches, microseconds, from
``torch.profiler`` over 20 calls, L2 not flushed) and the call's total. ``--prefill-tiles`` adds
the package's W4A16 (and with ``--a4`` A4) with each pair of prefill schedules
(``PREFILL_SCHEDULES`` labels, as ``bench_moe.py --prefill-tiles``) instead of the call's
default, named ``w4a16_prefill_<tiles>``. Under Nsight Compute, ``--ncu`` runs each call once between
``cudaProfilerStart``/``Stop`` so that ``ncu --profile-from-start off`` sees only those kernels
(per token count: W4A16, then with ``--a4`` A4, then with ``--a8`` A8, then Marlin, then with
``--humming`` Humming):

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats --csv \
        python benchmarks/profile_decode.py --ncu --tokens 1,16,64 > ncu.csv

and ``--ncu-summary ncu.csv`` turns that CSV into ``profile_decode_ncu.json`` (the GEMM kernels,
one row each, in launch order, with the metrics of :data:`NCU_METRICS` and the busiest pipe that
Nsight Compute's ``HighPipeUtilization`` rule names, with ``--section ComputeWorkloadAnalysis``).
Nsight Compute locks the clocks to base, so its durations are longer than the timed ones; compare
the percentages, and ``Executed Instructions`` (``--section InstructionStats``) per GEMM between
implementations of the same call.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe import SHAPES, parse_prefill_tiles, prefill_configs, random_routing, random_weights
from marlin_baseline import marlin_moe

CALLS = 20
NCU_METRICS = (
    "Duration",
    "DRAM Throughput",
    "Compute (SM) Throughput",
    "Registers Per Thread",
    "Dynamic Shared Memory Per Block",
    "Theoretical Occupancy",
    "Achieved Occupancy",
    "Waves Per SM",
    "L2 Hit Rate",
    "Issue Slots Busy",
    "L1/TEX Cache Throughput",
    "L2 Cache Throughput",
    "Mem Busy",
    "Warp Cycles Per Issued Instruction",
    "Eligible Warps Per Scheduler",
    "No Eligible",
    "SM Frequency",
    "Executed Ipc Active",
    "Executed Instructions",
)
# "ALU is the highest-utilized pipeline (55.7%) based on ..." -> ("ALU", "55.7")
HIGHEST_PIPE = re.compile(r"^(\S+) is the highest-utilized pipeline \(([\d.]+)%\)")
# the GEMMs of the package (tiled, decode and Hopper prefill kernels), of vLLM's Marlin MoE and
# of Humming (one kernel template, ``humming<...>``)
GEMM_KERNELS = (
    "fc1_kernel",
    "fc2_kernel",
    "fc1_decode_kernel",
    "fc2_decode_kernel",
    "grouped_w4_gemm",
    "marlin",
    "humming",
)


def ncu_summary(csv_path: str, kernels: tuple[str, ...] = GEMM_KERNELS) -> list[dict[str, Any]]:
    """One row per launch of a kernel whose name contains one of ``kernels`` in an ``ncu --csv``
    report, in launch order: name, grid, block, the metrics of :data:`NCU_METRICS` and, where
    the report has the ``HighPipeUtilization`` rule, ``"highest pipe"`` (``"ALU 55.7%"``). Only
    the table's lines are read (ncu quotes every field, so each starts with ``"``): ncu's own
    lines (``==PROF==``, ``==WARNING==``) and the profiled program's log lines, which share the
    table's stdout before it and between its rows, are skipped."""
    import csv

    with open(csv_path) as handle:
        lines = [line for line in handle.read().splitlines() if line.startswith('"')]
    launches: dict[str, dict[str, Any]] = {}
    for record in csv.DictReader(lines):
        name = record["Kernel Name"]
        if not any(word in name.lower() for word in kernels):
            continue
        metric = record["Metric Name"] in NCU_METRICS
        pipe = None
        if not metric and record.get("Rule Name") == "HighPipeUtilization":
            pipe = HIGHEST_PIPE.match(record.get("Rule Description") or "")
        if not metric and pipe is None:
            continue
        row = launches.setdefault(
            record["ID"], {"kernel": name[:40], "grid": record["Grid Size"], "block": record["Block Size"]}
        )
        if pipe is None:
            row[f"{record['Metric Name']} ({record['Metric Unit']})"] = record["Metric Value"]
        else:
            row["highest pipe"] = f"{pipe[1]} {pipe[2]}%"
    return list(launches.values())


def implementations(
    shape: dict[str, int],
    a4: bool = False,
    humming_tokens: Sequence[int] | None = None,
    a8: bool = False,
) -> dict[str, Callable[..., torch.Tensor]]:
    """``name -> fn(hidden, topk_weights, topk_ids)`` on the same random weights: the package's
    W4A16, with ``a4`` its A4 (every row, the checkpoint's derived A4 scales), with ``a8`` its A8
    (every row, ``fused_a8.fused_moe_a8`` with each size's A8 schedule; ``RuntimeError`` naming
    ``--a8`` where it cannot run), vLLM's Marlin where it imports, and with ``humming_tokens``
    Humming's (its tiles compiled for those token counts; ``RuntimeError`` naming ``--humming``
    where humming-kernels or sm_90 is missing)."""
    from a4prefill.ops.backends.triton.fused import fused_moe
    from a4prefill.ops.backends.triton.fused_a8 import a8_refusal, fused_moe_a8
    from a4prefill.ops.scales import derive_a4_scales

    torch.manual_seed(0)
    weights = random_weights(shape["experts"], shape["hidden"], shape["intermediate"], "cuda")
    found: dict[str, Callable[..., torch.Tensor]] = {
        "w4a16": functools.partial(fused_moe, experts=weights.experts(), a4_scales=None, swiglu_limit=None)
    }
    if a4:
        scales = derive_a4_scales(weights.w13_input_scale, weights.w2_input_scale)
        found["a4"] = functools.partial(
            fused_moe, experts=weights.experts(), a4_scales=scales, swiglu_limit=None
        )
    if a8:
        refusal = a8_refusal(torch.device("cuda"), torch.bfloat16, shape["hidden"], shape["intermediate"])
        if refusal is not None:
            raise RuntimeError(f"--a8: the package's A8 cannot run here: {refusal}")
        found["a8"] = functools.partial(fused_moe_a8, experts=weights.experts(), swiglu_limit=None)
    marlin = marlin_moe(weights)
    if marlin is not None:
        found["marlin"] = marlin
    if humming_tokens is not None:
        from humming_baseline import humming_moe

        humming = humming_moe(weights, token_counts=humming_tokens)
        if humming is None:
            raise RuntimeError(
                "--humming: expected humming-kernels 0.1.19 importable and an sm_90 GPU "
                "(docs/humming.md, section 4: install its wheel into a folder on PYTHONPATH)"
            )
        found["humming"] = humming
    return found


def calls_with_tiles(
    fns: dict[str, Callable[..., torch.Tensor]],
    tokens: int,
    shape: dict[str, int],
    tiles: list[tuple[str, str]] | None,
) -> dict[str, Callable[..., torch.Tensor]]:
    """``<precision>_prefill_<tiles> -> fn`` for the package's ``"w4a16"`` and ``"a4"`` of ``fns``
    (:func:`implementations`) with the config of ``tokens`` tokens of ``shape`` that runs each
    ``(FC1, FC2)`` label pair of ``tiles`` (``bench_moe.prefill_configs``: the pairs the shape
    fits); none without ``tiles``."""
    routes, sizes = tokens * shape["top_k"], (shape["experts"], shape["hidden"], shape["intermediate"])
    calls = {}
    for label, config in prefill_configs(routes, *sizes, tiles or []).items():
        for precision in ("w4a16", "a4"):
            if precision in fns:
                calls[f"{precision}_{label}"] = functools.partial(fns[precision], config=config)
    return calls


def kernel_breakdown(fn: Callable[[], Any]) -> dict[str, Any]:
    """Per GPU kernel of one call: launches and microseconds (averaged over :data:`CALLS`)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name].append(event.time_range.elapsed_us())
    rows = [
        {"kernel": name[:120], "launches": len(times) / CALLS, "us": sum(times) / CALLS}
        for name, times in kernels.items()
    ]
    rows.sort(key=lambda row: -row["us"])
    return {"kernels": rows, "total_us": sum(row["us"] for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shape", default="glm53flash_tp2", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--ncu", action="store_true", help="one call each between profiler start/stop")
    parser.add_argument("--a4", action="store_true", help="also the package's A4 (every row A4)")
    parser.add_argument("--a8", action="store_true", help="also the package's A8 (every row A8, sm_90)")
    parser.add_argument("--humming", action="store_true", help="also Humming's MoE (humming-kernels, sm_90)")
    parser.add_argument("--ncu-summary", help="summarize this ncu CSV into profile_decode_ncu.json")
    parser.add_argument(
        "--prefill-tiles", help="FC1[:FC2],... prefill schedules to profile besides the default"
    )
    args = parser.parse_args()
    if args.prefill_tiles and (args.ncu or args.ncu_summary):
        parser.error("--prefill-tiles: the profiler run only (not with --ncu or --ncu-summary)")
    if args.ncu_summary:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_decode_ncu.json"), "w") as handle:
            json.dump(ncu_summary(args.ncu_summary), handle, indent=1)
        return
    shape = SHAPES[args.shape]
    tokens_list = [int(t) for t in args.tokens.split(",")]
    fns = implementations(shape, args.a4, tokens_list if args.humming else None, args.a8)
    if args.ncu:
        for tokens in tokens_list:
            x, w, ids = random_routing(tokens, shape["hidden"], shape["experts"], shape["top_k"])
            for fn in fns.values():
                fn(x, w, ids)  # compile / warm up outside the profiled region
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                fn(x, w, ids)
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
        return
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shape": shape, "rows": []}
    tiles = parse_prefill_tiles(args.prefill_tiles)
    for tokens in tokens_list:
        x, w, ids = random_routing(tokens, shape["hidden"], shape["experts"], shape["top_k"])
        calls = {**fns, **calls_with_tiles(fns, tokens, shape, tiles)}
        for name, fn in calls.items():
            row = {
                "implementation": name,
                "tokens": tokens,
                **kernel_breakdown(functools.partial(fn, x, w, ids)),
            }
            result["rows"].append(row)
            top = ", ".join(
                f"{k['kernel'][:40]} {k['us']:.1f}us x{k['launches']:.0f}" for k in row["kernels"][:6]
            )
            print(f"{name} tokens={tokens} total={row['total_us']:.1f}us: {top}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_decode.json"), "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
