"""Per-config report of the ``triton`` backend's GEMM kernels (a script, CUDA GPU only).

Usage: ``PYTHONPATH=src python benchmarks/kernel_report.py --out DIR [--tokens 16,256]``.

For the GLM-5.3-Flash TP2 expert shape and each tile config of :data:`bench_moe.SWEEP` that fits
the token count, prints and saves (``kernel_report.json``): W4A16 time (CUDA graph, L2 flushed),
registers per thread, spills, shared memory and whether Triton's pipeliner turned the weight loads
into asynchronous copies (``async_copy`` in the TTGIR) for the tiled kernels ``fc1_kernel`` and
``fc2_kernel``. ``default_tiled`` is ``choose_config``'s tiles without its decode schedule: what
runs where the decode kernels cannot (below sm_80, or a Triton without Gluon). The TTGIR and PTX
of its FC1 at the smallest token count are written next to it for reading. Token counts must stay
below the Hopper prefill GEMMs' sizes (12 routes per expert), which the tiled configs never run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_moe


def kernel_facts(jit_function: Any) -> list[dict[str, Any]]:
    """Registers, spills, shared memory and pipelining of every compiled variant in the cache."""
    facts = []
    for cache in jit_function.device_caches.values():
        for kernel in cache[0].values():
            ttgir = kernel.asm.get("ttgir", "")
            facts.append(
                {
                    "regs": kernel.n_regs,
                    "spills": kernel.n_spills,
                    "shared_bytes": kernel.metadata.shared,
                    "warps": kernel.metadata.num_warps,
                    "async_copy": "async_copy" in ttgir,
                }
            )
    return facts


def main() -> None:
    from a4prefill.ops.backends.triton import tiled_kernels
    from a4prefill.ops.backends.triton.fused import fused_moe
    from a4prefill.ops.backends.triton.schedules import GemmConfig, choose_config, choose_prefill_tiles

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tokens", default="16,256", help="comma list of token counts")
    args = parser.parse_args()
    shape = bench_moe.SHAPES["glm53flash_tp2"]
    hidden, inter, experts, top_k = shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]
    try:
        token_counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens: expected a comma list of integers, got {args.tokens!r}")
    for tokens in token_counts:
        if tokens < 1 or choose_prefill_tiles(tokens * top_k, experts, hidden, inter) is not None:
            parser.error(
                f"--tokens: {tokens} is not a size the tiled kernels run (1 up to the prefill GEMMs')"
            )
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    weights = bench_moe.random_weights(experts, hidden, inter, "cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shape": shape, "rows": []}
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        topk_w, topk_ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, dim=-1)
        topk_ids = topk_ids.to(torch.int32)
        routes = tokens * top_k
        configs = {
            "default_tiled": dataclasses.replace(choose_config(routes, experts, hidden, inter), decode=None)
        }
        for label, sizes in bench_moe.SWEEP.items():
            if bench_moe.config_fits(sizes, routes, experts):
                configs[label] = GemmConfig(*sizes)
        for label, config in configs.items():
            for jit_function in (tiled_kernels.fc1_kernel, tiled_kernels.fc2_kernel):
                jit_function.device_caches.clear()
            run = functools.partial(
                fused_moe, x, topk_w, topk_ids, weights.experts(), None, None, config=config
            )
            tiles = {field.name: getattr(config, field.name) for field in dataclasses.fields(GemmConfig)}
            del tiles["decode"], tiles["prefill"]  # None here: the tiled kernels run
            row: dict[str, Any] = {"tokens": tokens, "config": label, **tiles}
            try:
                row["w4a16_us"] = bench_moe.time_graph(run, 20, flush)
            except Exception as error:  # keep the rest of the report
                row["error"] = repr(error)[:300]
            row["fc1"] = kernel_facts(tiled_kernels.fc1_kernel)
            row["fc2"] = kernel_facts(tiled_kernels.fc2_kernel)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            if label == "default_tiled" and tokens == min(token_counts):
                for cache in tiled_kernels.fc1_kernel.device_caches.values():
                    for kernel in cache[0].values():
                        for kind in ("ttgir", "ptx"):
                            with open(os.path.join(args.out, f"fc1_default.{kind}"), "w") as handle:
                                handle.write(kernel.asm[kind])
    with open(os.path.join(args.out, "kernel_report.json"), "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
