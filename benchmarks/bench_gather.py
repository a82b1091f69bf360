"""Time the warp-specialized prefill FC1's activation gather (``prefill.gather_rows``) on a CUDA
GPU in both program orders (a script).

Usage: ``PYTHONPATH=src python benchmarks/bench_gather.py --out DIR [--tokens 4096 8192 ...]``.
GLM-5.3-Flash TP2 shape (hidden 4096, 288 experts, top-8), random routing sorted by expert in
the 256-route tiles (``routing.build_routing``). For each token count it times, each captured in
a CUDA graph with L2 flushed (``bench_moe.time_graph``): ``gather_rows`` with the kernel's
programs one 64-column stripe of every row after the other (``blocks_first=False``) and whole
rows after the other (``True``), and a plain device copy of the same ``[routes, hidden]`` bf16
bytes (which reads every route's row, so the gather should take at most its time). GB/s counts
the gather's bytes in every column: the rows written plus the token rows read once. Then the
``[T, K]`` column permutation that the FC1 of a ``rows_by_token`` schedule reads instead
(``launch_prefill_gemm`` wrote it by ``index_select`` until the twenty-sixth round, since by
``prefill.mma_ordered_rows``: ``gather_rows`` in ``GATHER_BLOCKS_FIRST``'s order):
``permute_index_select`` against ``gather_rows`` with each token its own route
(``permute_stripes``, ``permute_rows``: both program orders), GB/s of ``x`` read and written
once. Saves
``bench_gather.json`` and ``bench_gather.png``; the faster order is what
``prefill.GATHER_BLOCKS_FIRST`` should say.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch

from bench_moe import time_graph
from line_plot import save_result_and_plot

EXPERTS, HIDDEN, TOP_K = 288, 4096, 8
TOKENS = [1024, 4096, 8192, 16384]
ORDERS = {"stripes": False, "rows": True}  # label: gather_rows' blocks_first


PERMUTATIONS = ("permute_index_select", "permute_stripes", "permute_rows")


def time_permutations(x: torch.Tensor, flush: torch.Tensor) -> dict[str, float]:
    """``<label>_us`` and ``<label>_GBps`` of each of :data:`PERMUTATIONS`: ``x`` ``[T, K]`` bf16
    with its columns in ``prefill.mma_column_order``, by ``index_select`` and by ``gather_rows``
    with routes ``0 .. T - 1`` of one route per token in both program orders (checked equal
    first); GB/s of ``x`` read and written once."""
    from a4prefill.ops.backends.triton.prefill import gather_rows, mma_column_order

    tokens, hidden = x.shape
    columns = mma_column_order(hidden, x.device)
    identity = torch.arange(tokens, dtype=torch.int32, device=x.device)
    calls = {
        "permute_index_select": functools.partial(x.index_select, 1, columns),
        "permute_stripes": functools.partial(gather_rows, x, identity, 1, False),
        "permute_rows": functools.partial(gather_rows, x, identity, 1, True),
    }
    expected = x.index_select(1, columns)
    timings: dict[str, float] = {}
    for label, call in calls.items():
        if not torch.equal(call(), expected):
            raise SystemExit(f"{label} differs from index_select at {tokens} tokens")
        timings[f"{label}_us"] = time_graph(call, 50, flush)
        timings[f"{label}_GBps"] = 2 * x.numel() * x.element_size() / timings[f"{label}_us"] / 1e3
    return timings


def main() -> None:
    from a4prefill.ops.backends.triton.prefill import gather_rows
    from a4prefill.ops.backends.triton.routing import build_routing

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    args = parser.parse_args()
    if any(tokens < 1 for tokens in args.tokens):
        raise SystemExit(f"--tokens: positive token counts expected, got {args.tokens}")
    os.makedirs(args.out, exist_ok=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for tokens in args.tokens:
        ids = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=1).indices.int()
        x = torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16)
        sorted_route = build_routing(ids, EXPERTS, 256).sorted_route
        routes = tokens * TOP_K
        moved = (routes + tokens) * HIDDEN * x.element_size()  # written + token rows read once
        row: dict[str, float | int] = {"tokens": tokens, "routes": routes, "bytes": moved}
        expected = gather_rows(x, sorted_route, TOP_K, False)
        for label, blocks_first in ORDERS.items():
            if not torch.equal(gather_rows(x, sorted_route, TOP_K, blocks_first), expected):
                raise SystemExit(f"gather_rows(blocks_first={blocks_first}) differs at {tokens} tokens")
            call = functools.partial(gather_rows, x, sorted_route, TOP_K, blocks_first)
            row[f"{label}_us"] = time_graph(call, 50, flush)
        source, target = torch.empty_like(expected), torch.empty_like(expected)
        row["copy_us"] = time_graph(functools.partial(target.copy_, source), 50, flush)
        for label in (*ORDERS, "copy"):
            row[f"{label}_GBps"] = moved / row[f"{label}_us"] / 1e3
        row.update(time_permutations(x, flush))
        print(row, flush=True)
        rows.append(row)
    result = {"device": torch.cuda.get_device_name(), "hidden": HIDDEN, "top_k": TOP_K, "rows": rows}
    series = [f"{label}_GBps" for label in (*ORDERS, "copy", *PERMUTATIONS)]
    save_result_and_plot(args.out, "bench_gather", result, "tokens", series, "tokens", "GB/s")


if __name__ == "__main__":
    main()
