"""The ``triton`` backend's A8 MoE call (:func:`fused_moe_a8`; issue 28): every row's activations
FP8 e4m3 with one scale per row, the NVFP4 weights converted to e4m3 inside the kernel, products on
Hopper's FP8 tensor cores, with the numerics of docs/numerics.md section 8 (oracle:
``reference.moe_reference_a8``).

Per call (``T`` tokens, top-k ``k``, ``R = T * k`` routes, the one NVFP4 weight layout):

1. routing sorted by expert in the schedule's route tiles (128 routes with
   ``schedules.A8_PREFILL_RS``, or 256 with ``schedules.A8_PREFILL_WIDE``, by size:
   :func:`schedules.choose_a8_schedule`;
   :func:`routing.sort_routes`, no host sync);
2. the hidden rows quantized once per token (:func:`quantize_rows`: ``fp8.quantize_rows`` bit
   for bit, one kernel; for a schedule with ``a8_register_weights`` the columns written in
   ``prefill.a8_column_order``, as ``h``'s in step 4);
3. FC1: :func:`prefill.launch_prefill_gemm` with ``x_row_scales`` (the warp-specialized
   kernel's A8 mainloop), SwiGLU epilogue
   into ``h [R, I]`` bf16 in sorted order, rounded where W4A16 rounds;
4. ``h`` quantized per route the same way, FC2 likewise with the alpha epilogue into ``y [R, H]``
   by route, then the top-k sum (the W4A16 combine).

Runs on sm_90 GPUs only (:func:`plan.prefill_kernels_run`: the FP8 wgmma), bf16 activations, H
and I multiples of 128. Every call takes this path whatever its size (rows the plan gives A8 run
A8): small calls leave most of each 128-route tile empty. CUDA-graph safe (no host sync, sizes
from shapes), though the row rule never runs A8 rows in a captured graph.

Who may call: :class:`~a4prefill.ops.backends.triton.backend.TritonBackend` (A8 rows of a
plan), :mod:`warmup`, tests and benchmarks.
"""

from __future__ import annotations

import torch

from a4prefill.ops import fp8
from a4prefill.ops.backends.triton import kernel_modules
from a4prefill.ops.backends.triton.fused import _aligned, _combine
from a4prefill.ops.backends.triton.plan import prefill_kernels_run
from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
from a4prefill.ops.backends.triton.routing import routing_launch, sort_routes
from a4prefill.ops.backends.triton.schedules import (
    A8_SCHEDULES,
    PrefillGemm,
    cdiv,
    choose_a8_schedule,
    next_pow2,
)
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.precision import MODE_W4A16


def a8_device_refusal(device: torch.device) -> str | None:
    """Why :func:`fused_moe_a8` cannot run on ``device``, or None: it needs an sm_90 GPU and a
    Triton whose Gluon the kernels import (:func:`plan.prefill_kernels_run`)."""
    if device.type == "cuda" and torch.cuda.is_available() and prefill_kernels_run(device):
        return None
    return (
        f"the triton backend's A8 kernel runs on sm_90 GPUs (Hopper: FP8 wgmma) with a Triton whose "
        f"Gluon it imports, not on {device}"
    )


def a8_refusal(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> str | None:
    """Why :func:`fused_moe_a8` cannot run a layer of these shapes with ``dtype`` activations on
    ``device``, or None. Host arithmetic (one cached device query)."""
    reason = a8_device_refusal(device)
    if reason is not None:
        return reason
    if dtype != torch.bfloat16:
        return f"the triton backend's A8 kernel takes bf16 activations, got {dtype}"
    return fp8.a8_shape_reason(hidden, intermediate)


QUANTIZE_ROWS_PER_PROGRAM = 16  # rows of one program of the A8 row quantizer (2 per warp, 4 warps x 2)


def quantize_rows(x: torch.Tensor, mma_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_rows`` of a contiguous bf16 ``x [R, K]`` (K a multiple of 128) on its device,
    in two launches over ``(row groups, K / 128 blocks)`` (``prefill_a8_kernels``: each block's
    largest magnitude, then each block's codes from its row's largest over all blocks; the row
    read twice, every program one block): ``(codes float8_e4m3fn [R, K], scales fp32 [R])``,
    with ``mma_order`` the codes' columns in ``prefill.a8_column_order`` (what an
    ``a8_register_weights`` schedule reads; the scales do not depend on it). No host sync."""
    rows, k = x.shape
    if k % fp8.A8_BLOCK:
        raise ValueError(f"x: K={k} must be a multiple of {fp8.A8_BLOCK} for the A8 row quantizer")
    codes = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        blocks = k // fp8.A8_BLOCK
        amax = torch.empty(rows, blocks, dtype=torch.float32, device=x.device)
        grid = (cdiv(rows, QUANTIZE_ROWS_PER_PROGRAM), blocks)
        kernels = kernel_modules.prefill_a8()
        kernels.fp8_block_amax_kernel[grid](x, amax, rows, k, BR=QUANTIZE_ROWS_PER_PROGRAM, num_warps=4)
        kernels.quantize_fp8_rows_kernel[grid](
            x,
            amax,
            codes,
            scales,
            rows,
            k,
            BR=QUANTIZE_ROWS_PER_PROGRAM,
            BLOCKS=next_pow2(blocks),
            MMA_ORDER=mma_order,
            num_warps=4,
        )
    return codes, scales


def fused_moe_a8(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: NvFp4Experts,
    swiglu_limit: float | None,
    *,
    schedule: PrefillGemm | None = None,
) -> torch.Tensor:
    """The MoE on ``hidden_states [T, H]`` (bf16) with every row A8 (module docstring): ``[T, H]``
    bf16. ``topk_weights``/``topk_ids [T, k]`` as :func:`fused.fused_moe` takes them (out-of-range
    ids ignored). ``schedule``: the GEMMs' schedule, one of :data:`schedules.A8_SCHEDULES`
    (default: :func:`schedules.choose_a8_schedule` of the call's size; a speed choice only: every
    schedule meets the same A8 contract). Raises ``ValueError`` with :func:`a8_refusal`'s reason
    where it cannot run, or for another schedule."""
    if schedule is not None and schedule not in A8_SCHEDULES.values():
        raise ValueError(f"schedule must be one of A8_SCHEDULES {dict(A8_SCHEDULES)}, got {schedule}")
    tokens, hidden = hidden_states.shape
    fc1, fc2 = experts.fc1, experts.fc2
    intermediate = fc1.rows // 2
    reason = a8_refusal(hidden_states.device, hidden_states.dtype, hidden, intermediate)
    if reason is not None:
        raise ValueError(reason)
    output = torch.empty_like(hidden_states)
    if tokens == 0:
        return output
    top_k = topk_ids.shape[1]
    routes = tokens * top_k
    if schedule is None:
        schedule = choose_a8_schedule(routes, fc1.experts, hidden)
    topk_weights = _aligned(topk_weights.to(torch.float32))
    topk_ids = _aligned(topk_ids.to(torch.int32))
    launch = routing_launch(routes, schedule.routes)
    routing = sort_routes(topk_ids.reshape(-1), fc1.experts, launch)
    mma_order = schedule.a8_register_weights  # the rows written in the order the GEMMs read
    x8, x_scales = quantize_rows(_aligned(hidden_states.contiguous()), mma_order)
    h = torch.empty(routes, intermediate, dtype=torch.bfloat16, device=hidden_states.device)
    launch_prefill_gemm(
        x8,
        fc1.codes,
        fc1.scale_bytes(),
        routing,
        h,
        schedule,
        top_k,
        epilogue="swiglu",
        scale2=fc1.scale_2,
        swiglu_limit=swiglu_limit,
        x_mma_order=mma_order,
        x_row_scales=x_scales,
    )
    h8, h_scales = quantize_rows(h, mma_order)
    y = torch.empty(routes, hidden, dtype=torch.bfloat16, device=hidden_states.device)
    launch_prefill_gemm(
        h8,
        fc2.codes,
        fc2.scale_bytes(),
        routing,
        y,
        schedule,
        None,
        epilogue="alpha",
        scale2=fc2.scale_2,
        x_mma_order=mma_order,
        x_row_scales=h_scales,
    )
    _combine(
        y, topk_weights, topk_ids, output, experts, fc2.scale_2, routing.seg_count, MODE_W4A16, False, False
    )
    return output
