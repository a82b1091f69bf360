"""Hopper prefill GEMMs of the ``triton`` backend (Gluon, sm_90a): one grouped NVFP4 GEMM for
many routes per expert, the weights dequantized into shared memory (``grouped_w4_gemm_kernel``,
wgmma from shared memory) or into the wgmma's A registers (``grouped_w4_gemm_rs_kernel``).

MoE calls of at least ``schedules.PREFILL_MIN_ROWS_PER_EXPERT`` routes per expert with bf16
activations on an sm_90 GPU run FC1 with the SwiGLU epilogue and FC2 with the alpha epilogue
(:func:`_epilogue`; ``plan.plan_call``, ``fused._fused_moe_prefill``), W4A16, A4 and split calls
alike (``MODE``: the A4 routes' multipliers and FC1's re-quantization).
:func:`a4prefill.ops.backends.triton.prefill.launch_prefill_gemm` launches either kernel; the raw
product (``EPILOGUE_NONE``) serves the GEMM-core tests and ``benchmarks/bench_prefill_gemm.py``.

Schedule (:class:`~a4prefill.ops.backends.triton.schedules.PrefillGemm`): a CTA multiplies
``BW`` weight rows of one expert (the wgmma's M: 64 per warpgroup, ``BW / 16`` warps) by ``BT``
sorted routes of that expert (the wgmma's N), over K in steps of ``BK`` columns.

Pipeline. ``cp.async`` copies the FP4 code bytes, the e4m3 scale bytes and the activation rows
(gathered by token: ``sorted_route[p] // TOPK`` when ``GATHER``, else row ``p``) of step
``s + DEPTH - 2`` into a ring of ``DEPTH`` shared buffers while step ``s`` runs, so a global
load has ``DEPTH - 2`` steps to land. Per step, after waiting for its copies and a CTA barrier:

- the step's codes and scales are read from shared memory into registers, dequantized there
  (``numerics.BYTE_DEQUANT_ASM``) and stored into one of 3 NVMMA-swizzled weight buffers;
- after a fence and a second CTA barrier one asynchronous wgmma (both operands in shared
  memory) is issued, the copies of step ``s + DEPTH - 2`` are issued, and one wgmma is left in
  flight while the next step is dequantized.

Ordering invariants (checked on the CPU by the TTGIR interpreter within a program; across
warpgroups they follow from the barriers):

- ring slot ``(s - 2) % DEPTH`` is refilled at step ``s``, after its second barrier: its codes and
  scales were read into registers at step ``s - 2``, and every warpgroup retired its wgmma of step
  ``s - 2`` (which read the slot's activation rows) at the end of step ``s - 1``, before the
  barriers of step ``s``;
- weight buffer ``s % 3`` is rewritten at step ``s`` after the second barrier of step ``s - 1``,
  which every warpgroup reached after retiring its wgmma of step ``s - 3``;
- exactly one commit group per step (masked copies past the last step), so ``wait_group(DEPTH -
  3)`` at step ``s`` completes the copies of step ``s``.

Idle programs (``tile >= num_tiles``: the grid is sized by ``max_tiles``) read no routing entry
beyond ``num_tiles`` (those are not initialized) and no memory at all. The grid is ``(N / BW,
max_tiles)``: CTAs launched together share one tile's activation rows, which stay in L2 (8-20%
faster than the other order on the H200, benchmarks/results/README.md).

Numerics: weights ``e2m1 * block_scale * 2**-7`` exactly in bf16 (docs/numerics.md section 2),
fp32 accumulation, ``* 128`` undone in the epilogue. Scale bytes ``0x7f``/``0xff`` decode as
480/-480 (not NaN), as in :mod:`~a4prefill.ops.backends.triton.numerics`. The epilogues have the
reference's rounding points; apart from the order of the fp32 additions, only silu's division
differs (approximate, ``numerics.swiglu(IEEE_DIV=False)``: within 2 fp32 ulps before the bf16
rounding; docs/numerics.md).
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

from a4prefill.ops.backends.triton.numerics import (
    BYTE_DEQUANT_ASM,
    SCALE_BYTES_FACTORS_ASM,
    WORD_PAIR_DEQUANT_ASM,
    _quantize_groups,
    swiglu,
)
from a4prefill.ops.backends.triton.schedules import PREFILL_EPILOGUES
from a4prefill.ops.precision import MODE_A4, MODE_SPLIT, MODE_W4A16

EPILOGUE_NONE: gl.constexpr = gl.constexpr(PREFILL_EPILOGUES["none"])
EPILOGUE_SWIGLU: gl.constexpr = gl.constexpr(PREFILL_EPILOGUES["swiglu"])
EPILOGUE_ALPHA: gl.constexpr = gl.constexpr(PREFILL_EPILOGUES["alpha"])
W4A16_MODE: gl.constexpr = gl.constexpr(MODE_W4A16)
A4_MODE: gl.constexpr = gl.constexpr(MODE_A4)
SPLIT_MODE: gl.constexpr = gl.constexpr(MODE_SPLIT)

# cp.async into shared memory: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared``
# before (same arguments)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

# a CTA-wide barrier: ``gl.barrier`` from Triton 3.7 on, ``gl.thread_barrier`` before
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# dequantized weight buffers (the ordering invariant of the module docstring needs 3)
W_BUFFERS: gl.constexpr = gl.constexpr(3)


@gluon.constexpr_function
def codes_layout(bw: int, bk: int, warps: int) -> gl.BlockedLayout:
    """``[BW, BK / 16, 8]`` code bytes: each thread 16 consecutive bytes (2 scale groups)."""
    groups = bk // 16
    along_k = groups // 2
    return gl.BlockedLayout([1, 2, 8], [32 // along_k, along_k, 1], [warps, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def scale_copy_layout(bk: int, warps: int) -> gl.BlockedLayout:
    """``[BW, BK / 16]`` scale bytes for ``cp.async``: a row's ``BK / 16`` bytes (4 or 8) per
    thread (threads beyond ``BW`` rows hold copies of the same bytes)."""
    return gl.BlockedLayout([1, bk // 16], [32, 1], [warps, 1], [1, 0])


@gluon.constexpr_function
def row_piece_layout(row_bytes: int, element_bits: int, warps: int) -> gl.BlockedLayout:
    """``[rows, row_bytes * 8 / element_bits]`` activation rows of one step (a multiple of 16
    bytes a row, at most 512): 16 bytes a thread (8 bf16 or 16 e4m3 elements), a row's pieces on
    consecutive lanes; the layout of each step's row loads and ``cp.async`` copies."""
    along = row_bytes // 16
    return gl.BlockedLayout([1, 128 // element_bits], [32 // along, along], [warps, 1], [1, 0])


@gluon.constexpr_function
def acc_layout(bt: int, warps: int) -> gl.NVMMADistributedLayout:
    """The wgmma accumulator ``[BW, BT]``: warpgroups stacked on the weight rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, bt, 16])


@gluon.constexpr_function
def out_layout(bw: int, warps: int) -> gl.BlockedLayout:
    """``[BW, BT]`` output, 8 consecutive weight rows (output columns) per thread."""
    return gl.BlockedLayout([8, 1], [bw // 8, 32 // (bw // 8)], [1, warps], [0, 1])


@gluon.jit
def _dequant_nibbles(codes, scales, ASM: gl.constexpr = BYTE_DEQUANT_ASM):
    """codes ``[BW, G, B]`` uint8, scale bytes ``[BW, G]`` -> two ``[BW, G, B]`` bf16 ``w * 2**-7``
    (:func:`nibbles_times` with ``ASM``: by default the low and the high nibble of each byte, in
    the codes' layout; ``B`` a multiple of 4: the assembly takes 4 bytes of a thread at a time)."""
    return nibbles_times(codes, scale_factors(scales), ASM)


@gluon.jit
def scale_factors(scales):
    """e4m3 scale bytes (uint8, any shape whose elements a thread holds in pairs) -> the bf16
    factors ``scale * 2**119`` (exact; ``0x7f``/``0xff`` -> +-480 like
    :func:`numerics.e4m3_bytes_f32`) of :func:`nibbles_times`, two bytes per
    :data:`numerics.SCALE_BYTES_FACTORS_ASM` (a ``prmt``, three logic operations and two bf16x2
    products: about 3.5 instructions a byte, where decoding through fp16 and fp32 took 7.5)."""
    return gl.inline_asm_elementwise(
        SCALE_BYTES_FACTORS_ASM,
        "=r,r,r",
        [scales.to(gl.int32)],
        dtype=gl.bfloat16,
        is_pure=True,
        pack=2,
    )


@gluon.jit
def nibbles_times(codes, factor, ASM: gl.constexpr = BYTE_DEQUANT_ASM):
    """codes ``[BW, G, B]`` uint8, ``factor [BW, G]`` bf16 -> two ``[BW, G, B]`` bf16 tensors of
    ``e2m1 * 2**-126 * factor`` (exact when the product has at most 8 significant bits and is a
    normal bf16), in the codes' layout (``B`` a multiple of 4). ``ASM`` places the nibbles of each
    4 bytes: ``numerics.BYTE_DEQUANT_ASM`` the low nibbles in the first tensor and the high ones
    in the second, ``numerics.WORD_PAIR_DEQUANT_ASM`` the nibble pairs ``(n0, n4)``, ``(n1, n5)``
    of the code word in the first and ``(n2, n6)``, ``(n3, n7)`` in the second."""
    factor = gl.broadcast(gl.expand_dims(factor, 2), codes)[0]
    return gl.inline_asm_elementwise(
        ASM,
        "=r,=r,=r,=r,r,r,r",
        [codes, factor],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _dequant(codes, scales, BW: gl.constexpr, BK: gl.constexpr):
    """codes ``[BW, G, 8]`` uint8, scale bytes ``[BW, G]`` -> ``[BW, BK]`` bf16 ``w * 2**-7``."""
    even, odd = _dequant_nibbles(codes, scales)
    return gl.reshape(gl.join(even, odd), [BW, BK])


@gluon.jit
def _issue_copies(c_slot, s_slot, x_slot, code_ptrs, scale_ptrs, x_ptrs, x_mask, k, live):
    """cp.async the code bytes, scale bytes and activation rows of the step at column ``k`` into
    one ring slot (nothing when not ``live``), as one commit group."""
    _async_load(c_slot, code_ptrs + k // 2, mask=live)
    _async_load(s_slot, scale_ptrs + k // 16, mask=live)
    _async_load(x_slot, x_ptrs + k, mask=x_mask & live)
    async_copy.commit_group()


@gluon.jit
def _weight_row(n0, r, N, EPILOGUE: gl.constexpr):
    """The expert's weight row that CTA row ``r`` multiplies: ``n0 + r``, or for the SwiGLU
    epilogue (FC1: ``N = 2 I`` rows, gate rows then up rows) gate row ``j`` at rows ``16 b + i``
    and up row ``I + j`` at rows ``16 b + 8 + i`` (``i < 8``, ``j = n0 / 2 + 8 b + i``): a wgmma
    accumulator thread holds rows ``r`` and ``r + 8`` of each 16, hence both inputs of its SwiGLU
    outputs."""
    if EPILOGUE == EPILOGUE_SWIGLU:
        return n0 // 2 + (r // 16) * 8 + r % 8 + ((r // 8) % 2) * (N // 2)
    else:
        return n0 + r


@gluon.jit
def _tile(
    tile,
    n_block,
    tile_expert_ptr,
    tile_row_ptr,
    seg_start_ptr,
    seg_count_ptr,
    num_tiles_ptr,
    K,
    BW: gl.constexpr,
    BK: gl.constexpr,
):
    """Route tile ``tile`` of the routing times weight-row block ``n_block``, scalars only:
    ``(steps, expert, row0, seg_end, n0, live_tile)`` (``BW`` weight rows from ``n0 = n_block *
    BW``, ``K / BK`` steps; ``steps`` 0 for an idle tile, ``tile >= num_tiles``, which reads no
    routing entry past ``num_tiles``). The one-tile kernels pass ``(program_id(1),
    program_id(0))`` of their grid ``(N / BW, max_tiles)``, so that the CTAs launched together
    share a tile's activation rows."""
    n0 = n_block * BW
    live_tile = tile < gl.load(num_tiles_ptr)
    expert = gl.load(tile_expert_ptr + tile, mask=live_tile, other=0)
    row0 = gl.load(tile_row_ptr + tile, mask=live_tile, other=0)
    seg_end = gl.load(seg_start_ptr + expert) + gl.load(seg_count_ptr + expert)
    steps = gl.where(live_tile, K // BK, 0)
    return steps, expert, row0, seg_end, n0, live_tile


@gluon.jit
def _scale_pointers(
    scales_ptr,
    expert,
    n0,
    N,
    K,
    EPILOGUE: gl.constexpr,
    BW: gl.constexpr,
    BK: gl.constexpr,
    WORD_BYTES: gl.constexpr = 1,
):
    """The ``[BW, BK / 16 / WORD_BYTES]`` pointers (``scale_copy_layout`` of ``BK /
    WORD_BYTES``) to the scale bytes (``WORD_BYTES`` 1: uint8) or words (4: int32, little-endian
    groups of 4 bytes) of step 0 of the expert's ``BW`` weight rows from ``n0`` (rows as
    :func:`_weight_row`); a step's are at ``+ k // 16 // WORD_BYTES``. The row stride is written
    as a multiple of the copy width (``K`` a multiple of ``BK``), so that the compiler proves the
    ``BK / 16``-byte copies aligned."""
    SCL: gl.constexpr = scale_copy_layout(BK // WORD_BYTES, gl.num_warps())
    G: gl.constexpr = BK // 16 // WORD_BYTES
    rs = gl.arange(0, BW, layout=gl.SliceLayout(1, SCL))
    gs = gl.arange(0, G, layout=gl.SliceLayout(0, SCL))
    scale_rows = (expert * N + _weight_row(n0, rs, N, EPILOGUE)).to(gl.int64)
    if WORD_BYTES == 4:
        scales_ptr = scales_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    return scales_ptr + (scale_rows[:, None] * ((K // BK) * G) + gs[None, :])


@gluon.jit
def _tile_operands(
    tile,
    n_block,
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
    GATHER: gl.constexpr,
    EPILOGUE: gl.constexpr,
    BW: gl.constexpr,
    BT: gl.constexpr,
    BK: gl.constexpr,
):
    """The tile of :func:`_tile` and the copy pointers of its step 0: ``(code_ptrs [BW, BK / 16, 8],
    scale_ptrs [BW, BK / 16], x_ptrs [BT, BK], x_mask, steps, expert, row0, seg_end, n0,
    live_tile)``; weight rows as :func:`_weight_row`.
    ``steps`` is 0 for an idle program (``tile >= num_tiles``), which reads no routing entry past
    ``num_tiles`` (a step's copies are at ``+ k // 2``, ``+ k // 16`` and ``+ k``)."""
    num_warps: gl.constexpr = gl.num_warps()
    CL: gl.constexpr = codes_layout(BW, BK, num_warps)
    XL: gl.constexpr = row_piece_layout(BK * 2, 16, num_warps)
    G: gl.constexpr = BK // 16

    steps, expert, row0, seg_end, n0, live_tile = _tile(
        tile, n_block, tile_expert_ptr, tile_row_ptr, seg_start_ptr, seg_count_ptr, num_tiles_ptr, K, BW, BK
    )

    # code bytes [BW, G, 8] of the expert's rows n0.., step 0
    r3 = gl.arange(0, BW, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))
    g3 = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
    b3 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
    # row strides written as multiples of the copy widths (K is a multiple of BK), so that the
    # compiler proves 16-byte code and BK / 16-byte scale copies aligned
    steps_k = K // BK
    rows_w = (expert * N + _weight_row(n0, r3, N, EPILOGUE)).to(gl.int64)
    code_off = rows_w[:, None, None] * (steps_k * (BK // 2)) + g3[None, :, None] * 8 + b3[None, None, :]
    code_ptrs = codes_ptr + code_off
    scale_ptrs = _scale_pointers(scales_ptr, expert, n0, N, K, EPILOGUE, BW, BK)
    # activation rows [BT, BK], step 0
    pos_x = row0 + gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
    live_x = (pos_x < seg_end) & (pos_x < ROUTES) & live_tile
    if GATHER:
        x_rows = (gl.load(sorted_route_ptr + pos_x, mask=live_x, other=0) // TOPK).to(gl.int64)
    else:
        x_rows = pos_x.to(gl.int64)
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
    x_ptrs = x_ptr + x_rows[:, None] * K + cols[None, :]
    x_mask = live_x[:, None] & (cols[None, :] < BK)
    return code_ptrs, scale_ptrs, x_ptrs, x_mask, steps, expert, row0, seg_end, n0, live_tile


@gluon.jit
def _routes_a4(flag_ptr, sorted_route_ptr, pos, live, TOPK, MODE: gl.constexpr):
    """Per sorted position ``pos`` (a vector): whether its route's token is an A4 row
    (``SPLIT_MODE``: ``flag[sorted_route[pos] // TOPK] != 0``); in the uniform modes a placeholder."""
    if MODE == SPLIT_MODE:
        route = gl.load(sorted_route_ptr + pos, mask=live, other=0)
        return gl.load(flag_ptr + route // TOPK, mask=live, other=0) != 0
    else:
        return live


@gluon.jit
def _route_precision(
    flag_ptr,
    sorted_route_ptr,
    row0,
    seg_end,
    live_tile,
    ROUTES,
    TOPK,
    BT: gl.constexpr,
    MODE: gl.constexpr,
    LAYOUT: gl.constexpr,
):
    """``(live, is_a4)`` of the tile's ``BT`` positions, ``[BT]`` in ``LAYOUT``: whether the position
    is inside the expert's segment, and whether its route is an A4 row (:func:`_routes_a4`). In
    ``SPLIT_MODE`` the flags are loaded once per position in a compact layout and converted to
    ``LAYOUT``: a layout holding many positions per thread (the accumulator's columns) would
    otherwise compute two pointers and load twice per position in every thread."""
    pos = row0 + gl.arange(0, BT, layout=LAYOUT)
    live = (pos < seg_end) & (pos < ROUTES) & live_tile
    if MODE == SPLIT_MODE:
        COMPACT: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        pos_c = row0 + gl.arange(0, BT, layout=COMPACT)
        live_c = (pos_c < seg_end) & (pos_c < ROUTES) & live_tile
        is_a4 = gl.convert_layout(_routes_a4(flag_ptr, sorted_route_ptr, pos_c, live_c, TOPK, MODE), LAYOUT)
    else:
        is_a4 = live
    return live, is_a4


@gluon.jit
def _alpha(scale2, encode_scale_ptr, is_a4, MODE: gl.constexpr):
    """The epilogue multiplier: ``scale2`` for W4A16 routes, ``div_rn(scale2, encode_scale)`` for A4
    routes (docs/numerics.md section 4); per route (``is_a4``) in ``SPLIT_MODE``."""
    if MODE == W4A16_MODE:
        return scale2
    elif MODE == A4_MODE:
        return gl.div_rn(scale2, gl.load(encode_scale_ptr))
    else:
        return gl.where(is_a4, gl.div_rn(scale2, gl.load(encode_scale_ptr)), scale2)


@gluon.jit
def _requantize(h, gs2_ptr, is_a4, MODE: gl.constexpr):
    """FC1's bf16 output ``h [J, BT]`` (16-aligned columns of ``h`` on axis 0, routes on axis 1) of
    A4 routes quantized per 16 columns with the expert's encode scale ``gs2`` (the values
    ``e2m1 * block_scale``, :func:`numerics._quantize_groups`, as the tiled and decode kernels);
    W4A16 routes (``SPLIT_MODE``, ``is_a4 [BT]`` False) keep ``h``."""
    J: gl.constexpr = h.shape[0]
    T: gl.constexpr = h.shape[1]
    gs2 = gl.load(gs2_ptr)
    inv_gs2 = gl.div_rn(gs2 * 0.0 + 1.0, gs2)
    q, _, _ = _quantize_groups(gl.permute(h.to(gl.float32), [1, 0]), gs2, inv_gs2, T, J)
    q = gl.convert_layout(gl.permute(q, [1, 0]), h.type.layout).to(gl.bfloat16)
    if MODE == A4_MODE:
        return q
    else:
        return gl.where(is_a4[None, :], q, h)


@gluon.jit
def _epilogue(
    acc,
    out_ptr,
    scale2_ptr,
    sorted_route_ptr,
    expert,
    row0,
    seg_end,
    n0,
    live_tile,
    N,
    ROUTES,
    TOPK,
    limit,
    gs1_ptr,
    gs2_ptr,
    flag_ptr,
    EPILOGUE: gl.constexpr,
    MODE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    BW: gl.constexpr,
    BT: gl.constexpr,
    OUT_MMA_ORDER: gl.constexpr,
):
    """Write the tile's sorted positions ``p`` inside the expert's segment; ``acc * 128`` undoes
    the ``2**-7`` of the dequantization:

    - ``EPILOGUE_NONE``: ``out[p, n0 + i] = bf16(acc[i, p])`` (``out [ROUTES, N]``, the GEMM core);
    - ``EPILOGUE_SWIGLU`` (FC1): ``out[p, n0 / 2 + j] = swiglu(gate * alpha[e, 0], up * alpha[e,
      1])`` with the rounding points of :func:`~a4prefill.ops.backends.triton.numerics.swiglu`
      (``out [ROUTES, N / 2]``, ``scale2 [E, 2]`` fp32, rows paired as :func:`_weight_row`);
    - ``EPILOGUE_ALPHA`` (FC2): ``out[sorted_route[p], n0 + i] = bf16(acc[i, p] * alpha[e])``
      (``out [ROUTES, N]`` by route, ``scale2 [E]`` fp32), as the tiled FC2.

    ``MODE`` (``precision.MODE_*``): in A4 and split calls the multipliers of A4 routes are
    ``scale2 / gs1`` (FC1, ``gs1 [1]``) and ``scale2 / gs2[e]`` (FC2, ``gs2 [E]``), and FC1 re-quantizes
    their ``h`` per 16 columns with ``gs2[e]``; a split call reads its routes' precision from
    ``flag [T]`` (uint8, 1 = A4) at token ``sorted_route[p] // TOPK``. The W4A16 code is the same as
    without a mode.

    ``OUT_MMA_ORDER``: each output column ``c`` goes to position ``p`` of its 64 with
    ``mma_column_order[p] = c`` (``prefill.mma_column_order``), so that FC1's ``h`` is already the
    register-weights FC2's activation order (no gather of ``h`` between the two)."""
    SWIGLU: gl.constexpr = EPILOGUE == EPILOGUE_SWIGLU
    OUT_ROWS: gl.constexpr = BW // 2 if SWIGLU else BW
    OUT: gl.constexpr = out_layout(OUT_ROWS, gl.num_warps())
    if MODE != W4A16_MODE:
        # the routes' liveness and precision in the store layout, where A4/split epilogues apply
        # each route's multipliers (few routes per thread)
        live_out, is_a4_out = _route_precision(
            flag_ptr,
            sorted_route_ptr,
            row0,
            seg_end,
            live_tile,
            ROUTES,
            TOPK,
            BT,
            MODE,
            gl.SliceLayout(0, OUT),
        )
    if SWIGLU:
        # a thread's rows r and r + 8 of each 16 are a gate and its up row (_weight_row): the
        # split renames registers
        gate, up = gl.split(gl.permute(gl.reshape(acc * 128.0, [BW // 16, 2, 8, BT]), (0, 2, 3, 1)))
        # the multipliers and SwiGLU in the store layout (few routes per thread), on the fp32
        # products: the same roundings as in the accumulator's layout, fewer registers (W4A16 at
        # 128-route tiles with OUT_MMA_ORDER: 130 registers in the accumulator's layout, one CTA
        # per SM instead of two)
        gate = gl.convert_layout(gl.reshape(gate, [OUT_ROWS, BT]), OUT)
        up = gl.convert_layout(gl.reshape(up, [OUT_ROWS, BT]), OUT)
        if MODE == W4A16_MODE:
            gate = gate * gl.load(scale2_ptr + expert * 2)
            up = up * gl.load(scale2_ptr + expert * 2 + 1)
            y = swiglu(gate, up, limit, HAS_LIMIT, gl.bfloat16, False)
        else:
            # [BT] multipliers (0 past the segment: those positions are not stored)
            alpha_g = gl.where(
                live_out, _alpha(gl.load(scale2_ptr + expert * 2), gs1_ptr, is_a4_out, MODE), 0.0
            )
            alpha_u = gl.where(
                live_out, _alpha(gl.load(scale2_ptr + expert * 2 + 1), gs1_ptr, is_a4_out, MODE), 0.0
            )
            h = swiglu(gate * alpha_g[None, :], up * alpha_u[None, :], limit, HAS_LIMIT, gl.bfloat16, False)
            y = _requantize(h, gs2_ptr + expert, is_a4_out, MODE)
    else:
        acc = acc * 128.0
        if EPILOGUE == EPILOGUE_ALPHA and MODE != W4A16_MODE:
            # each route's multiplier in the store layout (few routes per thread), on the fp32
            # product: the same rounding as multiplying in the accumulator's layout
            y32 = gl.convert_layout(acc, OUT)
            alpha = _alpha(gl.load(scale2_ptr + expert), gs2_ptr + expert, is_a4_out, MODE)
            y = (y32 * gl.where(live_out, alpha, 0.0)[None, :]).to(gl.bfloat16)
        else:
            if EPILOGUE == EPILOGUE_ALPHA:
                acc = acc * gl.load(scale2_ptr + expert)
            y = gl.convert_layout(acc.to(gl.bfloat16), OUT)
    w_idx = gl.arange(0, OUT_ROWS, layout=gl.SliceLayout(1, OUT))
    pos = row0 + gl.arange(0, BT, layout=gl.SliceLayout(0, OUT))
    live = (pos < seg_end) & (pos < ROUTES) & live_tile
    out_rows = gl.load(sorted_route_ptr + pos, mask=live, other=0) if EPILOGUE == EPILOGUE_ALPHA else pos
    # FC1's SwiGLU halves the row count: N / 2 columns of h, this CTA's from n0 / 2
    col0 = n0 // 2 if SWIGLU else n0
    row_stride = N // 2 if SWIGLU else N
    col = col0 + w_idx
    if OUT_MMA_ORDER:
        # column 16 q + 8 (b // 4) + b % 4 + 4 h of each 64 at position 8 b + 2 q + h
        # (prefill.mma_column_order)
        col = col - col % 64 + 8 * (4 * ((col % 16) // 8) + col % 4) + 2 * ((col % 64) // 16) + (col % 8) // 4
    ptrs = out_ptr + out_rows.to(gl.int64)[None, :] * row_stride + col[:, None]
    gl.store(ptrs, y, mask=live[None, :] & (w_idx[:, None] < OUT_ROWS))


# ROUTES unspecialized: a call's route count must not pick another compiled kernel (a compile while
# serving after the load-time warm-up)
@gluon.jit(do_not_specialize=["ROUTES"])
def grouped_w4_gemm_kernel(
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
    BW: gl.constexpr,
    BT: gl.constexpr,
    BK: gl.constexpr,
    DEPTH: gl.constexpr,
    OUT_MMA_ORDER: gl.constexpr,
):
    """``out[p, n] = sum_k x[x_row[p], k] * W[e, n, k]`` for the sorted positions p of each tile
    (bf16 out, fp32 accumulation). x bf16 ``[*, K]``; codes uint8 ``[E, N, K / 2]``; scales
    uint8 ``[E, N, K / 16]``; out bf16 ``[ROUTES, N]``. Grid ``(N / BW, max_tiles)``;
    ``DEPTH >= 3`` ring slots of copies; ``OUT_MMA_ORDER`` as :func:`_epilogue`."""
    num_warps: gl.constexpr = gl.num_warps()
    CL: gl.constexpr = codes_layout(BW, BK, num_warps)
    SL: gl.constexpr = gl.SliceLayout(2, CL)
    ACC: gl.constexpr = acc_layout(BT, num_warps)
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    W_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BW, BK], gl.bfloat16)
    X_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16)
    G: gl.constexpr = BK // 16
    AHEAD: gl.constexpr = DEPTH - 2

    code_ptrs, scale_ptrs, x_ptrs, x_mask, steps, expert, row0, seg_end, n0, live_tile = _tile_operands(
        gl.program_id(1),
        gl.program_id(0),
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
        BW,
        BT,
        BK,
    )

    c_ring = gl.allocate_shared_memory(gl.uint8, [DEPTH, BW, G, 8], PLAIN)
    s_ring = gl.allocate_shared_memory(gl.uint8, [DEPTH, BW, G], PLAIN2)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [DEPTH, BT, BK], X_SMEM)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [W_BUFFERS, BW, BK], W_SMEM)
    acc = gl.zeros([BW, BT], gl.float32, layout=ACC)

    for ahead in gl.static_range(AHEAD):
        _issue_copies(
            c_ring.index(ahead),
            s_ring.index(ahead),
            x_ring.index(ahead),
            code_ptrs,
            scale_ptrs,
            x_ptrs,
            x_mask,
            ahead * BK,
            ahead < steps,
        )
    for step in range(steps):
        slot = step % DEPTH
        async_copy.wait_group(AHEAD - 1)
        _cta_barrier()  # every thread's copies of this step have landed
        codes = c_ring.index(slot).load(CL)
        scales = s_ring.index(slot).load(SL)
        w = w_bufs.index(step % W_BUFFERS)
        w.store(_dequant(codes, scales, BW, BK))
        fence_async_shared()
        _cta_barrier()
        acc = warpgroup_mma(w, x_ring.index(slot).permute((1, 0)), acc, is_async=True)
        refill = (step + AHEAD) % DEPTH
        _issue_copies(
            c_ring.index(refill),
            s_ring.index(refill),
            x_ring.index(refill),
            code_ptrs,
            scale_ptrs,
            x_ptrs,
            x_mask,
            (step + AHEAD) * BK,
            step + AHEAD < steps,
        )
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)
    _cta_barrier()  # every thread's (masked, zero-filling) copies landed before the epilogue's scratch

    _epilogue(
        acc,
        out_ptr,
        scale2_ptr,
        sorted_route_ptr,
        expert,
        row0,
        seg_end,
        n0,
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
        BW,
        BT,
        OUT_MMA_ORDER,
    )


@gluon.constexpr_function
def fragment_codes_layout(bw: int, warps: int, step_bytes: int = 8) -> gl.DistributedLinearLayout:
    """``[BW, 4, step_bytes]`` code bytes of one wgmma's columns (row, 16-column group, byte;
    ``step_bytes`` 8: 64 columns, 4: 32 columns, bytes ``4 j`` to ``4 j + 3`` of each group for the
    ``j``-th 32), loaded so that they dequantize straight into the wgmma's A-operand registers:
    lane ``4 g + q`` of warp ``w`` holds the bytes of group ``q`` of rows ``16 w + g`` and ``16 w +
    g + 8`` (one load each). With the step's columns taken in :func:`~a4prefill.ops.backends.
    triton.prefill.mma_column_order` these are exactly the A fragment's rows and columns."""
    byte_bases = [[0, 0, 1 << i] for i in range(step_bytes.bit_length() - 1)]
    warp_bases = [[16 << i, 0, 0] for i in range(warps.bit_length() - 1)]
    # rows past 16 * warps (a warpgroup's 128 rows: two wgmmas of 64) repeat in registers
    repeat_bases = [[16 * warps << i, 0, 0] for i in range((bw // (16 * warps)).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[*byte_bases, [8, 0, 0], *repeat_bases],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=warp_bases,
        block_bases=[],
        shape=[bw, 4, step_bytes],
    )


@gluon.constexpr_function
def fragment_code_rows_layout(bw: int, warps: int) -> gl.DistributedLinearLayout:
    """:func:`fragment_codes_layout` (8 bytes per group) over the same bytes as ``[BW, 32]``
    (byte ``8 q + b`` of a row is byte ``b`` of group ``q``): how the warp-specialized kernel's
    consumers load a TMA box of code rows, whose reshape to ``[BW, 4, 8]`` is then that layout
    with the registers unchanged."""
    return code_rows_of(fragment_codes_layout(bw, warps, 8))


@gluon.constexpr_function
def code_rows_of(grouped: gl.DistributedLinearLayout) -> gl.DistributedLinearLayout:
    """A layout of ``[rows, groups, 8]`` code bytes (row, 16-column group, byte) over the same bytes
    as ``[rows, 8 * groups]`` (byte ``8 q + b`` of a row is byte ``b`` of group ``q``): the same
    registers, lanes and warps, so a load in it reshapes to ``grouped`` with the registers
    unchanged."""
    rows, groups, group_bytes = grouped.shape

    def flat(bases: list[list[int]]) -> list[list[int]]:
        return [[row, group_bytes * group + byte] for row, group, byte in bases]

    return gl.DistributedLinearLayout(
        reg_bases=flat(grouped.reg_bases),
        lane_bases=flat(grouped.lane_bases),
        warp_bases=flat(grouped.warp_bases),
        block_bases=[],
        shape=[rows, groups * group_bytes],
    )


@gluon.jit
def _dequant_fragment(codes, scales, A_LAYOUT: gl.constexpr, BW: gl.constexpr, PAIRS: gl.constexpr = True):
    """codes ``[BW, 4, B]`` uint8 in :func:`fragment_codes_layout` (``B`` bytes of each 16-column
    group), scale bytes ``[BW, 4]`` -> the wgmma A operand ``[BW, 8 B]`` bf16 ``w * 2**-7`` in MMA
    column order: column ``8 b + 2 q + h`` holds nibble ``b % 4 + 4 h`` of code word ``b // 4`` of
    group ``q``. Each such pair of nibbles leaves :data:`numerics.WORD_PAIR_DEQUANT_ASM` in one
    register, the pair of columns an A register holds, so the reshapes only rename registers: the
    result is already in ``A_LAYOUT``'s registers. ``PAIRS = False`` takes
    :data:`numerics.BYTE_DEQUANT_ASM`'s pairs of two bytes, regrouped by one ``prmt`` a register:
    what the warp-specialized kernel's dequantize-ahead consumers need, whose next step is
    dequantized while the A registers of the step's wgmma are read (with the pair PTX, Triton 3.6
    writes the next step's A operand into the registers of the wgmma in flight and ptxas serializes
    the wgmmas; ``tests/test_triton_prefill_on_cpu.py`` checks both on the PTX and the SASS)."""
    B: gl.constexpr = codes.shape[2]
    CHUNKS: gl.constexpr = B // 4
    if not PAIRS:
        even, odd = _dequant_nibbles(codes, scales)
        # [row, group, byte, nibble] with byte 4 w + 2 h + i: nibble 2 i + n of word w is
        # column 8 w + 2 i + n + 4 h of the group, A register 4 w + 2 i + n, half h
        nibbles = gl.reshape(gl.join(even, odd), [BW, 4, CHUNKS, 2, 2, 2])
        nibbles = gl.permute(nibbles, (0, 2, 4, 5, 1, 3))  # [row, w, i, n, group, h]
        return gl.convert_layout(gl.reshape(nibbles, [BW, 8 * B]), A_LAYOUT)
    # per code word of a group: A registers 4 w and 4 w + 1 (first), 4 w + 2 and 4 w + 3 (second)
    first, second = _dequant_nibbles(codes, scales, WORD_PAIR_DEQUANT_ASM)
    # [row, group, word, register of the half, half of the register], then the halves joined last
    pairs = gl.join(gl.reshape(first, [BW, 4, CHUNKS, 2, 2]), gl.reshape(second, [BW, 4, CHUNKS, 2, 2]))
    pairs = gl.permute(pairs, (0, 2, 5, 3, 1, 4))  # [row, word, half, register of the half, group, h]
    return gl.convert_layout(gl.reshape(pairs, [BW, 8 * B]), A_LAYOUT)


@gluon.jit
def _rs_step(
    step,
    acc,
    a_previous,
    ring,
    A_LAYOUT: gl.constexpr,
    BW: gl.constexpr,
    DEPTH: gl.constexpr,
    WEIGHT_AHEAD: gl.constexpr,
    IN_FLIGHT: gl.constexpr,
    WGMMAS: gl.constexpr,
):
    """Step ``step`` of :func:`grouped_w4_gemm_rs_kernel`: wait for its copies, dequantize its
    weights into a new A operand ``a``, issue its wgmma, issue the copies ``WEIGHT_AHEAD`` (code
    and scale bytes) and ``DEPTH - 2`` (rows) steps ahead, then wait until ``IN_FLIGHT`` (0 or 1)
    wgmmas are left in flight, with the previous step's A operand ``a_previous`` as a dependency
    of that wait. Returns ``(acc, a)``. With ``IN_FLIGHT = 1`` this step's wgmma still reads
    ``a``'s registers: the caller must pass ``a`` as the next step's ``a_previous`` and
    dequantize that step into other registers. ``ring`` is ``(c_ring, s_ring, x_ring, code_ptrs,
    scale_ptrs, x_ptrs, x_mask, steps)``.

    ``WGMMAS = 2`` (with ``IN_FLIGHT = 0`` only): the step's 64 columns as two wgmmas of 32, each
    A operand in registers of its own; the second half is dequantized while the first half's
    wgmma runs, and both stay live until the wait retires both. ``a`` is then the second half."""
    c_ring, s_ring, x_ring, code_ptrs, scale_ptrs, x_ptrs, x_mask, steps = ring
    BK: gl.constexpr = 64
    AHEAD: gl.constexpr = DEPTH - 2
    W_SLOTS: gl.constexpr = WEIGHT_AHEAD + 1
    HALF_BYTES: gl.constexpr = 8 // WGMMAS
    FL: gl.constexpr = fragment_codes_layout(BW, gl.num_warps(), HALF_BYTES)
    async_copy.wait_group(AHEAD - 1)
    fence_async_shared()
    _cta_barrier()  # every thread's copies of this step have landed
    c_slot = c_ring.index(step % W_SLOTS)
    x_slot = x_ring.index(step % DEPTH)
    scales = s_ring.index(step % W_SLOTS).load(gl.SliceLayout(2, FL))
    if WGMMAS == 1:
        a = _dequant_fragment(c_slot.load(FL), scales, A_LAYOUT, BW)
        acc = warpgroup_mma(a, x_slot.permute((1, 0)), acc, is_async=True)
    else:
        first = _dequant_fragment(c_slot.slice(0, HALF_BYTES, dim=2).load(FL), scales, A_LAYOUT, BW)
        acc = warpgroup_mma(first, x_slot.slice(0, BK // 2, dim=1).permute((1, 0)), acc, is_async=True)
        a = _dequant_fragment(c_slot.slice(HALF_BYTES, HALF_BYTES, dim=2).load(FL), scales, A_LAYOUT, BW)
        acc = warpgroup_mma(a, x_slot.slice(BK // 2, BK // 2, dim=1).permute((1, 0)), acc, is_async=True)
    w_step = step + WEIGHT_AHEAD
    _async_load(c_ring.index(w_step % W_SLOTS), code_ptrs + w_step * (BK // 2), mask=w_step < steps)
    _async_load(s_ring.index(w_step % W_SLOTS), scale_ptrs + w_step * (BK // 16), mask=w_step < steps)
    x_step = step + AHEAD
    _async_load(x_ring.index(x_step % DEPTH), x_ptrs + x_step * BK, mask=x_mask & (x_step < steps))
    async_copy.commit_group()
    if WGMMAS == 1:
        acc, a_previous = warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=(acc, a_previous))
    else:
        acc, a_previous, first = warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=(acc, a_previous, first))
    return acc, a


# ROUTES unspecialized: a call's route count must not pick another compiled kernel (a compile while
# serving after the load-time warm-up)
@gluon.jit(do_not_specialize=["ROUTES"])
def grouped_w4_gemm_rs_kernel(
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
    BW: gl.constexpr,
    BT: gl.constexpr,
    DEPTH: gl.constexpr,
    WEIGHT_AHEAD: gl.constexpr,
    A_SETS: gl.constexpr,
    WGMMAS: gl.constexpr,
    OUT_MMA_ORDER: gl.constexpr,
):
    """:func:`grouped_w4_gemm_kernel` with the weights dequantized into the wgmma's A registers
    (no dequantized weights in shared memory), 64 columns per step. ``x``'s columns must be in
    :func:`~a4prefill.ops.backends.triton.prefill.mma_column_order` (the launcher permutes them);
    the code and scale bytes are the ModelOpt layout as loaded. Same arguments and grid otherwise.

    Per step, after its copies landed (wait, proxy fence, CTA barrier): codes and scales are read
    from shared memory in :func:`fragment_codes_layout`, dequantized in registers, and one
    asynchronous wgmma (A in registers, B the activation rows in shared memory) is issued; the
    copies of step ``s + DEPTH - 2`` follow, then a wait (:func:`_rs_step`). A wgmma reads its A
    registers while it runs, so they must not be written before the wait that retires it;
    ``A_SETS`` (the schedule's ``a_register_sets``) picks how:

    - 1: each step's wait retires its own wgmma (``wait(0)``): the next step's dequantization
      writes the same registers afterwards. A warpgroup does not dequantize while its wgmma
      runs; the other CTA on the SM does (two CTAs per SM at up to 128 registers);
    - 2: the loop takes the steps in pairs, even steps' A operand in one set of registers and odd
      steps' in another; each wait leaves one wgmma in flight and names the previous step's A
      operand as a dependency (it stays live, in its registers, until then). Step ``s + 1``
      writes the other set while step ``s``'s wgmma runs, and step ``s + 2`` writes this set
      after the wait of step ``s + 1`` retired it. More registers (one CTA per SM), for tiles
      that have one CTA per SM anyway.

    ``WGMMAS`` (the schedule's ``wgmmas_per_step``, 2 only with one set): each step as two wgmmas
    of 32 columns, the second half dequantized into registers of its own while the first half's
    wgmma runs; the step's wait retires both.

    (One set of registers with one wgmma left in flight, the first version, let step ``s + 1``'s
    dequantization overwrite the registers of step ``s``'s wgmma in flight: results changed from
    run to run on the H200 wherever the epilogue changed the register allocation, for example the
    A4 epilogue.)

    Row ring slot ``(s - 2) % DEPTH`` is refilled at step ``s``: every warpgroup retired the wgmma
    of step ``s - 2`` before the barrier of step ``s``.

    The code and scale bytes run ``WEIGHT_AHEAD >= DEPTH - 2`` steps ahead in their own ring of
    ``WEIGHT_AHEAD + 1`` slots (small: 4.5 KiB per slot at ``BW = 128``): slot ``(s - 1) %
    (WEIGHT_AHEAD + 1)`` is refilled at step ``s``, after every thread read step ``s - 1``'s bytes
    into registers. Step ``s``'s commit group holds the weight bytes of step ``s + WEIGHT_AHEAD``
    and the rows of step ``s + DEPTH - 2``; the prologue's first ``WEIGHT_AHEAD - DEPTH + 2``
    groups hold weight bytes only, so ``wait_group(DEPTH - 3)`` still completes both of step
    ``s``."""
    BK: gl.constexpr = 64
    G: gl.constexpr = 4
    num_warps: gl.constexpr = gl.num_warps()
    ACC: gl.constexpr = acc_layout(BT, num_warps)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    X_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16)
    AHEAD: gl.constexpr = DEPTH - 2
    W_SLOTS: gl.constexpr = WEIGHT_AHEAD + 1
    LAG: gl.constexpr = WEIGHT_AHEAD - AHEAD

    code_ptrs, scale_ptrs, x_ptrs, x_mask, steps, expert, row0, seg_end, n0, live_tile = _tile_operands(
        gl.program_id(1),
        gl.program_id(0),
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
        BW,
        BT,
        BK,
    )

    c_ring = gl.allocate_shared_memory(gl.uint8, [W_SLOTS, BW, G, 8], PLAIN)
    s_ring = gl.allocate_shared_memory(gl.uint8, [W_SLOTS, BW, G], PLAIN2)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [DEPTH, BT, BK], X_SMEM)
    acc = gl.zeros([BW, BT], gl.float32, layout=ACC)

    for ahead in gl.static_range(WEIGHT_AHEAD):
        _async_load(c_ring.index(ahead), code_ptrs + ahead * (BK // 2), mask=ahead < steps)
        _async_load(s_ring.index(ahead), scale_ptrs + ahead * (BK // 16), mask=ahead < steps)
        if ahead >= LAG:
            live_x = x_mask & (ahead - LAG < steps)
            _async_load(x_ring.index(ahead - LAG), x_ptrs + (ahead - LAG) * BK, mask=live_x)
        async_copy.commit_group()
    ring = (c_ring, s_ring, x_ring, code_ptrs, scale_ptrs, x_ptrs, x_mask, steps)
    a_last = gl.zeros([BW, BK // WGMMAS], gl.bfloat16, layout=A_LAYOUT)
    if A_SETS == 1:
        for step in range(steps):
            acc, a_last = _rs_step(step, acc, a_last, ring, A_LAYOUT, BW, DEPTH, WEIGHT_AHEAD, 0, WGMMAS)
    else:
        # steps in pairs: even steps' A operand in one set of registers, odd steps' in another
        a_odd = a_last
        for pair in range(steps // 2):
            acc, a_even = _rs_step(2 * pair, acc, a_odd, ring, A_LAYOUT, BW, DEPTH, WEIGHT_AHEAD, 1, 1)
            acc, a_odd = _rs_step(2 * pair + 1, acc, a_even, ring, A_LAYOUT, BW, DEPTH, WEIGHT_AHEAD, 1, 1)
        a_last = a_odd
        if steps % 2 == 1:
            acc, a_last = _rs_step(steps - 1, acc, a_odd, ring, A_LAYOUT, BW, DEPTH, WEIGHT_AHEAD, 1, 1)
    acc, a_last = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_last))
    async_copy.wait_group(0)
    _cta_barrier()  # every thread's (masked, zero-filling) copies landed before the epilogue's scratch

    _epilogue(
        acc,
        out_ptr,
        scale2_ptr,
        sorted_route_ptr,
        expert,
        row0,
        seg_end,
        n0,
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
        BW,
        BT,
        OUT_MMA_ORDER,
    )
