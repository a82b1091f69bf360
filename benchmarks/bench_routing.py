"""Time the ``triton`` backend's routing (``build_routing``) on a CUDA GPU (a script).

Usage: ``PYTHONPATH=src python benchmarks/bench_routing.py --out DIR``. For each route count
(top-8 routing over 288 experts, the GLM-5.3-Flash shape) it times the one-program Triton sort
with 4, 8 and 16 warps (up to 4096 routes), the chunked kernels with 4 and 8
warps per program (from 1024 routes) and the torch path, each captured in a CUDA graph
(``bench_moe.time_graph``, L2 flushed), and saves ``bench_routing.json`` and ``bench_routing.png``.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch

from bench_moe import time_graph
from line_plot import save_result_and_plot

EXPERTS, TOP_K = 288, 8
TOKENS = [1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
WARPS = [4, 8, 16]
CHUNK_WARPS = [4, 8]
ONE_PROGRAM_UP_TO, CHUNKED_FROM = 4096, 1024  # routes timed on each routing kernel


def main() -> None:
    from a4prefill.ops.backends.triton.routing import (
        CHUNK_ROUTES,
        RoutingLaunch,
        build_routing,
        sort_routes,
    )

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for tokens in TOKENS:
        ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(tokens)]).int()
        row: dict[str, float | int] = {"tokens": tokens, "routes": tokens * TOP_K}
        for warps in WARPS if tokens * TOP_K <= ONE_PROGRAM_UP_TO else []:
            call = functools.partial(build_routing, ids, EXPERTS, 8, warps=warps)
            row[f"triton_{warps}w_us"] = time_graph(call, 50, flush)
        for warps in CHUNK_WARPS if tokens * TOP_K >= CHUNKED_FROM else []:
            launch = RoutingLaunch(8, 0, warps, CHUNK_ROUTES)
            call = functools.partial(sort_routes, ids.reshape(-1), EXPERTS, launch)
            row[f"chunked_{warps}w_us"] = time_graph(call, 50, flush)
        call = functools.partial(build_routing, ids, EXPERTS, 8, force_torch=True)
        row["torch_us"] = time_graph(call, 50, flush)
        print(row, flush=True)
        rows.append(row)
    result = {"device": torch.cuda.get_device_name(), "experts": EXPERTS, "top_k": TOP_K, "rows": rows}
    series = [f"triton_{w}w_us" for w in WARPS] + [f"chunked_{w}w_us" for w in CHUNK_WARPS] + ["torch_us"]
    save_result_and_plot(args.out, "bench_routing", result, "routes", series, "routes", "us per call")


if __name__ == "__main__":
    main()
