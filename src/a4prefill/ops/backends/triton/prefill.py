"""Host side of the Hopper prefill GEMM (:mod:`~a4prefill.ops.backends.triton.prefill_kernels`).

Work in progress (issue 23): :func:`launch_prefill_gemm` launches the GEMM core for the tests and
``benchmarks/bench_prefill_gemm.py``; no MoE call takes it yet (``plan_call`` does not choose it).
"""

from __future__ import annotations

from typing import Any

import torch

from a4prefill.ops.backends.triton import kernel_modules
from a4prefill.ops.backends.triton.routing import Routing
from a4prefill.ops.backends.triton.schedules import PrefillGemm


def launch_prefill_gemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    routing: Routing,
    out: torch.Tensor,
    schedule: PrefillGemm,
    top_k: int | None,
    kernel: Any = None,
) -> None:
    """``out[p] = x[row(p)] @ dequant(W[e(p)])^T`` for every sorted position ``p`` of
    ``routing`` (bf16, fp32 accumulation), without a host sync.

    ``x`` bf16 ``[T, K]`` with ``row(p) = sorted_route[p] // top_k`` (FC1: tokens), or, with
    ``top_k=None``, ``[R, K]`` with ``row(p) = p`` (FC2: rows already in sorted order). ``codes``
    uint8 ``[E, N, K / 2]`` and ``scales`` (e4m3 bytes as uint8) ``[E, N, K / 16]``, the ModelOpt
    layout as loaded; ``out`` bf16 ``[R, N]``, written at every sorted position. ``routing`` was
    built with ``block_m = schedule.routes``. ``N`` must be a multiple of ``schedule.weight_rows``
    and ``K`` of ``schedule.block_k``. ``kernel`` replaces the Gluon kernel (tests: the TTGIR
    interpreter); by default it is imported (Triton 3.6+ with Gluon, an sm_90 GPU)."""
    experts, n, half_k = codes.shape
    k = 2 * half_k
    if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise ValueError(f"x and out must be bf16, got {x.dtype} and {out.dtype}")
    routes = routing.sorted_route.numel()
    if x.shape[1] != k or scales.shape != (experts, n, k // 16) or out.shape != (routes, n):
        raise ValueError(
            f"shapes: x [*, {k}], scales [{experts}, {n}, {k // 16}] and out [{routes}, {n}] expected, "
            f"got {tuple(x.shape)}, {tuple(scales.shape)}, {tuple(out.shape)}"
        )
    for name, tensor in (("x", x), ("codes", codes), ("scales", scales), ("out", out)):
        if not tensor.is_contiguous() or tensor.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned (cp.async copies 16 bytes)")
    if not schedule.fits(k, n):
        raise ValueError(f"schedule {schedule} does not divide K={k} and N={n}")
    if kernel is None:
        kernel = kernel_modules.prefill().grouped_w4_gemm_kernel
    grid = (routing.max_tiles, n // schedule.weight_rows)
    kernel[grid](
        x,
        codes,
        scales,
        out,
        routing.sorted_route,
        routing.tile_expert,
        routing.tile_row,
        routing.seg_start,
        routing.seg_count,
        routing.num_tiles,
        n,
        k,
        routes,
        top_k or 1,
        GATHER=top_k is not None,
        BW=schedule.weight_rows,
        BT=schedule.routes,
        BK=schedule.block_k,
        DEPTH=schedule.depth,
        num_warps=schedule.warps,
    )
