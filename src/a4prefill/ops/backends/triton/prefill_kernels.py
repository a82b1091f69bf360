"""Hopper prefill GEMM of the ``triton`` backend (Gluon, sm_90a): one grouped NVFP4 GEMM for
many routes per expert, weights dequantized into shared memory, wgmma from shared memory.

Work in progress (issue 23): the GEMM core only, W4A16, no epilogue (no alpha, SwiGLU, A4
re-quantization); :func:`a4prefill.ops.backends.triton.prefill.launch_prefill_gemm` launches it
for the tests and ``benchmarks/bench_prefill_gemm.py``; :func:`~a4prefill.ops.backends.triton.
plan.plan_call` does not choose it yet.

Schedule (:class:`~a4prefill.ops.backends.triton.schedules.PrefillGemm`): a CTA multiplies
``BW`` weight rows of one expert (the wgmma's M: 64 per warpgroup, ``BW / 16`` warps) by ``BT``
sorted routes of that expert (the wgmma's N), over K in steps of ``BK`` columns. Per step:

- the step's FP4 code bytes and e4m3 scale bytes were loaded into registers one step ahead; they
  are dequantized there (``numerics.BYTE_DEQUANT_ASM``) and stored into an NVMMA-swizzled shared buffer;
- the step's activation rows were copied with ``cp.async`` into a second shared buffer one step
  ahead (gathered by token: ``sorted_route[p] // TOPK`` when ``GATHER``, else row ``p``);
- one asynchronous wgmma (both operands in shared memory) is issued and one is left in flight
  while the next step is dequantized.

Ordering invariant (``STAGES = 3`` buffers of each operand): buffer ``s`` is rewritten at step
``s + 3`` only after every warpgroup retired its wgmma of step ``s``: each warpgroup waits for all
but its newest wgmma before it reaches the next step's CTA barrier, and every write to a buffer
follows a barrier.

Numerics: weights ``e2m1 * block_scale * 2**-7`` exactly in bf16 (docs/numerics.md section 2),
fp32 accumulation, ``* 128`` undone before the bf16 store. Scale bytes ``0x7f``/``0xff`` decode
as 480/-480 (not NaN), as in :mod:`~a4prefill.ops.backends.triton.numerics`.
Only the order of the fp32 additions differs from the reference.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from a4prefill.ops.backends.triton.numerics import BYTE_DEQUANT_ASM, e4m3_bytes_f32

# cp.async into shared memory: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared``
# before (same arguments)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

# a CTA-wide barrier: ``gl.barrier`` from Triton 3.7 on, ``gl.thread_barrier`` before
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.constexpr_function
def codes_layout(bw: int, bk: int, warps: int) -> gl.BlockedLayout:
    """``[BW, BK / 16, 8]`` code bytes: each thread 16 consecutive bytes (2 scale groups)."""
    groups = bk // 16
    along_k = groups // 2
    return gl.BlockedLayout([1, 2, 8], [32 // along_k, along_k, 1], [warps, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def rows_layout(bk: int, warps: int) -> gl.BlockedLayout:
    """``[rows, BK]`` bf16 activations: 8 per thread (16 bytes)."""
    along_k = bk // 8
    return gl.BlockedLayout([1, 8], [32 // along_k, along_k], [warps, 1], [1, 0])


@gluon.constexpr_function
def acc_layout(bt: int, warps: int) -> gl.NVMMADistributedLayout:
    """The wgmma accumulator ``[BW, BT]``: warpgroups stacked on the weight rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, bt, 16])


@gluon.constexpr_function
def out_layout(bw: int, warps: int) -> gl.BlockedLayout:
    """``[BW, BT]`` output, 8 consecutive weight rows (output columns) per thread."""
    return gl.BlockedLayout([8, 1], [bw // 8, 32 // (bw // 8)], [1, warps], [0, 1])


@gluon.jit
def _load_weights(codes_ptr, scales_ptr, code_off, scale_off, k):
    """Code bytes ``[BW, BK / 16, 8]`` and scale bytes ``[BW, BK / 16]`` of the step at column k."""
    codes = gl.load(codes_ptr + code_off + k // 2)
    scales = gl.load(scales_ptr + scale_off + k // 16)
    return codes, scales


@gluon.jit
def _dequant(codes, scales, BW: gl.constexpr, BK: gl.constexpr):
    """codes ``[BW, G, 8]`` uint8, scale bytes ``[BW, G]`` -> ``[BW, BK]`` bf16 ``w * 2**-7``."""
    factor = (e4m3_bytes_f32(scales) * 6.646139978924579e35).to(gl.bfloat16)  # scale * 2**119
    factor = gl.broadcast(gl.expand_dims(factor, 2), codes)[0]
    even, odd = gl.inline_asm_elementwise(
        BYTE_DEQUANT_ASM,
        "=r,=r,=r,=r,r,r,r",
        [codes, factor],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=4,
    )
    return gl.reshape(gl.join(even, odd), [BW, BK])


@gluon.jit
def grouped_w4_gemm_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    sorted_route_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    seg_start_ptr,
    seg_count_ptr,
    num_tiles_ptr,
    N,
    K,
    ROUTES,
    TOPK,
    GATHER: gl.constexpr,
    BW: gl.constexpr,
    BT: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """``out[p, n] = sum_k x[x_row[p], k] * W[e, n, k]`` for the sorted positions p of each tile
    (bf16 out, fp32 accumulation). x bf16 ``[*, K]``; codes uint8 ``[E, N, K / 2]``; scales
    uint8 ``[E, N, K / 16]``; out bf16 ``[ROUTES, N]``. Grid ``(max_tiles, N / BW)``."""
    num_warps: gl.constexpr = gl.num_warps()
    CL: gl.constexpr = codes_layout(BW, BK, num_warps)
    XL: gl.constexpr = rows_layout(BK, num_warps)
    ACC: gl.constexpr = acc_layout(BT, num_warps)
    OUT: gl.constexpr = out_layout(BW, num_warps)
    W_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BW, BK], gl.bfloat16)
    X_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16)
    G: gl.constexpr = BK // 16

    tile = gl.program_id(0)
    n0 = gl.program_id(1) * BW
    idle = tile >= gl.load(num_tiles_ptr)
    expert = gl.load(tile_expert_ptr + tile)
    row0 = gl.load(tile_row_ptr + tile)
    seg_end = gl.load(seg_start_ptr + expert) + gl.load(seg_count_ptr + expert)
    steps = gl.where(idle, 0, K // BK)

    # weight offsets (within the expert, step 0)
    r3 = gl.arange(0, BW, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))
    g3 = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
    b3 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
    rows_w = (expert * N + n0 + r3).to(gl.int64)
    code_off = rows_w[:, None, None] * (K // 2) + g3[None, :, None] * 8 + b3[None, None, :]
    SL: gl.constexpr = gl.SliceLayout(2, CL)
    rs = gl.arange(0, BW, layout=gl.SliceLayout(1, SL))
    gs = gl.arange(0, G, layout=gl.SliceLayout(0, SL))
    scale_off = (expert * N + n0 + rs).to(gl.int64)[:, None] * (K // 16) + gs[None, :]

    # activation rows
    pos_x = row0 + gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
    live_x = (pos_x < seg_end) & (pos_x < ROUTES)
    if GATHER:
        x_rows = (gl.load(sorted_route_ptr + pos_x, mask=live_x, other=0) // TOPK).to(gl.int64)
    else:
        x_rows = pos_x.to(gl.int64)
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
    x_ptrs = x_ptr + x_rows[:, None] * K + cols[None, :]
    x_mask = live_x[:, None] & (cols[None, :] < BK)

    w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BW, BK], W_SMEM)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK], X_SMEM)
    acc = gl.zeros([BW, BT], gl.float32, layout=ACC)

    _async_load(x_smem.index(0), x_ptrs, mask=x_mask & (steps > 0))
    async_copy.commit_group()
    codes, scales = _load_weights(codes_ptr, scales_ptr, code_off, scale_off, 0)
    for step in range(steps):
        s = step % STAGES
        w_smem.index(s).store(_dequant(codes, scales, BW, BK))
        nxt = gl.minimum(step + 1, steps - 1) * BK
        codes, scales = _load_weights(codes_ptr, scales_ptr, code_off, scale_off, nxt)
        async_copy.wait_group(0)
        fence_async_shared()
        # every warpgroup has waited for its wgmma of step - 2 before reaching this barrier,
        # so buffers (step + 1) % 3 may be rewritten after it
        _cta_barrier()
        acc = warpgroup_mma(w_smem.index(s), x_smem.index(s).permute((1, 0)), acc, is_async=True)
        more = step + 1 < steps
        _async_load(x_smem.index((step + 1) % STAGES), x_ptrs + (step + 1) * BK, mask=x_mask & more)
        async_copy.commit_group()
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    y = gl.convert_layout((acc * 128.0).to(gl.bfloat16), OUT)
    w_idx = gl.arange(0, BW, layout=gl.SliceLayout(1, OUT))
    pos = row0 + gl.arange(0, BT, layout=gl.SliceLayout(0, OUT))
    live = (pos < seg_end) & (pos < ROUTES) & (tile < gl.load(num_tiles_ptr))
    ptrs = out_ptr + pos.to(gl.int64)[None, :] * N + n0 + w_idx[:, None]
    gl.store(ptrs, y, mask=live[None, :] & (w_idx[:, None] < BW))
