"""The warp-specialized Hopper prefill GEMM of the ``triton`` backend (Gluon, sm_90a; issue 23,
not yet chosen by any MoE call): ``grouped_w4_gemm_ws_kernel``, the register-weights GEMM of
:mod:`prefill_kernels` (``grouped_w4_gemm_rs_kernel``) with its copies and its two warpgroups
decoupled, and persistent.

A work item is 128 weight rows of one expert times ``BT`` sorted routes of it (one route tile
of the routing times one 128-row block: :func:`_works`). The kernel is persistent: program ``p``
of ``P`` (one per SM) takes items ``p, p + P, ...`` of the routing's live tiles, read on the
device (no host sync), as three partitions (``gl.warp_specialize``) that meet only at
mbarriers, never at a CTA barrier:

- a **producer** (``PRODUCER_WARPS`` warps, few registers; ``prefill.WS_PARTITIONS``): per K
  step of 64 columns it waits until ring slot ``s % DEPTH`` is free (``empty``),
  ``cp.async``-copies the step's code bytes and scale bytes of all 128 rows and the ``BT``
  activation rows (gathered by token for FC1) into the slot, and arrives on the slot's ``ready``
  barrier when its copies land (``cp.async.mbarrier.arrive.noinc``: one arrival per producer
  thread);
- two **consumers**, the default partition (weight rows 0-63) and a worker (rows 64-127), one
  warpgroup each: per step each waits for ``ready``, reads its 64 rows' code and scale bytes in
  :func:`~prefill_kernels.fragment_codes_layout`, dequantizes them into its wgmma A registers,
  issues the wgmma on the slot's rows, retires it and releases the slot (one arrival
  each, so ``empty`` counts two); after an item's last step each runs the epilogue of its 64 rows
  (:func:`~prefill_kernels._epilogue` with 64 rows from ``n0 + 64 * w``: the SwiGLU row pairing
  of :func:`~prefill_kernels._weight_row` holds per 16 rows, so the halves are independent).

The ring step ``s`` counts on across a program's items, so the producer copies the next item's
first steps while the consumers run the epilogue of the last one. A consumer dequantizes while
the other's wgmma runs. Same arguments, numerics and epilogues as the register-weights kernel
(``x``'s columns in ``prefill.mma_column_order``; the ModelOpt code layout as loaded).

Ordering (checked on the CPU by the TTGIR interpreter, which runs the partitions one at a time and
switches at every mbarrier wait and after every arrival): slot ``s % DEPTH`` is refilled for
ring step ``s + DEPTH`` only after both consumers released it, which each does after the wgmma
that read its rows retired; a consumer reads a slot only after its ``ready`` phase completed,
which needs every producer thread's copies of that step to have landed.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from a4prefill.ops.backends.triton.prefill_kernels import (
    _dequant_fragment,
    _epilogue,
    _tile,
    _tile_operands,
    acc_layout,
    fragment_codes_layout,
)

# cp.async into shared memory: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared``
# before (same arguments)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

CONSUMER_ROWS: gl.constexpr = gl.constexpr(64)  # weight rows per consumer warpgroup
STEP: gl.constexpr = gl.constexpr(64)  # K columns per step


@gluon.jit
def _works(N, num_tiles_ptr):
    """``(n_blocks, works)``: a work item ``w`` is route tile ``w // n_blocks`` times weight-row
    block ``w % n_blocks`` (128 rows each); ``works`` counts those of the routing's live tiles."""
    n_blocks = N // (2 * CONSUMER_ROWS)
    return n_blocks, n_blocks * gl.load(num_tiles_ptr)


@gluon.jit
def _produce(
    x_ptr,
    codes_ptr,
    scales_ptr,
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
    rings,
    GATHER: gl.constexpr,
    EPILOGUE: gl.constexpr,
    BT: gl.constexpr,
):
    """The producer partition: for each of the program's work items in turn, every step's copies
    into its ring slot, ``ready`` on landing. The ring runs on across work items: ``done`` counts
    the steps of the program's earlier items."""
    c_ring, s_ring, x_ring, ready, empty = rings
    DEPTH: gl.constexpr = x_ring.shape[0]
    n_blocks, works = _works(N, num_tiles_ptr)
    done = 0
    for work in range(gl.program_id(0), works, gl.num_programs(0)):
        code_ptrs, scale_ptrs, x_ptrs, x_mask, steps, _, _, _, _, _ = _tile_operands(
            work // n_blocks,
            work % n_blocks,
            x_ptr,
            codes_ptr,
            scales_ptr,
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
            GATHER,
            EPILOGUE,
            2 * CONSUMER_ROWS,
            BT,
            STEP,
        )
        for step in range(steps):
            s = done + step
            slot = s % DEPTH
            # the slot's previous use released by both consumers (its first use passes at once)
            mbarrier.wait(empty.index(slot), ((s // DEPTH) & 1) ^ 1)
            _async_load(c_ring.index(slot), code_ptrs + step * (STEP // 2))
            _async_load(s_ring.index(slot), scale_ptrs + step * (STEP // 16))
            _async_load(x_ring.index(slot), x_ptrs + step * STEP, mask=x_mask)
            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
        done += steps


@gluon.jit
def _mainloop(done, steps, HALF: gl.constexpr, rings, BT: gl.constexpr):
    """A consumer's ``steps`` steps of one work item, ring steps ``done`` on: its rows' fp32
    accumulator ``[64, BT]``. Per step: wait for the slot's copies, dequantize its rows' weights
    into the A registers, issue the wgmma, retire it (the next step's dequantization writes the
    same registers) and release the slot.

    (Two sets of A registers with one wgmma left in flight, as ``grouped_w4_gemm_rs_kernel``'s
    ``A_SETS = 2``, were tried in the tenth round: the ptxas of Triton 3.6 (CUDA 12.8)
    serializes every wgmma of that loop, "insufficient register resources", with this kernel's
    partitions; it was slower on the H200.)"""
    c_ring, s_ring, x_ring, ready, empty = rings
    DEPTH: gl.constexpr = x_ring.shape[0]
    ACC: gl.constexpr = acc_layout(BT, gl.num_warps())
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    FL: gl.constexpr = fragment_codes_layout(CONSUMER_ROWS, gl.num_warps(), 8)
    acc = gl.zeros([CONSUMER_ROWS, BT], gl.float32, layout=ACC)
    for step in range(steps):
        s = done + step
        slot = s % DEPTH
        mbarrier.wait(ready.index(slot), (s // DEPTH) & 1)
        fence_async_shared()  # the rows the copies wrote, before the wgmma reads them (async proxy)
        codes = c_ring.index(slot).slice(HALF * CONSUMER_ROWS, CONSUMER_ROWS, dim=0).load(FL)
        scale_slot = s_ring.index(slot).slice(HALF * CONSUMER_ROWS, CONSUMER_ROWS, dim=0)
        scales = scale_slot.load(gl.SliceLayout(2, FL))
        a = _dequant_fragment(codes, scales, A_LAYOUT, CONSUMER_ROWS)
        acc = warpgroup_mma(a, x_ring.index(slot).permute((1, 0)), acc, is_async=True)
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        mbarrier.arrive(empty.index(slot))
    return acc


@gluon.jit
def _consume(
    HALF: gl.constexpr,
    tensors,
    EPILOGUE: gl.constexpr,
    MODE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    BT: gl.constexpr,
    OUT_MMA_ORDER: gl.constexpr,
):
    """A consumer partition (one warpgroup, weight rows ``64 * HALF`` to ``64 * HALF + 63`` of
    each work item): for each of the program's work items in turn, every step's dequantization and
    wgmma (:func:`_mainloop`), then the epilogue of its rows, while the producer already copies the
    next item's first steps. ``tensors``: the kernel's ``out_ptr`` to ``limit`` arguments but
    ``GATHER``'s, then the rings and barriers."""
    (
        out_ptr,
        scale2_ptr,
        gs1_ptr,
        gs2_ptr,
        flag_ptr,
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
        limit,
        rings,
    ) = tensors
    n_blocks, works = _works(N, num_tiles_ptr)
    done = 0
    for work in range(gl.program_id(0), works, gl.num_programs(0)):
        steps, expert, row0, seg_end, n0, live_tile = _tile(
            work // n_blocks,
            work % n_blocks,
            tile_expert_ptr,
            tile_row_ptr,
            seg_start_ptr,
            seg_count_ptr,
            num_tiles_ptr,
            K,
            2 * CONSUMER_ROWS,
            STEP,
        )
        acc = _mainloop(done, steps, HALF, rings, BT)
        _epilogue(
            acc,
            out_ptr,
            scale2_ptr,
            sorted_route_ptr,
            expert,
            row0,
            seg_end,
            n0 + HALF * CONSUMER_ROWS,
            live_tile,
            N,
            ROUTES,
            TOPK,
            limit,
            gs1_ptr,
            gs2_ptr,
            flag_ptr,
            EPILOGUE,
            MODE,
            HAS_LIMIT,
            CONSUMER_ROWS,
            BT,
            OUT_MMA_ORDER,
        )
        done += steps


# ROUTES unspecialized: a call's route count must not pick another compiled kernel (a compile while
# serving after the load-time warm-up)
@gluon.jit(do_not_specialize=["ROUTES"])
def grouped_w4_gemm_ws_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    scale2_ptr,
    gs1_ptr,
    gs2_ptr,
    flag_ptr,
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
    limit,
    GATHER: gl.constexpr,
    EPILOGUE: gl.constexpr,
    MODE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    BT: gl.constexpr,
    DEPTH: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    PRODUCER_REGISTERS: gl.constexpr,
    CONSUMER_REGISTERS: gl.constexpr,
    OUT_MMA_ORDER: gl.constexpr,
):
    """``grouped_w4_gemm_rs_kernel``'s product and epilogues for work items of 128 weight rows
    and ``BT`` routes, warp-specialized and persistent (module docstring): launched with 4 warps
    (the default partition, consumer 0), plus a consumer warpgroup and ``PRODUCER_WARPS``
    producer warps as workers (``PRODUCER_REGISTERS`` and ``CONSUMER_REGISTERS`` per thread,
    ``setmaxnreg``). ``DEPTH`` ring slots, each a step's code bytes (128 x 32), scale bytes (128
    x 4) and activation rows (``BT`` x 64 bf16). Grid ``(P,)``, any ``P >= 1``
    (``prefill.persistent_programs``: one per SM)."""
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    X_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, STEP], gl.bfloat16)
    BARRIER: gl.constexpr = mbarrier.MBarrierLayout()
    c_ring = gl.allocate_shared_memory(gl.uint8, [DEPTH, 2 * CONSUMER_ROWS, STEP // 16, 8], PLAIN)
    s_ring = gl.allocate_shared_memory(gl.uint8, [DEPTH, 2 * CONSUMER_ROWS, STEP // 16], PLAIN2)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [DEPTH, BT, STEP], X_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], BARRIER)
    empty = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], BARRIER)
    for slot in gl.static_range(DEPTH):
        mbarrier.init(ready.index(slot), count=PRODUCER_WARPS * 32)  # every producer thread
        mbarrier.init(empty.index(slot), count=2)  # each consumer partition once
    rings = (c_ring, s_ring, x_ring, ready, empty)
    consumer = (
        out_ptr,
        scale2_ptr,
        gs1_ptr,
        gs2_ptr,
        flag_ptr,
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
        limit,
        rings,
    )
    gl.warp_specialize(
        [
            (_consume, (0, consumer, EPILOGUE, MODE, HAS_LIMIT, BT, OUT_MMA_ORDER)),
            (_consume, (1, consumer, EPILOGUE, MODE, HAS_LIMIT, BT, OUT_MMA_ORDER)),
            (
                _produce,
                (
                    x_ptr,
                    codes_ptr,
                    scales_ptr,
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
                    rings,
                    GATHER,
                    EPILOGUE,
                    BT,
                ),
            ),
        ],
        [4, PRODUCER_WARPS],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )
