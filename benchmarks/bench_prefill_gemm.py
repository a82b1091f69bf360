"""Time the Hopper prefill GEMM core (``triton.prefill_kernels``, issue 23) on a CUDA GPU.

Usage: ``PYTHONPATH=src python benchmarks/bench_prefill_gemm.py --out DIR [--tokens 512 4096 ...]
[--schedules LABEL ...] [--experts 280 288 ...] [--no-grouped-mm]``.
GLM-5.3-Flash TP2 shape (hidden 4096, intermediate 1024, 288 experts, top-8), random routing,
random code and scale bytes. For each token count it times the FC1 GEMM (``[T*8, 4096] x [2048,
4096]^T``, rows gathered by token) and the FC2 GEMM (``[T*8, 1024] x [4096, 1024]^T``, rows in
sorted order) of every schedule in ``schedules.PREFILL_SCHEDULES``, and, in the same run, the
same GEMMs as ``torch._grouped_mm`` in bf16 on rows already sorted by expert (no gather, bf16
weights): each captured in a CUDA graph, L2 flushed (``bench_moe.time_graph``). Routing is not
in the timing (the GEMM core only); a dense bf16 8192^3 matmul gives the measured tensor-core rate
the same run. Saves ``bench_prefill_gemm.json`` and ``.png`` (TFLOP/s).

``--experts`` (several counts, each timed at every token count, the weights of the first
``E`` experts of one allocation) measures how a persistent schedule's time follows its work items
per SM: each row records ``experts``, the routing's live route tiles per schedule
(``{gemm}_{label}_tiles``) and the SM count, so that ``tiles * N / ITEM_ROWS / SMs`` (work items
per SM, two or three programs sharing one) can be set beside the time (the last wave's share).
``--no-grouped-mm`` leaves the bf16 ``torch._grouped_mm`` column out; ``--plot JSON`` (no GPU)
draws a saved result again.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from typing import Any

import torch

from bench_moe import dense_bf16_tflops, sweep_gemm, time_graph

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 288, 4096, 1024, 8
TOKENS = [512, 1024, 4096, 8192, 16384]


def time_size(
    tokens: int,
    experts: int,
    schedules: dict[str, Any],
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    gemms: dict[str, tuple[int, int]],
    flush: torch.Tensor,
    grouped_mm: bool,
) -> dict[str, float | int]:
    """One row: every schedule's FC1 and FC2 at ``tokens`` over the first ``experts`` experts of
    ``weights`` (uniform random top-k routing), median us of CUDA-graph replays with L2 flushed,
    TFLOP/s, the routing's live route tiles; with ``grouped_mm`` the bf16 ``torch._grouped_mm``."""
    from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
    from a4prefill.ops.backends.triton.routing import build_routing

    routes = tokens * TOP_K
    ids = torch.rand(tokens, experts, device="cuda").topk(TOP_K, dim=1).indices.int()
    row: dict[str, float | int] = {"tokens": tokens, "experts": experts}
    for name, (n, k) in gemms.items():
        codes, scales = (w[:experts] for w in weights[name])
        flops = 2 * routes * n * k
        x = torch.randn(tokens if name == "fc1" else routes, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(routes, n, dtype=torch.bfloat16, device="cuda")
        for label, schedule in schedules.items():
            routing = build_routing(ids, experts, schedule.routes)
            top_k = TOP_K if name == "fc1" else None
            call = functools.partial(launch_prefill_gemm, x, codes, scales, routing, out, schedule, top_k)
            us = time_graph(call, 20, flush)
            row[f"{name}_{label}_us"], row[f"{name}_{label}_tflops"] = us, flops / us / 1e6
            row[f"{name}_{label}_tiles"] = int(routing.num_tiles.item())
        if grouped_mm:
            counts = torch.bincount(ids.reshape(-1), minlength=experts)
            offsets = torch.cumsum(counts, 0).int()
            sorted_x = torch.randn(routes, k, dtype=torch.bfloat16, device="cuda")
            dense = torch.randn(experts, n, k, dtype=torch.bfloat16, device="cuda")
            grouped = functools.partial(torch._grouped_mm, sorted_x, dense.transpose(1, 2), offs=offsets)
            us = time_graph(grouped, 20, flush)
            row[f"{name}_grouped_mm_bf16_us"], row[f"{name}_grouped_mm_bf16_tflops"] = us, flops / us / 1e6
            del dense, grouped
    return row


def plot(result: dict[str, Any], path: str) -> None:
    """Write ``result``'s plot (a saved ``bench_prefill_gemm.json``) to ``path``: per GEMM,
    TFLOP/s against tokens, or with several expert counts (``--experts``) microseconds against
    experts, one line per schedule (and token count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    experts = result["shape"]["experts"]
    by_experts = isinstance(experts, list) and len(experts) > 1
    columns = [*result["schedules"]] + (["grouped_mm_bf16"] if "fc1_grouped_mm_bf16_us" in rows[0] else [])
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, name in zip(axes, ("fc1", "fc2"), strict=True):
        for label in columns:
            if by_experts:
                for tokens in sorted({r["tokens"] for r in rows}):
                    points = sorted(
                        (r["experts"], r[f"{name}_{label}_us"]) for r in rows if r["tokens"] == tokens
                    )
                    axis.plot(*zip(*points, strict=True), marker="o", label=f"{label}, {tokens} tokens")
            else:
                tflops = [r[f"{name}_{label}_tflops"] for r in rows]
                axis.plot([r["tokens"] for r in rows], tflops, marker="o", label=label)
        if by_experts:
            axis.set(xlabel="experts", ylabel="us", title=f"{name} ({result['device']})")
        else:
            axis.set(xscale="log", xlabel="tokens", ylabel="TFLOP/s", title=f"{name} ({result['device']})")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    from a4prefill.ops.backends.triton.schedules import PREFILL_SCHEDULES

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="folder of the JSON and the plot (required unless --plot)")
    parser.add_argument("--plot", help="only plot this saved JSON (no GPU): its .png beside it")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument(
        "--schedules",
        nargs="+",
        help="schedules.PREFILL_SCHEDULES labels or bench_moe.sweep_gemm names (default: every label)",
    )
    parser.add_argument("--experts", type=int, nargs="+", default=[EXPERTS], help="expert counts to sweep")
    parser.add_argument("--no-grouped-mm", action="store_true", help="leave out the bf16 grouped GEMM")
    args = parser.parse_args()
    if args.plot:
        with open(args.plot) as handle:
            plot(json.load(handle), os.path.splitext(args.plot)[0] + ".png")
        return
    if not args.out:
        raise SystemExit("--out is required (unless --plot)")
    if min(args.experts) < TOP_K:
        raise SystemExit(f"--experts must each be at least top-k ({TOP_K}), got {args.experts}")
    schedules = {label: sweep_gemm(label) for label in args.schedules or PREFILL_SCHEDULES}
    os.makedirs(args.out, exist_ok=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    gemms = {"fc1": (2 * INTERMEDIATE, HIDDEN), "fc2": (HIDDEN, INTERMEDIATE)}
    weights = {
        name: (
            torch.randint(0, 256, (max(args.experts), n, k // 2), dtype=torch.uint8, device="cuda"),
            torch.randint(0x28, 0x48, (max(args.experts), n, k // 16), dtype=torch.uint8, device="cuda"),
        )
        for name, (n, k) in gemms.items()
    }
    dense_tflops = dense_bf16_tflops(flush)
    print(f"dense bf16 8192^3: {dense_tflops:.0f} TFLOP/s", flush=True)
    rows = []
    for experts in args.experts:
        for tokens in args.tokens:
            row = time_size(tokens, experts, schedules, weights, gemms, flush, not args.no_grouped_mm)
            print(row, flush=True)
            rows.append(row)
    result = {
        "device": torch.cuda.get_device_name(),
        "shape": {"experts": args.experts, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "top_k": TOP_K},
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "schedules": {label: str(s) for label, s in schedules.items()},
        "dense_bf16_8192_tflops": dense_tflops,
        "rows": rows,
    }
    with open(os.path.join(args.out, "bench_prefill_gemm.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    plot(result, os.path.join(args.out, "bench_prefill_gemm.png"))


if __name__ == "__main__":
    main()
