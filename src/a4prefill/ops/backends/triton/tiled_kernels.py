"""The tiled grouped GEMMs of the ``triton`` backend (imported lazily: needs triton): FC1 + SwiGLU
(:func:`fc1_kernel`; after a K split :func:`fc1_finalize_kernel` applies its epilogue) and FC2
(:func:`fc2_kernel`), each program one tile of ``BM`` sorted routes of one expert (the routing
layout of :mod:`routing`) by ``BN`` output columns. The weights are dequantized in registers, the
MMA is ``tl.dot`` with fp32 accumulation and the global scales are applied in the epilogue
(:mod:`numerics`); A4 rows of FC1's output are re-quantized per 16 columns before the store.

Launched by :func:`a4prefill.ops.backends.triton.fused.fused_moe` for every call the decode
kernels do not take (its :class:`~a4prefill.ops.backends.triton.plan.CallPlan`: larger calls,
fp16 io, shapes no decode schedule fits, GPUs without them); the top-k sum is
:func:`shared_kernels.combine_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from a4prefill.ops.backends.triton.numerics import (
    A4_MODE,
    SPLIT_MODE,
    W4A16_MODE,
    _dequant_tile,
    _dequant_tile_ptx,
    _quantize_groups,
    _unscale,
    swiglu,
)


@triton.jit
def _mma_step(
    acc,
    a_base,
    rmask,
    w_ptrs,
    s_ptrs,
    nmask,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DTYPE: tl.constexpr,
    PTX: tl.constexpr,
):
    """``acc += A[:, k0:k0+BK] @ W[:, k0:k0+BK]^T`` with ``a_base [BM, 1]`` pointing at column k0
    (``acc`` holds ``2**-7`` times that with ``PTX``, bf16 io only)."""
    a = tl.load(a_base + tl.arange(0, BK)[None, :], mask=rmask[:, None], other=0.0)
    if PTX:
        w = _dequant_tile_ptx(w_ptrs, s_ptrs, nmask, BN, BK)
    else:
        w = _dequant_tile(w_ptrs, s_ptrs, nmask, BN, BK, DTYPE)
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _tile_rows(tile_expert_ptr, tile_row_ptr, seg_start_ptr, seg_count_ptr, pid_m, BM: tl.constexpr):
    expert = tl.load(tile_expert_ptr + pid_m)
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(seg_start_ptr + expert) + tl.load(seg_count_ptr + expert)
    rows = row0 + tl.arange(0, BM)
    return expert, rows, rows < row_end


@triton.jit
def _fc1_alpha(scale2, gs1_ptr, is_a4, MODE: tl.constexpr, BM: tl.constexpr):
    """Per-row FC1 epilogue multiplier [BM] of one half: ``scale2`` (W4A16) or ``scale2 / gs1`` (A4);
    ``is_a4`` [BM] picks per row in ``MODE`` 2."""
    if MODE == W4A16_MODE:
        alpha = tl.full([BM], 1.0, tl.float32) * scale2
    else:
        alpha_a4 = tl.math.div_rn(scale2, tl.load(gs1_ptr))
        if MODE == A4_MODE:
            alpha = tl.full([BM], 1.0, tl.float32) * alpha_a4
        else:
            alpha = tl.where(is_a4, alpha_a4, scale2)
    return alpha


@triton.jit
def _fc1_epilogue(
    acc_g,
    acc_u,
    expert,
    rows,
    rmask,
    token,
    n,
    nmask,
    w_scale2_ptr,
    gs1_ptr,
    gs2_ptr,
    flag_ptr,
    out_ptr,
    INTER,
    limit,
    HAS_LIMIT: tl.constexpr,
    MODE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PTX: tl.constexpr,
):
    """alpha1 per half (gate: ``w_scale2[e, 0]``, up: ``w_scale2[e, 1]``), io rounding, clamp,
    SwiGLU, A4 re-quantization with gs2[e]; stores ``h`` rows."""
    dtype = out_ptr.dtype.element_ty
    acc_g = _unscale(acc_g, PTX)
    acc_u = _unscale(acc_u, PTX)
    is_a4 = rmask  # per-row A4 flags in SPLIT_MODE; unused otherwise
    if MODE == SPLIT_MODE:
        is_a4 = tl.load(flag_ptr + token, mask=rmask, other=0) != 0
    alpha_g = _fc1_alpha(tl.load(w_scale2_ptr + expert * 2), gs1_ptr, is_a4, MODE, BM)
    alpha_u = _fc1_alpha(tl.load(w_scale2_ptr + expert * 2 + 1), gs1_ptr, is_a4, MODE, BM)
    h = swiglu(acc_g * alpha_g[:, None], acc_u * alpha_u[:, None], limit, HAS_LIMIT, dtype)
    if MODE != W4A16_MODE:
        gs2 = tl.load(gs2_ptr + expert)
        inv_gs2 = tl.math.div_rn(gs2 * 0.0 + 1.0, gs2)
        q, _, _ = _quantize_groups(h.to(tl.float32), gs2, inv_gs2, BM, BN)
        if MODE == A4_MODE:  # noqa: SIM108 (constexpr branch)
            h = q.to(dtype)
        else:
            h = tl.where(is_a4[:, None], q.to(dtype), h)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * INTER + n[None, :]
    tl.store(out_ptrs, h, mask=rmask[:, None] & nmask[None, :])


@triton.jit
def fc1_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    w_scale2_ptr,
    gs1_ptr,
    gs2_ptr,
    flag_ptr,
    sorted_route_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    seg_start_ptr,
    seg_count_ptr,
    num_tiles_ptr,
    out_ptr,
    H,
    INTER,
    TOPK,
    limit,
    HAS_LIMIT: tl.constexpr,
    MODE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PTX: tl.constexpr,
    SPLIT_K: tl.constexpr,
    acc_ptr,
):
    """Grouped FC1 + SwiGLU: ``out[p, n] = io(io(silu(gate)) * up)`` for sorted position p.

    ``x [T, H]`` io dtype (A4 rows already ``e2m1 * block_scale``), ``w [E, 2I, H/2]`` uint8,
    ``ws [E, 2I, H/16]`` e4m3 bytes, ``w_scale2 [E, 2]`` fp32, ``out [R, INTER]`` io dtype. A4 rows are
    re-quantized per 16 columns with ``gs2[e]`` before the store (FC2 input of the A4 path).
    With ``SPLIT_K > 1`` program axis 2 takes one K slice and adds its fp32 partial sums into
    ``acc [R, 2I]`` (zeroed; gate then up); :func:`fc1_finalize_kernel` applies the epilogue.
    """
    pid_m = tl.program_id(0)
    if pid_m >= tl.load(num_tiles_ptr):
        return
    pid_n = tl.program_id(1)
    expert, rows, rmask = _tile_rows(tile_expert_ptr, tile_row_ptr, seg_start_ptr, seg_count_ptr, pid_m, BM)
    token = tl.load(sorted_route_ptr + rows, mask=rmask, other=0) // TOPK
    dtype = out_ptr.dtype.element_ty
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < INTER
    ek = expert.to(tl.int64)
    half = H // 2
    a_ptrs = x_ptr + token.to(tl.int64)[:, None] * H
    wg_ptrs = w_ptr + ek * (2 * INTER * half) + n[:, None] * half + tl.arange(0, BK // 2)[None, :]
    wu_ptrs = wg_ptrs + INTER * half
    sg_ptrs = ws_ptr + ek * (2 * INTER * (H // 16)) + n[:, None] * (H // 16) + tl.arange(0, BK // 16)[None, :]
    su_ptrs = sg_ptrs + INTER * (H // 16)
    k_len = H // SPLIT_K
    if SPLIT_K > 1:
        k0 = tl.program_id(2) * k_len
        a_ptrs += k0
        wg_ptrs += k0 // 2
        wu_ptrs += k0 // 2
        sg_ptrs += k0 // 16
        su_ptrs += k0 // 16
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, k_len, BK):
        acc_g = _mma_step(acc_g, a_ptrs, rmask, wg_ptrs, sg_ptrs, nmask, BN, BK, dtype, PTX)
        acc_u = _mma_step(acc_u, a_ptrs, rmask, wu_ptrs, su_ptrs, nmask, BN, BK, dtype, PTX)
        a_ptrs += BK
        wg_ptrs += BK // 2
        wu_ptrs += BK // 2
        sg_ptrs += BK // 16
        su_ptrs += BK // 16
    if SPLIT_K > 1:
        store_mask = rmask[:, None] & nmask[None, :]
        acc_ptrs = acc_ptr + rows.to(tl.int64)[:, None] * (2 * INTER) + n[None, :]
        tl.atomic_add(acc_ptrs, acc_g, mask=store_mask, sem="relaxed")
        tl.atomic_add(acc_ptrs + INTER, acc_u, mask=store_mask, sem="relaxed")
    else:
        _fc1_epilogue(
            acc_g,
            acc_u,
            expert,
            rows,
            rmask,
            token,
            n,
            nmask,
            w_scale2_ptr,
            gs1_ptr,
            gs2_ptr,
            flag_ptr,
            out_ptr,
            INTER,
            limit,
            HAS_LIMIT,
            MODE,
            BM,
            BN,
            PTX,
        )


@triton.jit
def fc1_finalize_kernel(
    acc_ptr,
    w_scale2_ptr,
    gs1_ptr,
    gs2_ptr,
    flag_ptr,
    sorted_route_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    seg_start_ptr,
    seg_count_ptr,
    num_tiles_ptr,
    out_ptr,
    INTER,
    TOPK,
    limit,
    HAS_LIMIT: tl.constexpr,
    MODE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PTX: tl.constexpr,
):
    """The FC1 epilogue over split-K sums ``acc [R, 2I]`` fp32 (same tiles as FC1)."""
    pid_m = tl.program_id(0)
    if pid_m >= tl.load(num_tiles_ptr):
        return
    expert, rows, rmask = _tile_rows(tile_expert_ptr, tile_row_ptr, seg_start_ptr, seg_count_ptr, pid_m, BM)
    token = tl.load(sorted_route_ptr + rows, mask=rmask, other=0) // TOPK
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < INTER
    mask = rmask[:, None] & nmask[None, :]
    acc_ptrs = acc_ptr + rows.to(tl.int64)[:, None] * (2 * INTER) + n[None, :]
    acc_g = tl.load(acc_ptrs, mask=mask, other=0.0)
    acc_u = tl.load(acc_ptrs + INTER, mask=mask, other=0.0)
    _fc1_epilogue(
        acc_g,
        acc_u,
        expert,
        rows,
        rmask,
        token,
        n,
        nmask,
        w_scale2_ptr,
        gs1_ptr,
        gs2_ptr,
        flag_ptr,
        out_ptr,
        INTER,
        limit,
        HAS_LIMIT,
        MODE,
        BM,
        BN,
        PTX,
    )


@triton.jit
def fc2_kernel(
    h_ptr,
    w_ptr,
    ws_ptr,
    w_scale2_ptr,
    gs2_ptr,
    flag_ptr,
    sorted_route_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    seg_start_ptr,
    seg_count_ptr,
    num_tiles_ptr,
    y_ptr,
    H,
    INTER,
    TOPK,
    MODE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PTX: tl.constexpr,
    SPLIT_K: tl.constexpr,
    acc_ptr,
):
    """Grouped FC2: ``y[route(p), n] = io(acc * alpha2)`` with ``h [R, INTER]`` (sorted positions),
    ``w [E, H, INTER/2]`` uint8, ``ws [E, H, INTER/16]`` e4m3 bytes, ``w_scale2 [E]``, ``y [R, H]``."""
    pid_m = tl.program_id(0)
    if pid_m >= tl.load(num_tiles_ptr):
        return
    pid_n = tl.program_id(1)
    expert, rows, rmask = _tile_rows(tile_expert_ptr, tile_row_ptr, seg_start_ptr, seg_count_ptr, pid_m, BM)
    dtype = h_ptr.dtype.element_ty
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < H
    ek = expert.to(tl.int64)
    half = INTER // 2
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * INTER
    w_ptrs = w_ptr + ek * (H * half) + n[:, None] * half + tl.arange(0, BK // 2)[None, :]
    s_ptrs = ws_ptr + ek * (H * (INTER // 16)) + n[:, None] * (INTER // 16) + tl.arange(0, BK // 16)[None, :]
    k_len = INTER // SPLIT_K
    if SPLIT_K > 1:
        k0 = tl.program_id(2) * k_len
        a_ptrs += k0
        w_ptrs += k0 // 2
        s_ptrs += k0 // 16
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, k_len, BK):
        acc = _mma_step(acc, a_ptrs, rmask, w_ptrs, s_ptrs, nmask, BN, BK, dtype, PTX)
        a_ptrs += BK
        w_ptrs += BK // 2
        s_ptrs += BK // 16
    route = tl.load(sorted_route_ptr + rows, mask=rmask, other=0)
    if SPLIT_K > 1:
        acc_ptrs = acc_ptr + route.to(tl.int64)[:, None] * H + n[None, :]
        tl.atomic_add(acc_ptrs, acc, mask=rmask[:, None] & nmask[None, :], sem="relaxed")
        return
    scale2 = tl.load(w_scale2_ptr + expert)
    acc = _unscale(acc, PTX)
    if MODE == W4A16_MODE:
        alpha = tl.full([BM], 1.0, tl.float32) * scale2
    else:
        alpha_a4 = tl.math.div_rn(scale2, tl.load(gs2_ptr + expert))
        if MODE == A4_MODE:
            alpha = tl.full([BM], 1.0, tl.float32) * alpha_a4
        else:
            is_a4 = tl.load(flag_ptr + route // TOPK, mask=rmask, other=0) != 0
            alpha = tl.where(is_a4, alpha_a4, scale2)
    y = (acc * alpha[:, None]).to(dtype)
    y_ptrs = y_ptr + route.to(tl.int64)[:, None] * H + n[None, :]
    tl.store(y_ptrs, y, mask=rmask[:, None] & nmask[None, :])
