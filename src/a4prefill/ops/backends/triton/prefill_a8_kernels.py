"""The A8 consumers of the warp-specialized Hopper prefill GEMM (Gluon, sm_90a; issue 28):
FP8 e4m3 activations times the NVFP4 weights converted to e4m3 on the way in, on the FP8
tensor cores, with the per-block promotion of docs/numerics.md section 8 (``a4prefill.ops.fp8``
is the oracle). :mod:`prefill_ws_kernels` runs these in place of its bf16 mainloop when its
``A8`` constexpr is set; its producer, work items, ring and epilogues stay as they are.

A step is one A8 block of 128 K columns. Per step a consumer (64 weight rows):

1. reads its rows' 64 code bytes and 8 scale bytes per row from the ring slot and converts them
   to FP8 weights (:func:`weight_exponents`, :func:`e4m3_weights`): per row the block's exponent
   ``p`` (the smallest integer with ``6 * max|scale| <= 448 * 2**p``, from the scale bytes'
   bits); per 16-column group a table of the 8 e4m3 bytes ``e4m3(m * |scale| * 2**-p)`` of the
   e2m1 magnitudes ``m`` (the fp32 products are exact, then nearest even), from which each
   weight's byte is picked by its nibble (:data:`A8_WEIGHT_ASM`, about 2 instructions a weight): the values of
   ``fp8.weights`` bit for bit, in the K order of the activations (with ``A8_SHARED``: no
   column permutation; with ``A8_REGISTERS`` below);
2. stores them into its own shared buffer (NVMMA-swizzled, K-major, what the FP8 wgmma reads),
   fences, and issues one wgmma of both operands from shared memory into a fresh fp32 partial
   (``use_acc=False``), then retires it and releases the slot;
3. promotes: ``acc += partial * 2**(p - 7)``, one fused multiply-add an output (exact product:
   a power of two), and after the work item's last block ``acc *= s`` with ``s`` the routes'
   activation scales (one per route, the ring slot's ``[BT]`` fp32, which the producer copies
   with an item's last step). The ``2**-7`` matches the bf16 mainloop's accumulator, whose
   epilogues multiply by 128 (exact).

:func:`mainloop_a8` runs these in sequence; :func:`mainloop_a8_wide` (256-route tiles,
``schedules.A8_PREFILL_WIDE``) runs two wgmmas of 128 routes on each step's converted weights;
:func:`mainloop_a8_quarters` (256-route tiles, register weights) four of 64 into two partials,
each quarter promoted while the next one's wgmma runs.
(A form that converted the next step into a second buffer while the step's wgmma ran was 2-5%
slower than :func:`mainloop_a8` at every size on the H200, eighteenth and nineteenth rounds, and
was removed.)

Register weights (``A8 = A8_REGISTERS``, ``PrefillGemm.a8_register_weights``; :func:`mainloop_a8`
and :func:`mainloop_a8_wide`; with ``wgmmas_per_step = 2`` the two groups of each lane converted
one after the other, the second while the first one's wgmmas run, :func:`_issue_in_halves`):
step 2 keeps the converted weights in the FP8 wgmma's A registers
(:func:`a8_operand_layout`: per thread 4 consecutive K positions a register) and issues the wgmma
from them, with no shared buffer, fence or barrier. A thread's A registers of one step hold 32 K
positions of each of its two rows, ``16 i + 4 q + (0..3)`` for ``i`` < 8 (lane ``4 g + q``),
while the conversion gives it the 32 columns of groups ``2 q`` and ``2 q + 1``. So the step's K
positions take the columns in the A8 fragment order (``prefill.a8_column_order``): position ``32
c + 16 h + 4 q + j`` (``c`` < 4, ``h`` < 2, ``q`` < 4, ``j`` < 4) holds column ``32 q + 8 c + 4 h
+ j`` of the block, in the weights (:func:`in_fragment_order`, a renaming of registers) and in
the activation rows (``quantize_fp8_rows_kernel`` with ``MMA_ORDER``, or the launcher's copy):
the same products, summed in another order inside a block. Step 1's block exponents come from
the producer, which loads each row's scale bytes into registers and stores the row's ``p``
beside them in the ring slot (``prefill_ws_kernels._produce``): the consumers' reduction of a
row's 8 scale bytes, spread over 4 lanes, goes (no lane exchange is left in their K loop).

Numerics against ``fp8.block_product``: the weights and the products inside a block are exact
(on the CPU interpreter the block sums are exact too; the tensor cores sum a block with fewer
bits, as the section says); the promotion rounds once per block, as the oracle's fp32 sum does,
and the routes' scales once. Scale bytes ``0x7f``/``0xff`` (e4m3 NaN) decode as +-480, as in the
other kernels, where the oracle gives NaN.

Who may call: :mod:`prefill_ws_kernels` (jit helpers), tests.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from a4prefill.ops.backends.triton.numerics import e4m3_bytes_f32
from a4prefill.ops.backends.triton.prefill_kernels import _cta_barrier, code_rows_of
from a4prefill.ops.backends.triton.schedules import A8_REGISTER_WEIGHTS, A8_SHARED_WEIGHTS

A8_STEP: gl.constexpr = gl.constexpr(128)  # K columns per step: one A8 block (fp8.A8_BLOCK)
# The warp-specialized kernel's ``A8`` constexpr: A8 with the converted weights in a shared buffer
# (the wgmma's A from shared memory), or in the wgmma's A registers (module docstring)
A8_SHARED: gl.constexpr = gl.constexpr(A8_SHARED_WEIGHTS)
A8_REGISTERS: gl.constexpr = gl.constexpr(A8_REGISTER_WEIGHTS)


# One 16-column group: its 8 code bytes (``$4``: bytes 0-3, ``$5``: bytes 4-7), ``f = |scale| *
# 2**-p`` as fp32 (``$6``; ``$7``-``$13`` are copies) and its sign table (``$14``; ``$15``-``$21``
# copies: 0x80808080 for a positive scale byte, 0x01010101 for a negative one) -> its 16 e4m3
# weights in K order, column ``j`` in byte ``j % 4`` of ``$(j / 4)``. The table ``{lo, hi}`` holds
# the e4m3 bytes of ``m * f`` for the e2m1 magnitudes ``m`` = 0, 0.5, 1, 1.5, 2, 3, 4, 6 (byte
# ``i`` for magnitude code ``i``: exact fp32 products, ``cvt.rn.satfinite`` pairs, nearest even).
# Per 4 weights (4 nibbles of a code half-word, K order) one ``prmt`` picks their magnitude bytes
# (selector: the nibbles without their sign bits), a second ``prmt`` over the sign table with the
# nibbles themselves gives per byte 0x80 or 0xFF (the sign bit replicated) for a positive scale,
# 0x01 or 0x00 for a negative one, whose bit 0 is the weight's sign: shifted to bit 7 and or-ed
# in. A zero magnitude keeps its sign (-0 as 0x80), as the product's IEEE sign would.
def _a8_weight_words() -> str:
    """The PTX of :data:`A8_WEIGHT_ASM`'s four output words: the magnitude ``prmt``, the sign
    ``prmt`` shifted to bit 7, or-ed together, for the low and high half-word of each code word."""
    lines = []
    for out, code in ((0, 4), (2, 5)):
        lines += [f"and.b32 mags, ${code}, 0x77777777;", f"mov.b32 sel, ${code};"]
        for half in (0, 1):
            if half:
                lines += ["shr.b32 mags, mags, 16;", "shr.b32 sel, sel, 16;"]
            lines += [
                "prmt.b32 word, lo, hi, mags;",
                "prmt.b32 sgn, $14, $14, sel;",
                "shl.b32 sgn, sgn, 7;",
                "and.b32 sgn, sgn, 0x80808080;",
                f"or.b32 ${out + half}, word, sgn;",
            ]
    return "\n".join(lines)


A8_WEIGHT_ASM = gl.constexpr(
    """
{
.reg .f32 z, m1, m3, m4, m5, m6, m7;
.reg .b16 t01, t23, t45, t67;
.reg .b32 lo, hi, mags, sel, word, sgn;
mov.f32 z, 0f00000000;
mul.rn.f32 m1, $6, 0f3F000000;
mul.rn.f32 m3, $6, 0f3FC00000;
mul.rn.f32 m4, $6, 0f40000000;
mul.rn.f32 m5, $6, 0f40400000;
mul.rn.f32 m6, $6, 0f40800000;
mul.rn.f32 m7, $6, 0f40C00000;
cvt.rn.satfinite.e4m3x2.f32 t01, m1, z;
cvt.rn.satfinite.e4m3x2.f32 t23, m3, $6;
cvt.rn.satfinite.e4m3x2.f32 t45, m5, m4;
cvt.rn.satfinite.e4m3x2.f32 t67, m7, m6;
mov.b32 lo, {t01, t23};
mov.b32 hi, {t45, t67};
"""
    + _a8_weight_words()
    + """
}
"""
)


@gluon.constexpr_function
def fp8_acc_layout(bt: int, warps: int) -> gl.NVMMADistributedLayout:
    """The FP8 wgmma's accumulator ``[64, BT]`` (its instruction takes 32 K columns)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, bt, 32])


@gluon.constexpr_function
def a8_operand_layout(bt: int, warps: int) -> gl.DotOperandLayout:
    """The FP8 wgmma's A operand in registers, ``[64, 128]`` e4m3 of one step (4 wgmmas of 32
    columns) for the accumulator :func:`fp8_acc_layout` of ``bt`` routes: per thread 4
    consecutive K positions a register."""
    return gl.DotOperandLayout(operand_index=0, parent=fp8_acc_layout(bt, warps), k_width=4)


@gluon.constexpr_function
def a8_codes_layout(warps: int) -> gl.DistributedLinearLayout:
    """``[64, 8, 8]`` code bytes of one block (row, 16-column group, byte), 16 consecutive bytes
    (2 groups) per thread and row: lane ``4 g + q`` of warp ``w`` holds groups ``2 q`` and ``2 q +
    1`` of rows ``16 w + g`` and ``16 w + g + 8``, the rows that thread holds in the FP8 wgmma's
    accumulator (:func:`fp8_acc_layout`), so the rows' promotion factors computed from the scale
    bytes (``SliceLayout(2, ...)``, reduced over the groups) are already in the accumulator's row
    layout: no shared-memory round trip and no barrier to move them."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [8, 0, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << i, 0, 0] for i in range(warps.bit_length() - 1)],
        block_bases=[],
        shape=[64, 8, 8],
    )


@gluon.constexpr_function
def a8_code_rows_layout(warps: int) -> gl.DistributedLinearLayout:
    """:func:`a8_codes_layout` over the same bytes as ``[64, 64]`` (byte ``8 q + b`` of a row is
    byte ``b`` of group ``q``): how a consumer loads its rows of a ring slot's code bytes (one
    16-byte load per row), whose reshape to ``[64, 8, 8]`` is then that layout with the
    registers unchanged."""
    return code_rows_of(a8_codes_layout(warps))


@gluon.jit
def _pow2(exponent):
    """``2**exponent`` in fp32 for int32 exponents of the normal range (-126 to 127)."""
    return ((exponent + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def weight_exponents(scale_bytes):
    """Scale bytes ``[BW, 8]`` (uint8, one 128-column block of each row) -> int32 ``[BW]``: the
    smallest ``p`` with ``6 * m <= 448 * 2**p``, ``m`` the largest ``|scale|`` (0 for a zero
    block), as ``fp8.weight_exponents``. ``q = 6 m`` is exact in fp32; with ``q = f * 2**e``,
    ``1 <= f < 2``, and ``448 = 1.75 * 2**8``: ``p = e - 8``, or ``e - 7`` where ``f > 1.75``."""
    largest = gl.max(scale_bytes.to(gl.int32) & 0x7F, axis=1)  # e4m3 magnitudes order as integers
    bits = (e4m3_bytes_f32(largest) * 6.0).to(gl.int32, bitcast=True)
    exponent = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(gl.int32)
    return gl.where(largest == 0, 0, exponent)


@gluon.jit
def bytes_of_words(words):
    """int32 ``[R, W]``, each word 4 bytes little-endian (as loaded through an int32 pointer) ->
    uint8 ``[R, 4 W]``: column ``4 w + j`` is byte ``j`` of word ``w``."""
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    low = gl.join(words & 0xFF, (words >> 8) & 0xFF)  # [R, W, 2]: bytes 0 and 1
    high = gl.join((words >> 16) & 0xFF, (words >> 24) & 0xFF)  # bytes 2 and 3
    halves = gl.permute(gl.join(low, high), (0, 1, 3, 2))  # [R, W, half, byte of the half]
    return gl.reshape(halves, [R, 4 * W]).to(gl.uint8)


@gluon.jit
def e4m3_weights(codes, scale_bytes, p):
    """codes ``[BW, G, 8]`` uint8 (``G`` groups of 16 columns, 8 bytes each, one thread holding a
    group's 8 bytes), their ``scale_bytes [BW, G]`` and the rows' block exponents ``p [BW]``
    (:func:`weight_exponents` of the whole block) -> ``[BW, 16 G]`` float8e4nv ``e4m3(e2m1 *
    scale * 2**-p)``, column ``16 g + c`` for column ``c`` of group ``g`` (``fp8.weights``)."""
    BW: gl.constexpr = codes.shape[0]
    G: gl.constexpr = codes.shape[1]
    # the scale bytes and exponents in the codes' layout (the registers they already are in)
    scale_bytes = gl.convert_layout(scale_bytes, gl.SliceLayout(2, codes.type.layout))
    rows_p = gl.convert_layout(p, gl.SliceLayout(1, scale_bytes.type.layout))
    magnitude = gl.abs(e4m3_bytes_f32(scale_bytes)) * gl.expand_dims(_pow2(-rows_p), 1)  # exact
    sign_table = gl.where((scale_bytes & 0x80) != 0, 0x01010101, -0x7F7F7F80)  # 0x80808080 as int32
    first, second = gl.inline_asm_elementwise(
        A8_WEIGHT_ASM,
        "=r,=r,=r,=r" + ",r" * 18,
        [
            codes,
            gl.broadcast(gl.expand_dims(magnitude, 2), codes)[0],
            gl.broadcast(gl.expand_dims(sign_table, 2), codes)[0],
        ],
        dtype=(gl.uint8, gl.uint8),
        is_pure=True,
        pack=8,
    )  # per group: columns 0-7 in first, 8-15 in second
    w = gl.reshape(gl.permute(gl.join(first, second), (0, 1, 3, 2)), [BW, 16 * G])  # 16 g + 8 h + j
    return w.to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _code_bytes(rings, s, HALF: gl.constexpr):
    """Ring step ``s`` of a consumer (weight rows ``64 * HALF`` on of the slot): waits until the
    slot's copies landed (at once if they had) and loads its rows' code bytes ``[64, 8, 8]``
    (:func:`a8_codes_layout`). What is computed from them comes after the wait, which the
    compilers keep after every wgmma issued before it."""
    c_ring = rings[0]
    ready = rings[3]
    ROWS: gl.constexpr = 64
    DEPTH: gl.constexpr = c_ring.shape[0]
    CODE_ROWS: gl.constexpr = a8_code_rows_layout(gl.num_warps())
    slot = s % DEPTH
    mbarrier.wait(ready.index(slot), (s // DEPTH) & 1)
    code_rows = c_ring.index(slot).slice(HALF * ROWS, ROWS, dim=0).load(CODE_ROWS)
    return gl.convert_layout(gl.reshape(code_rows, [ROWS, 8, 8]), a8_codes_layout(gl.num_warps()))


@gluon.jit
def _step_bytes(rings, s, HALF: gl.constexpr):
    """Ring step ``s``'s code bytes (:func:`_code_bytes`, after its wait) and the rows' scale
    bytes ``[64, 8]`` (``SliceLayout(2, a8_codes_layout)``)."""
    codes = _code_bytes(rings, s, HALF)
    s_ring = rings[1]
    ROWS: gl.constexpr = 64
    CL: gl.constexpr = a8_codes_layout(gl.num_warps())
    slot = s % s_ring.shape[0]
    scale_bytes = s_ring.index(slot).slice(HALF * ROWS, ROWS, dim=0).load(gl.SliceLayout(2, CL))
    return codes, scale_bytes


@gluon.jit
def _row_factors(p, BT: gl.constexpr):
    """The rows' promotion factors ``2**(p - 7)`` fp32 ``[64]`` in the row layout of the
    accumulator of ``BT`` routes."""
    return gl.convert_layout(_pow2(p - 7), gl.SliceLayout(1, fp8_acc_layout(BT, gl.num_warps())))


@gluon.jit
def _exponents(rings, s, HALF: gl.constexpr, scale_bytes, A8: gl.constexpr):
    """The block exponents ``p [64]`` of ring step ``s``'s rows: computed from their
    ``scale_bytes`` (:func:`weight_exponents`; ``A8_SHARED``), or as the producer stored them in
    the slot (``rings[6]``, ``[DEPTH, 128]`` int32; ``A8_REGISTERS``), in the scale bytes' row
    layout."""
    if A8 == A8_REGISTERS:
        ROWS: gl.constexpr = 64
        p_ring = rings[6]
        rows = p_ring.index(s % p_ring.shape[0]).slice(HALF * ROWS, ROWS)
        p = rows.load(gl.SliceLayout(1, scale_bytes.type.layout))
    else:
        p = weight_exponents(scale_bytes)
    return p


@gluon.jit
def _converted(rings, s, HALF: gl.constexpr, BT: gl.constexpr, A8: gl.constexpr):
    """Ring step ``s``'s bytes (:func:`_step_bytes`) converted (:func:`_exponents`,
    :func:`e4m3_weights`): ``(w [64, 128] e4m3 in K order, shift)``, ``shift`` the rows'
    promotion factors as :func:`_row_factors` gives them."""
    codes, scale_bytes = _step_bytes(rings, s, HALF)
    p = _exponents(rings, s, HALF, scale_bytes, A8)
    return e4m3_weights(codes, scale_bytes, p), _row_factors(p, BT)


@gluon.jit
def convert_step(rings, s, HALF: gl.constexpr, a_buffer, BT: gl.constexpr):
    """:func:`_converted` of ring step ``s``, its weights stored into ``a_buffer`` (``[64, 128]``
    e4m3, what the FP8 wgmma reads), fenced for the async proxy, then a barrier of the
    warpgroup. Returns the rows' promotion factors. Leaves the slot to the caller (it releases the
    slot after the wgmma that reads its rows retired)."""
    w8, shift = _converted(rings, s, HALF, BT, A8_SHARED)
    a_buffer.store(w8)
    fence_async_shared()  # the warpgroup's stores, before the wgmma reads them (async proxy)
    _cta_barrier()  # in a partition: a barrier of its warpgroup
    return shift


@gluon.jit
def in_fragment_order(w):
    """``w [BW, 32 C]`` (``C`` 4: a block's columns in K order; 2: the first or the second group
    of each lane, :func:`_lane_groups`, column ``16 q + c`` for column ``c`` of lane ``q``'s group)
    -> the same values with K position ``32 c + 16 h + 4 q + j`` holding column ``32 q + 8 c + 4
    h + j`` (``16 q + 8 c + 4 h + j`` for ``C`` 2; the A8 fragment order, module docstring). In
    :func:`e4m3_weights`' layout each thread's values move to other registers of the same thread
    only."""
    BW: gl.constexpr = w.shape[0]
    C: gl.constexpr = w.shape[1] // 32
    by_field = gl.reshape(w, [BW, 4, C, 2, 4])  # (row, q, c, h, j)
    return gl.reshape(gl.permute(by_field, (0, 2, 3, 1, 4)), [BW, 32 * C])  # (row, c, h, q, j)


@gluon.jit
def _operand(w, BT: gl.constexpr):
    """``w`` as :func:`in_fragment_order` takes it -> the FP8 wgmma's A operand for ``BT`` routes
    (:func:`a8_operand_layout`), K positions in the A8 fragment order."""
    return gl.convert_layout(in_fragment_order(w), a8_operand_layout(BT, gl.num_warps()))


@gluon.jit
def convert_step_to_registers(rings, s, HALF: gl.constexpr, BT: gl.constexpr):
    """:func:`_converted` of ring step ``s`` as the FP8 wgmma's A operand of ``BT`` routes:
    ``(a [64, 128] e4m3 in :func:`a8_operand_layout`, K positions in the A8 fragment order;
    shift)``. No shared memory, fence or barrier. Leaves the slot to the caller."""
    w8, shift = _converted(rings, s, HALF, BT, A8_REGISTERS)
    return _operand(w8, BT), shift


@gluon.jit
def _lane_groups(t):
    """``t [64, 8, ...]`` (per row the 8 groups of a block, in :func:`a8_codes_layout` or its
    slice) -> ``(first, second) [64, 4, ...]``: the groups ``2 q`` and ``2 q + 1`` that lane ``q``
    of a quad holds, each lane's in its own registers."""
    if len(t.shape) == 3:
        pairs = gl.permute(gl.reshape(t, [t.shape[0], 4, 2, t.shape[2]]), (0, 1, 3, 2))
    else:
        pairs = gl.reshape(t, [t.shape[0], 4, 2])
    return gl.split(pairs)


@gluon.jit
def _issue_in_halves(rings, s, HALF: gl.constexpr, rows, acc, BT: gl.constexpr, FENCE_ROWS: gl.constexpr):
    """Ring step ``s``'s block product for the routes of ``rows`` (``[BT, 128]`` e4m3 of a ring
    slot) into a fresh partial, the weights converted into registers in two K halves
    (``PrefillGemm.wgmmas_per_step = 2`` with ``a8_register_weights``): each lane's first group
    (K positions 0-63 of the fragment order) converted and its two wgmmas issued, then its second
    group (64-127) converted while those run, and its two wgmmas issued into the same partial.
    ``acc`` gives the partial's layout only. Returns ``(partial, a_first, a_second, shift)``: the
    partial with both wgmma groups in flight, the two A operands (another route tile of the same
    weights may take them) and the rows' promotion factors (:func:`_row_factors`).
    ``FENCE_ROWS``: as :func:`mainloop_a8`'s."""
    codes, scale_bytes = _step_bytes(rings, s, HALF)
    if FENCE_ROWS:  # rows written by cp.async (generic proxy), read by the wgmma (async proxy)
        fence_async_shared()
    p = _exponents(rings, s, HALF, scale_bytes, A8_REGISTERS)
    first_scales, second_scales = _lane_groups(scale_bytes)
    a_first = _operand(e4m3_weights(_lane_groups(codes)[0], first_scales, p), BT)
    first_k = rows.slice(0, 64, dim=1).permute((1, 0))
    partial = warpgroup_mma(a_first, first_k, acc, use_acc=False, is_async=True)
    # the bytes again after the issue (the wait passes at once): the second group's conversion,
    # computed from them, cannot be scheduled before the first group's wgmmas
    second_codes = _lane_groups(_code_bytes(rings, s, HALF))[1]
    a_second = _operand(e4m3_weights(second_codes, second_scales, p), BT)
    partial = warpgroup_mma(a_second, rows.slice(64, 64, dim=1).permute((1, 0)), partial, is_async=True)
    return partial, a_first, a_second, _row_factors(p, BT)


@gluon.jit
def _issue_halves_again(a_first, a_second, rows, acc):
    """The block product of :func:`_issue_in_halves`' operands ``a_first``, ``a_second`` for the
    routes of ``rows`` (another route tile of a ring slot) into a fresh partial, both wgmma groups
    in flight."""
    partial = warpgroup_mma(
        a_first, rows.slice(0, 64, dim=1).permute((1, 0)), acc, use_acc=False, is_async=True
    )
    return warpgroup_mma(a_second, rows.slice(64, 64, dim=1).permute((1, 0)), partial, is_async=True)


@gluon.jit
def _promoted(acc, partial, shift, rings, slot, last, FIRST_ROUTE: gl.constexpr):
    """``acc + partial * shift`` (module docstring, step 3), then, at a work item's ``last``
    step, times the activation scales of the accumulator's routes: the ring slot's ``[BT]``
    from route ``FIRST_ROUTE`` on (read before the caller releases the slot)."""
    acc = acc + partial * gl.expand_dims(shift, 1)
    if last:
        ROUTES: gl.constexpr = acc.shape[1]
        x_scales = (
            rings[5]
            .index(slot)
            .slice(FIRST_ROUTE, ROUTES)
            .load(gl.SliceLayout(0, fp8_acc_layout(ROUTES, gl.num_warps())))
        )
        acc = acc * gl.expand_dims(x_scales, 0)
    return acc


@gluon.jit
def _promote(acc, partial, shift, rings, slot, last):
    """:func:`_promoted` of all the slot's routes, then the slot released (one arrival on
    ``empty``)."""
    acc = _promoted(acc, partial, shift, rings, slot, last, 0)
    mbarrier.arrive(rings[4].index(slot))
    return acc


@gluon.jit
def _weight_operand(
    rings, s, HALF: gl.constexpr, BT: gl.constexpr, A8: gl.constexpr, FENCE_ROWS: gl.constexpr
):
    """Ring step ``s``'s converted weights as a consumer's FP8 wgmma operand A of ``BT`` routes,
    and its rows' promotion factors: ``(a_smem[HALF], shift)`` after :func:`convert_step`
    (``A8_SHARED``, whose fence covers the rows too), or :func:`convert_step_to_registers`
    (``A8_REGISTERS``; with ``FENCE_ROWS`` then a proxy fence, :func:`mainloop_a8`)."""
    if A8 == A8_REGISTERS:
        a, shift = convert_step_to_registers(rings, s, HALF, BT)
        if FENCE_ROWS:  # rows written by cp.async (generic proxy), read by the wgmma (async proxy)
            fence_async_shared()
    else:
        a = rings[6].index(HALF)
        shift = convert_step(rings, s, HALF, a, BT)
    return a, shift


@gluon.jit
def mainloop_a8(
    done,
    steps,
    HALF: gl.constexpr,
    rings,
    BT: gl.constexpr,
    A8: gl.constexpr,
    WGMMAS: gl.constexpr = 1,
    FENCE_ROWS: gl.constexpr = False,
):
    """A consumer's ``steps`` A8 steps of one work item (weight rows ``64 * HALF`` on of the
    slot), ring steps ``done`` on: its rows' fp32 accumulator ``[64, BT]`` in
    :func:`fp8_acc_layout`, ``2**-7`` times the block product. ``rings``: ``(c_ring [DEPTH, 128,
    64], s_ring [DEPTH, 128, 8], x_ring [DEPTH, BT, 128] fp8, ready, empty, xs_ring [DEPTH, BT]
    fp32 (the routes' scales, in the slot of an item's last step), then a_smem [2, 64, 128] fp8
    (``A8_SHARED``) or p_ring [DEPTH, 128] int32 (the rows' block exponents, ``A8_REGISTERS``))``;
    per step as the module docstring says, in sequence, the weights in a shared buffer or in
    registers (``A8``), with ``WGMMAS = 2`` (registers only) converted in two K halves, the second
    while the first's wgmmas run (:func:`_issue_in_halves`). ``FENCE_ROWS``: the slot's rows were
    written by ``cp.async`` (the producer's copies by token), which the wgmma, reading through the
    async proxy, sees only after a proxy fence that follows the slot's wait; TMA writes need none,
    and a shared weights buffer's own fence (:func:`convert_step`) comes after the wait too."""
    x_ring = rings[2]
    DEPTH: gl.constexpr = x_ring.shape[0]
    acc = gl.zeros([64, BT], gl.float32, layout=fp8_acc_layout(BT, gl.num_warps()))
    for step in range(steps):
        s = done + step
        slot = s % DEPTH
        if WGMMAS == 2:
            partial, _, _, shift = _issue_in_halves(rings, s, HALF, x_ring.index(slot), acc, BT, FENCE_ROWS)
        else:
            a, shift = _weight_operand(rings, s, HALF, BT, A8, FENCE_ROWS)
            partial = warpgroup_mma(a, x_ring.index(slot).permute((1, 0)), acc, use_acc=False, is_async=True)
        partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
        acc = _promote(acc, partial, shift, rings, slot, step == steps - 1)
    return acc


@gluon.jit
def mainloop_a8_wide(
    done,
    steps,
    HALF: gl.constexpr,
    rings,
    BT: gl.constexpr,
    A8: gl.constexpr,
    WGMMAS: gl.constexpr = 1,
    FENCE_ROWS: gl.constexpr = False,
):
    """:func:`mainloop_a8` on route tiles of ``BT`` = 256 routes as two halves of 128 that share
    each step's converted weights (``schedules.A8_PREFILL_WIDE``, ``A8_PREFILL_WIDE_RS``): per
    step the conversion (:func:`_weight_operand`, once for both halves; with ``WGMMAS = 2``
    :func:`_issue_in_halves` for the first half, whose operands the second reuses), then per
    half one FP8 wgmma into the one
    partial, retired and promoted into that half's accumulator before the next is issued (two
    accumulators and a partial: 192 fp32 registers a thread, where a 256-route partial and
    accumulator would take 256), then the slot released. Half the conversion per FLOP of
    128-route tiles, and half the step's other work. Returns the two halves' accumulators
    ``[64, BT / 2]`` in :func:`fp8_acc_layout`, routes ``0..BT/2`` and ``BT/2..BT`` of the tile.
    ``FENCE_ROWS``: as :func:`mainloop_a8`'s."""
    x_ring = rings[2]
    DEPTH: gl.constexpr = x_ring.shape[0]
    HALF_BT: gl.constexpr = BT // 2
    ACC: gl.constexpr = fp8_acc_layout(HALF_BT, gl.num_warps())
    first = gl.zeros([64, HALF_BT], gl.float32, layout=ACC)
    second = gl.zeros([64, HALF_BT], gl.float32, layout=ACC)
    for step in range(steps):
        s = done + step
        slot = s % DEPTH
        last = step == steps - 1
        rows = x_ring.index(slot)
        if WGMMAS == 2:
            partial, a_first, a_second, shift = _issue_in_halves(
                rings, s, HALF, rows.slice(0, HALF_BT, dim=0), first, HALF_BT, FENCE_ROWS
            )
        else:
            a, shift = _weight_operand(rings, s, HALF, HALF_BT, A8, FENCE_ROWS)
            partial = warpgroup_mma(
                a, rows.slice(0, HALF_BT, dim=0).permute((1, 0)), first, use_acc=False, is_async=True
            )
        partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
        first = _promoted(first, partial, shift, rings, slot, last, 0)
        if WGMMAS == 2:
            partial = _issue_halves_again(a_first, a_second, rows.slice(HALF_BT, HALF_BT, dim=0), second)
        else:
            partial = warpgroup_mma(
                a, rows.slice(HALF_BT, HALF_BT, dim=0).permute((1, 0)), second, use_acc=False, is_async=True
            )
        partial = warpgroup_mma_wait(num_outstanding=0, deps=(partial,))
        second = _promoted(second, partial, shift, rings, slot, last, HALF_BT)
        mbarrier.arrive(rings[4].index(slot))
    return first, second


@gluon.jit
def mainloop_a8_quarters(done, steps, HALF: gl.constexpr, rings, BT: gl.constexpr, FENCE_ROWS: gl.constexpr):
    """:func:`mainloop_a8_wide` with the weights in registers (``A8_REGISTERS``) and each step's
    ``BT`` = 256 routes as four quarters of 64 (``schedules.A8_PREFILL_WIDE_RS_TOK_Q4``,
    ``PrefillGemm.a8_route_quarters``): per step the conversion once, into the A operand of a
    64-route accumulator, then the quarters' wgmma groups into two partials that alternate, one
    group always in flight while the quarter before it is promoted: issue quarters 0 and 1, retire
    0 and promote it, issue 2, retire 1 and promote it, issue 3, retire 2 and promote it, retire 3
    and promote it, then the slot released. Four accumulators and two partials of ``[64, 64]``:
    192 fp32 registers a thread, where two partials of 128 routes would take 256. Returns the
    quarters' accumulators ``[64, BT / 4]`` in :func:`fp8_acc_layout`, routes ``64 q`` on of the
    tile for quarter ``q``. ``FENCE_ROWS``: as :func:`mainloop_a8`'s."""
    x_ring = rings[2]
    DEPTH: gl.constexpr = x_ring.shape[0]
    QUARTER: gl.constexpr = BT // 4
    ACC: gl.constexpr = fp8_acc_layout(QUARTER, gl.num_warps())
    first = gl.zeros([64, QUARTER], gl.float32, layout=ACC)
    second = gl.zeros([64, QUARTER], gl.float32, layout=ACC)
    third = gl.zeros([64, QUARTER], gl.float32, layout=ACC)
    fourth = gl.zeros([64, QUARTER], gl.float32, layout=ACC)
    for step in range(steps):
        s = done + step
        slot = s % DEPTH
        last = step == steps - 1
        rows = x_ring.index(slot)
        a, shift = _weight_operand(rings, s, HALF, QUARTER, A8_REGISTERS, FENCE_ROWS)
        even = _quarter_product(a, rows, 0, first)
        odd = _quarter_product(a, rows, 1, second)
        even = warpgroup_mma_wait(num_outstanding=1, deps=(even,))
        first = _promoted(first, even, shift, rings, slot, last, 0)
        even = _quarter_product(a, rows, 2, third)
        odd = warpgroup_mma_wait(num_outstanding=1, deps=(odd,))
        second = _promoted(second, odd, shift, rings, slot, last, QUARTER)
        odd = _quarter_product(a, rows, 3, fourth)
        even = warpgroup_mma_wait(num_outstanding=1, deps=(even,))
        third = _promoted(third, even, shift, rings, slot, last, 2 * QUARTER)
        odd = warpgroup_mma_wait(num_outstanding=0, deps=(odd,))
        fourth = _promoted(fourth, odd, shift, rings, slot, last, 3 * QUARTER)
        mbarrier.arrive(rings[4].index(slot))
    return first, second, third, fourth


@gluon.jit
def _quarter_product(a, rows, QUARTER_INDEX: gl.constexpr, acc):
    """The block product of the A operand ``a`` (64 weight rows, one step) and quarter
    ``QUARTER_INDEX`` of a ring slot's ``rows [BT, 128]``, issued into a fresh partial in
    ``acc``'s layout (``acc`` gives the layout only), in flight."""
    QUARTER: gl.constexpr = acc.shape[1]
    routes = rows.slice(QUARTER_INDEX * QUARTER, QUARTER, dim=0).permute((1, 0))
    return warpgroup_mma(a, routes, acc, use_acc=False, is_async=True)


@gluon.constexpr_function
def quantize_layout(warps: int) -> gl.BlockedLayout:
    """``[rows, 128]`` activations of the row quantizer: 8 consecutive columns (16 bytes) per
    thread, a warp over 2 rows."""
    return gl.BlockedLayout([1, 8], [2, 16], [warps, 1], [1, 0])


# ROWS unspecialized: one compile for every row count
@gluon.jit(do_not_specialize=["ROWS"])
def fp8_block_amax_kernel(x_ptr, amax_ptr, ROWS, K, BR: gl.constexpr):
    """The first pass of the A8 row quantizer: ``amax [ROWS, K / 128]`` fp32, the largest
    magnitude of each 128-column block of ``x [ROWS, K]`` bf16 (exact). Grid ``(cdiv(ROWS, BR),
    K / 128)``, one block of ``BR`` rows a program; ``BR`` a multiple of 2 * num_warps."""
    L: gl.constexpr = quantize_layout(gl.num_warps())
    rows = gl.program_id(0) * BR + gl.arange(0, BR, layout=gl.SliceLayout(1, L))
    block = gl.program_id(1)
    cols = block * A8_STEP + gl.arange(0, A8_STEP, layout=gl.SliceLayout(0, L))
    live = rows < ROWS
    x = gl.load(x_ptr + rows.to(gl.int64)[:, None] * K + cols[None, :], mask=live[:, None], other=0.0)
    amax = gl.max(gl.abs(x.to(gl.float32)), axis=1)
    gl.store(amax_ptr + rows.to(gl.int64) * (K // A8_STEP) + block, amax, mask=live)


# ROWS unspecialized: one compile for every row count
@gluon.jit(do_not_specialize=["ROWS"])
def quantize_fp8_rows_kernel(
    x_ptr,
    amax_ptr,
    codes_ptr,
    scales_ptr,
    ROWS,
    K,
    BR: gl.constexpr,
    BLOCKS: gl.constexpr,
    MMA_ORDER: gl.constexpr = False,
):
    """The second pass of the A8 row quantizer (``fp8.quantize_rows`` bit for bit,
    docs/numerics.md section 8): ``x [ROWS, K]`` bf16 and its blocks' largest magnitudes ``amax
    [ROWS, K / 128]`` (:func:`fp8_block_amax_kernel`) -> ``codes [ROWS, K]`` e4m3 and ``scales
    [ROWS]`` fp32: per row ``a = max(amax, 2**-100)`` over all its blocks, codes ``e4m3(clamp(x *
    div_rn(448, a), -448, 448))`` (nearest even), scale ``div_rn(a, 448)`` (0 for a row of
    zeros). Grid ``(cdiv(ROWS, BR), K / 128)``: each program reads its rows' ``K / 128`` block
    maxima (``BLOCKS``, a power of two at least that), quantizes its block and, in block 0, writes
    the rows' scales. ``BR`` a multiple of 2 * num_warps. ``MMA_ORDER``: each block's codes in
    the A8 fragment order (module docstring): column ``32 q + 8 c + 4 h + j`` of a block written
    at its position ``32 c + 16 h + 4 q + j``."""
    L: gl.constexpr = quantize_layout(gl.num_warps())
    rows = gl.program_id(0) * BR + gl.arange(0, BR, layout=gl.SliceLayout(1, L))
    block = gl.program_id(1)
    live = rows < ROWS
    blocks = gl.arange(0, BLOCKS, layout=gl.SliceLayout(0, L))
    maxima = gl.load(
        amax_ptr + rows.to(gl.int64)[:, None] * (K // A8_STEP) + blocks[None, :],
        mask=live[:, None] & (blocks < K // A8_STEP)[None, :],
        other=0.0,
    )
    amax = gl.max(maxima, axis=1)
    floored = gl.maximum(amax, 7.888609052210118e-31)  # 2**-100
    e4m3_max = gl.full_like(floored, 448.0)
    column = gl.arange(0, A8_STEP, layout=gl.SliceLayout(0, L))
    offsets = rows.to(gl.int64)[:, None] * K + (block * A8_STEP + column)[None, :]
    x = gl.load(x_ptr + offsets, mask=live[:, None], other=0.0).to(gl.float32)
    product = x * gl.expand_dims(gl.div_rn(e4m3_max, floored), 1)
    codes = gl.minimum(gl.maximum(product, -448.0), 448.0).to(gl.float8e4nv, fp_downcast_rounding="rtne")
    if MMA_ORDER:  # column bits (j: 0-1, h: 2, c: 3-4, q: 5-6) -> position bits (j, q, h, c)
        position = (column & 3) | ((column >> 3) & 3) << 5 | ((column >> 2) & 1) << 4 | (column >> 5) << 2
        offsets = rows.to(gl.int64)[:, None] * K + (block * A8_STEP + position)[None, :]
    gl.store(codes_ptr + offsets, codes, mask=live[:, None])
    scales = gl.where(amax > 0, gl.div_rn(floored, e4m3_max), 0.0)
    gl.store(scales_ptr + rows, scales, mask=live & (block == 0))
