"""Decode kernels of the ``triton`` backend: grouped GEMMs for few rows per expert (Gluon), for
W4A16, A4 and split (per-token precision) calls.

Imported lazily (needs ``triton.experimental.gluon``, Triton 3.6+, and a CUDA GPU of sm_80+).
Launched by :func:`a4prefill.ops.backends.triton_moe.fused_moe`: its default for calls with
bf16 io and few routes per active expert (decode sizes), and any call whose
``GemmConfig.decode`` is set explicitly (the tests, the benchmark's sweep). The math is the one of
:mod:`triton_kernels` (docs/numerics.md sections 2 and 4), the schedule is different:

- **Weights on the MMA's M side, routes on N.** One ``mma.sync.m16n8k16`` multiplies 16 weight
  rows by up to 8 routes of one expert. A decode step has one or two routes per expert, so no
  activation tile is padded to 16 rows, and the weights, not the activations, fill the MMA.
  A CTA's tile holds 8, 16 or 32 routes of one expert (``TILE``): each dequantized weight
  fragment then feeds ``TILE / 8`` MMAs, so an expert with more routes is read and dequantized
  once per tile rather than once per 8 routes.
- **Codes go from global memory straight into MMA registers.** Each thread loads 16
  consecutive code bytes (one 128-bit load) of two weight rows per 128-column step and turns
  them into bf16 in registers (:data:`CODES_ASM`; the scale bytes two at a time,
  :data:`FACTOR_ASM`): no layout conversion. The MMA operand layout (``k_width=4``) is reached
  by *relabelling K*: the thread's 32 physical columns become its logical K slots in the order
  of :func:`logical_to_physical`. With ``STAGES`` (``DecodeGemm.stages``) the same 16-byte
  chunks go through shared memory first: each thread ``cp.async``-copies its own chunks
  ``STAGES - 1`` K steps ahead and loads them back when their group is done, so the bytes in
  flight cost shared memory instead of registers; else ``PREFETCH`` keeps the next step's
  weights in registers, or nothing runs ahead.
- **The activations are permuted once to match** (:func:`permute_k_kernel`): column ``m`` of
  each 128-column block of the permuted activations is physical column
  ``logical_to_physical(column_to_logical(m))``. FC1 stores its output (FC2's input) directly
  in that order. :func:`column_to_logical` makes each thread's 8 activations of a 32-column
  group one 128-bit load that is already the B operand of its two MMAs (no register moves).
- **K or the rows are split over the warps of a CTA.** With a K split each warp streams its own
  K slice of the same 16 (or 32) weight rows (a batched MMA layout whose batch axis is the
  warp) and the fp32 partial sums are added across warps at the end: small token counts get
  many CTAs without atomics. With a row split each warp streams all of K for its own rows.

Numerics: FP4 weights are dequantized exactly to ``e2m1 * block_scale * 2**-7`` in bf16 (at
most 5 significant bits; the ``2**-7`` keeps the scale factor ``scale * 2**119`` below bf16's
largest value and is undone in fp32),
the MMAs accumulate in fp32, and the epilogues apply alpha, the io roundings, clamp, SwiGLU and
(A4 routes) the per-16 re-quantization of FC1's output with ``gs2[e]`` exactly as
:mod:`triton_kernels` does, with the A4 activations quantized by the same pass before FC1. Only
the order of the fp32 additions differs.
Scale bytes are decoded as e4m3 values including subnormals and sign; like
:mod:`triton_kernels`, the NaN bytes ``0x7f``/``0xff`` decode as 480/-480 (not NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from a4prefill.ops.backends.triton_kernels import _quantize_groups, swiglu
from a4prefill.ops.precision import MODE_A4, MODE_SPLIT, MODE_W4A16

# The kernels' MODE (a4prefill.ops.precision), as Gluon constexprs
W4A16_MODE: gl.constexpr = gl.constexpr(MODE_W4A16)
A4_MODE: gl.constexpr = gl.constexpr(MODE_A4)
SPLIT_MODE: gl.constexpr = gl.constexpr(MODE_SPLIT)

# cp.async into shared memory: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared``
# before (same arguments: shared memory, pointers, mask)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


def logical_to_physical(logical: int) -> int:
    """Physical K column (0..127) of logical K slot ``logical`` (0..127) within a 128 block.

    Slot ``L = 16 * (2 h + s) + 4 c + p`` belongs to lane group ``c`` (code bytes
    ``16 c .. 16 c + 15`` of the block's 64), byte group ``h`` of those (4 bytes, 8 nibbles),
    half ``s`` and element ``p`` of :data:`CODES_ASM`'s output, which holds nibble
    ``4 (p & 1) + (p >> 1) + 2 s`` of the byte group. The kernels compute the same map inline
    (:func:`permute_k_kernel`) and its inverse (``fc1_decode_kernel``'s store).
    """
    p, c, sigma = logical % 4, (logical // 4) % 4, logical // 16
    h, s = sigma // 2, sigma % 2
    return 32 * c + 8 * h + 4 * (p % 2) + p // 2 + 2 * s


def column_to_logical(column: int) -> int:
    """Logical K slot (0..127) held by column ``column`` (0..127) of a 128 block of the permuted
    activations: column ``m = 32 b + 8 c + 4 h + 2 q + p`` holds slot ``32 b + 16 q + 4 c + 2 h +
    p``. Lane group ``c``'s 8 columns ``32 b + 8 c ..`` are then the slots of its B operand
    registers of MMAs ``2 b`` (``h = 0``) and ``2 b + 1`` (``h = 1``), in register order. The
    kernels compute the same map inline (:func:`permute_k_kernel`) and its inverse
    (``fc1_decode_kernel``'s store)."""
    b, c, h, q, p = column // 32, (column // 8) % 4, (column // 4) % 2, (column // 2) % 2, column % 2
    return 32 * b + 16 * q + 4 * c + 2 * h + p


@gluon.constexpr_function
def _bases(axis: int, start: int, stop: int) -> list[list[int]]:
    """Linear-layout bases of a 3-D tensor: index ``start, 2 start, ...`` (below ``stop``) on
    ``axis``, one basis each."""
    bases = []
    while start < stop:
        bases.append([start if dim == axis else 0 for dim in range(3)])
        start *= 2
    return bases


# The kernels' layouts are built inside the kernels from their int and bool constexprs (WARPS, BK,
# ROWS, TILE) by the constexpr functions below: a kernel's launch arguments are then plain
# values that any Triton post-compile hook can serialize (vLLM's JIT monitor, Triton's
# ``jit_post_compile_hook``). The same functions return the layouts in host code (tests).


@gluon.constexpr_function
def words_layout(warps: int, block_k: int, rows: int) -> gl.DistributedLinearLayout:
    """Layout of one step's code words ``[warps, rows, block_k / 8]`` (int32, 4 code bytes each):
    thread ``(r, c)`` (``r = lane / 4``, ``c = lane % 4``) holds 4 consecutive words (one 128-bit
    load, code bytes ``16 c .. 16 c + 15``) of each 16-word (64-byte) group, of rows ``r + 8 i``;
    axis 0 is the warp."""
    words = block_k // 8
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], *_bases(2, 16, words), *_bases(1, 8, rows)],
        lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=_bases(0, 1, warps),
        block_bases=[],
        shape=[warps, rows, words],
    )


@gluon.constexpr_function
def mma_layout(warps: int) -> gl.NVMMADistributedLayout:
    """The batched ``mma.sync`` accumulator ``[warps, rows, TILE]`` (axis 0 is the warp; the
    layout repeats over 16-row and 8-route blocks)."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1, 1], instr_shape=[1, 16, 8])


@gluon.constexpr_function
def operand_layout(index: int, warps: int) -> gl.DotOperandLayout:
    """Operand ``index`` (0: A, the weights; 1: B, the activations) of :func:`mma_layout`'s MMA,
    ``k_width=4``."""
    return gl.DotOperandLayout(operand_index=index, parent=mma_layout(warps), k_width=4)


# $2: two e4m3 scale bytes (a zero-extended uint16, byte 0 in bits 7..0). $0, $1: bf16
# ``scale * 2**119`` of byte 0 and byte 1, exact. One ``prmt`` puts the bytes at bits 15..8 of
# the two halves; a byte's sign is then bf16 bit 15
# and its other bits go to bits 10..4: that bf16 is exactly ``e4m3 * 2**-120`` (subnormal scales
# included); two bf16x2 products by 2**120 and 2**119 follow, for both bytes at once.
FACTOR_ASM = gl.constexpr("""
{
.reg .b32 w, m, c120, c119, nz;
mov.b32 c120, 0x7B807B80;
mov.b32 c119, 0x7B007B00;
mov.b32 nz, 0x80008000;
prmt.b32 w, $2, $2, 0x1202;
shr.b32 m, w, 4;
and.b32 m, m, 0x07F007F0;
and.b32 w, w, 0x80008000;
or.b32 w, w, m;
fma.rn.bf16x2 w, w, c120, nz;
fma.rn.bf16x2 w, w, c119, nz;
mov.b32 {$0, $1}, w;
}
""")

# $4: four code bytes (eight e2m1 nibbles n0..n7, n0 in bits 0..3). $5: the bf16 factor of
# their block (:data:`FACTOR_ASM`), used in both halves (``mov.b32 f, {$5, $5}`` costs nothing:
# ptxas reads the factor's half through the multiply's operand swizzle). $0, $1: half s=0,
# elements (n0, n4), (n1, n5); $2, $3: half s=1, (n2, n6), (n3, n7). Each bf16 is
# ``e2m1 * scale * 2**-7``, exact: a nibble's magnitude bits go to bf16 bits 8..6
# (``e2m1 * 2**-126``) and its sign to bit 15, then one fma by the factor.
# ``mul.hi`` by 2**30 is ``>> 2`` on the FMA pipe.
CODES_ASM = gl.constexpr("""
{
.reg .b32 m, s, f, nz;
mov.b32 nz, 0x80008000;
mov.b32 f, {$5, $5};
shl.b32 s, $4, 12; and.b32 s, s, 0x80008000;
shl.b32 m, $4, 6; and.b32 m, m, 0x01C001C0; or.b32 s, s, m;
fma.rn.bf16x2 $0, s, f, nz;
shl.b32 s, $4, 8; and.b32 s, s, 0x80008000;
shl.b32 m, $4, 2; and.b32 m, m, 0x01C001C0; or.b32 s, s, m;
fma.rn.bf16x2 $1, s, f, nz;
shl.b32 s, $4, 4; and.b32 s, s, 0x80008000;
mul.hi.u32 m, $4, 0x40000000; and.b32 m, m, 0x01C001C0; or.b32 s, s, m;
fma.rn.bf16x2 $2, s, f, nz;
and.b32 s, $4, 0x80008000;
shr.b32 m, $4, 6; and.b32 m, m, 0x01C001C0; or.b32 s, s, m;
fma.rn.bf16x2 $3, s, f, nz;
}
""")


@gluon.jit
def _factors(scale_pairs, WORDS: gl.constexpr):
    """Scale byte pairs ``[W, M, G / 2]`` (uint16, :func:`scale_layout`) -> the :data:`FACTOR_ASM`
    factors (bf16) of the ``G`` bytes, each repeated for its block's 2 code words: ``[W, M, 2 G]``
    in the ``WORDS`` layout (register copies only)."""
    shape: gl.constexpr = scale_pairs.shape
    low, high = gl.inline_asm_elementwise(
        FACTOR_ASM,
        "=h,=h,r",
        [scale_pairs.to(gl.int32)],
        dtype=(gl.bfloat16, gl.bfloat16),
        is_pure=True,
        pack=1,
    )
    f = gl.reshape(gl.join(low, high), [shape[0], shape[1], shape[2] * 2])
    f = gl.reshape(gl.join(f, f), [shape[0], shape[1], shape[2] * 4])
    return gl.convert_layout(f, WORDS)


def _split_outputs(asm: str) -> str:
    """:data:`CODES_ASM` with its four bf16x2 results split into eight bf16 outputs ``$0..$7``
    (``$2 i`` the low half of result ``i``) and its inputs renumbered to ``$8`` (word), ``$9``."""
    body = asm.strip().removeprefix("{").removesuffix("}")
    for i in range(4):
        body = body.replace(f"${i},", f"o{i},")
    body = body.replace("$4", "$8").replace("$5", "$9")
    splits = "".join(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, o{i};\n" for i in range(4))
    return "{\n.reg .b32 o0, o1, o2, o3;" + body + splits + "}"


WORD_CODES_ASM = gl.constexpr(_split_outputs(CODES_ASM.value))


@gluon.jit
def _dequant_words(words, factors):
    """Code words (int32, 4 code bytes each) and their factors (same shape and layout) -> the
    halves ``(s=0, s=1)`` of :func:`_dequant`, ``[..., 4 n]`` bf16 (byte ``4 J + p`` of word ``J``
    at ``4 J + p``)."""
    outs = gl.inline_asm_elementwise(
        WORD_CODES_ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
        [words, factors],
        dtype=(gl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )
    shape: gl.constexpr = words.shape
    low = gl.join(gl.join(outs[0], outs[2]), gl.join(outs[1], outs[3]))
    high = gl.join(gl.join(outs[4], outs[6]), gl.join(outs[5], outs[7]))
    low = gl.reshape(low, [shape[0], shape[1], shape[2] * 4])
    high = gl.reshape(high, [shape[0], shape[1], shape[2] * 4])
    return low, high


@gluon.jit
def _mma_step(
    words,
    scale_pairs,
    act,
    acc,
    WORDS: gl.constexpr,
    A: gl.constexpr,
    B: gl.constexpr,
    WARPS: gl.constexpr,
    BK: gl.constexpr,
):
    """``acc + dequant(words, scale_pairs) @ act`` for one K step (``WORDS``/:func:`scale_layout`
    operands, ``act [W, BK, TILE]`` the activations as loaded (:func:`activation_layout`);
    weights ``* 2**-7``)."""
    lo, hi = _dequant_words(words, _factors(scale_pairs, WORDS))
    return mma_v2(_operand(lo, hi, A, WARPS, WORDS.shape[1], BK), _b_operand(act, B), acc)


@gluon.jit
def _operand(low, high, layout: gl.constexpr, WARPS: gl.constexpr, ROWS: gl.constexpr, BK: gl.constexpr):
    """Halves ``[W, R, BK / 2]`` (byte ``j = 64 g + 16 c + 4 h + p``) -> A ``[W, R, BK]`` with logical
    ``k = 16 * (8 g + 2 h + s) + 4 c + p`` (a relabelling: no data moves between threads)."""
    t = gl.join(low, high)
    t = gl.reshape(t, [WARPS, ROWS, BK // 128, 4, 4, 4, 2])  # g, c, h, p, s
    t = gl.permute(t, [0, 1, 2, 4, 6, 3, 5])  # g, h, s, c, p
    t = gl.reshape(t, [WARPS, ROWS, BK])
    return gl.convert_layout(t, layout)


@gluon.jit
def _b_operand(act, layout: gl.constexpr):
    """Activations ``[W, BK, TILE]`` as loaded (column ``m = 32 b + 8 c + 4 h + 2 q + p`` of a
    step, :func:`activation_layout`) -> the B operand with logical ``k = 32 b + 16 q + 4 c + 2 h +
    p`` (:func:`column_to_logical`; a relabelling: no data moves between threads)."""
    W: gl.constexpr = act.shape[0]
    BK: gl.constexpr = act.shape[1]
    T: gl.constexpr = act.shape[2]
    t = gl.reshape(act, [W, BK // 32, 4, 2, 2, 2, T])  # b, c, h, q, p
    t = gl.permute(t, [0, 1, 4, 2, 3, 5, 6])  # b, q, c, h, p
    return gl.convert_layout(gl.reshape(t, [W, BK, T]), layout)


@gluon.jit
def _row_offsets(first_row, row_stride, warp_rows, warp_stride, index_stride, LAYOUT: gl.constexpr):
    """int32 offsets ``[W, M, J]`` (``LAYOUT``) of index ``j`` of row ``r`` of warp ``w``:
    ``(first_row + w * warp_rows + r) * row_stride + w * warp_stride + j * index_stride``."""
    w = gl.arange(0, LAYOUT.shape[0], layout=gl.SliceLayout(1, gl.SliceLayout(2, LAYOUT)))
    r = gl.arange(0, LAYOUT.shape[1], layout=gl.SliceLayout(0, gl.SliceLayout(2, LAYOUT)))
    j = gl.arange(0, LAYOUT.shape[2], layout=gl.SliceLayout(0, gl.SliceLayout(1, LAYOUT)))
    rows = first_row + w[:, None, None] * warp_rows + r[None, :, None]
    return rows * row_stride + (w * warp_stride)[:, None, None] + j[None, None, :] * index_stride


@gluon.jit
def _weight_offsets(first_row, row_words, warp_rows, warp_words, WORDS: gl.constexpr, SCALES: gl.constexpr):
    """int32 offsets of one step's code words ``[W, M, BK / 8]`` (``WORDS``, in int32 words)
    and scale byte pairs ``[W, M, BK / 32]`` (``SCALES``, in uint16) within one expert: warp
    ``w`` reads rows ``first_row + w * warp_rows + r`` from code word ``w * warp_words`` on
    (split K: ``warp_rows`` 0; split rows: ``warp_words`` 0)."""
    code_off = _row_offsets(first_row, row_words, warp_rows, warp_words, 1, WORDS)
    scale_off = _row_offsets(first_row, row_words // 4, warp_rows, warp_words // 4, 1, SCALES)
    return code_off, scale_off


@gluon.jit
def _activation_offsets(rows, row_stride, warp_cols, X: gl.constexpr, WARPS: gl.constexpr, BK: gl.constexpr):
    """int32 offsets ``[W, BK, TILE]`` (layout ``X``, :func:`activation_layout`) of one step's
    activations: rows ``rows [TILE]``, ``row_stride`` elements apart; warp ``w`` starts at column
    ``w * warp_cols``."""
    w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, X)))
    k = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(2, X)))
    return (rows * row_stride)[None, None, :] + (w * warp_cols)[:, None, None] + k[None, :, None]


@gluon.jit
def _tile(tile_expert_ptr, tile_row_ptr, num_tiles_ptr, routes, TILE: gl.constexpr, X: gl.constexpr):
    """Of the tile of program ``(pid_m, *)``: its expert, sorted positions ``rows [TILE]`` (a
    slice of ``X``'s route axis), ``readable`` (``rows < routes``: their route ids may be read)
    and ``idle`` (``pid_m`` is past the call's tiles: the program has nothing to do). Rows past
    the tile's segment belong to the next expert or to no route: :func:`_live` masks them."""
    pid_m = gl.program_id(0)
    num_tiles = gl.load(num_tiles_ptr)
    expert = gl.load(tile_expert_ptr + pid_m)
    layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, X))
    rows = gl.load(tile_row_ptr + pid_m) + gl.arange(0, TILE, layout=layout)
    return expert, rows, rows < routes, pid_m >= num_tiles


@gluon.jit
def _warp_split(K, ROWS: gl.constexpr, WARPS: gl.constexpr, BK: gl.constexpr, SPLIT_K: gl.constexpr):
    """``(k_per_warp, n0, warp_rows, warp_cols)`` of a CTA whose ``WARPS`` warps of ``ROWS`` rows
    split ``K`` (``SPLIT_K``: same rows, K slices ``warp_cols`` apart) or the rows (all of K, rows
    ``warp_rows`` apart); ``n0`` is the CTA's first output row (grid axis 1)."""
    if SPLIT_K:
        k_per_warp = gl.multiple_of(K // WARPS, BK)
        return k_per_warp, gl.program_id(1) * ROWS, 0, k_per_warp
    else:
        return gl.multiple_of(K, BK), gl.program_id(1) * (ROWS * WARPS), ROWS, 0


@gluon.jit
def _live(seg_start_ptr, seg_count_ptr, expert, rows, readable):
    """Which ``rows`` of a tile of ``expert`` are its routes: the only ones whose activations are
    loaded (a masked MMA column reads nothing, so a tile of 1-2 routes moves 1-2 activation rows,
    not 8) and whose results are stored."""
    return readable & (rows < gl.load(seg_start_ptr + expert) + gl.load(seg_count_ptr + expert))


@gluon.jit
def _epilogue_index(acc, SPLIT_K: gl.constexpr):
    """The finished ``[W', M, TILE]`` sums of a CTA's accumulator ``[W, M, TILE]``: split K adds the
    warps' slices (``W' = 1``); split rows keeps each warp's own rows (``W' = W``)."""
    if SPLIT_K:
        return gl.expand_dims(gl.sum(acc, axis=0), 0)
    else:
        return acc


@gluon.jit
def _epilogue_rows(y, n0, rows, live):
    """Weight rows ``n [W', M, 1]`` (``n0 + M w + r``), sorted positions ``[1, 1, TILE]`` and their
    store mask ``[1, 1, TILE]`` of the epilogue values ``y [W', M, TILE]``, in ``y``'s layout."""
    EPI: gl.constexpr = y.type.layout
    blocks: gl.constexpr = y.shape[0]
    w = gl.arange(0, blocks, layout=gl.SliceLayout(1, gl.SliceLayout(2, EPI)))
    M: gl.constexpr = y.shape[1]
    r = gl.arange(0, M, layout=gl.SliceLayout(0, gl.SliceLayout(2, EPI)))
    n = n0 + M * w[:, None, None] + r[None, :, None]
    col: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, EPI))
    out_rows = gl.convert_layout(rows, col)[None, None, :]
    out_mask = gl.convert_layout(live, col)[None, None, :]
    return n, out_rows, out_mask


@gluon.jit
def _route_is_a4(flag_ptr, route, out_mask, TOPK, MODE: gl.constexpr):
    """Per route of the epilogue (``route [1, 1, TILE]``, route ids): whether its token's row
    flag says A4 (``SPLIT_MODE``); in the uniform modes every route has the call's precision and this is
    only a placeholder."""
    if MODE == SPLIT_MODE:
        return gl.load(flag_ptr + route // TOPK, mask=out_mask, other=0) != 0
    else:
        return out_mask


@gluon.jit
def _alpha(scale2, encode_scale_ptr, is_a4, MODE: gl.constexpr):
    """The epilogue multiplier of one GEMM: ``scale2`` for W4A16 routes, ``div_rn(scale2,
    encode_scale)`` for A4 routes (docs/numerics.md section 3), times 128 to undo the weights'
    ``2**-7`` (exact). ``SPLIT_MODE`` picks per route with ``is_a4 [1, 1, TILE]``."""
    if MODE == W4A16_MODE:
        return scale2 * 128.0
    elif MODE == A4_MODE:
        return gl.div_rn(scale2, gl.load(encode_scale_ptr)) * 128.0
    else:
        return gl.where(is_a4, gl.div_rn(scale2, gl.load(encode_scale_ptr)) * 128.0, scale2 * 128.0)


@gluon.jit
def _requantize(h, gs2_ptr, is_a4, MODE: gl.constexpr):
    """FC1's bf16 output ``h [W', M, TILE]`` (features ``n0 + M w + r`` on axes 0-1, routes on
    axis 2) of A4 routes quantized per 16 features with the expert's encode scale ``gs2``, as
    ``triton_kernels``' A4 epilogue (:func:`triton_kernels._quantize_groups`): the values
    ``e2m1 * block_scale`` in bf16. W4A16 routes (``SPLIT_MODE``, ``is_a4`` False) keep ``h``."""
    W: gl.constexpr = h.shape[0]
    M: gl.constexpr = h.shape[1]
    T: gl.constexpr = h.shape[2]
    gs2 = gl.load(gs2_ptr)
    inv_gs2 = gl.div_rn(gs2 * 0.0 + 1.0, gs2)
    rows = gl.reshape(gl.permute(h.to(gl.float32), [2, 0, 1]), [T, W * M])
    q, _, _ = _quantize_groups(rows, gs2, inv_gs2, T, W * M)
    q = gl.convert_layout(gl.permute(gl.reshape(q, [T, W, M]), [1, 2, 0]), h.type.layout).to(gl.bfloat16)
    if MODE == A4_MODE:
        return q
    else:
        return gl.where(is_a4, q, h)


@gluon.jit
def _fc1_step(
    x, x_mask, w_base, s_base, gate_off, gate_soff, up_off, up_soff, gw, gs, uw, us, acc_g, acc_u,
    WORDS: gl.constexpr, A: gl.constexpr, B: gl.constexpr, WARPS: gl.constexpr, BK: gl.constexpr,
):  # fmt: skip
    """One prefetching FC1 step: loads its activations (pointers ``x``, mask ``x_mask``) and the
    next step's gate and up weights (at ``w_base``/``s_base``), then its MMAs with the weights
    ``gw, gs, uw, us`` loaded one step earlier. Returns the next weights and the sums."""
    xb = gl.load(x, mask=x_mask, other=0.0)
    ngw, ngs = gl.load(w_base + gate_off), gl.load(s_base + gate_soff)
    nuw, nus = gl.load(w_base + up_off), gl.load(s_base + up_soff)
    acc_g = _mma_step(gw, gs, xb, acc_g, WORDS, A, B, WARPS, BK)
    acc_u = _mma_step(uw, us, xb, acc_u, WORDS, A, B, WARPS, BK)
    return ngw, ngs, nuw, nus, acc_g, acc_u


@gluon.jit
def _fc2_step(
    h, h_mask, w_base, s_base, w_off, s_off, ww, ws, acc,
    WORDS: gl.constexpr, A: gl.constexpr, B: gl.constexpr, WARPS: gl.constexpr, BK: gl.constexpr,
):  # fmt: skip
    """:func:`_fc1_step` for FC2's one weight matrix."""
    hb = gl.load(h, mask=h_mask, other=0.0)
    nww, nws = gl.load(w_base + w_off), gl.load(s_base + s_off)
    return nww, nws, _mma_step(ww, ws, hb, acc, WORDS, A, B, WARPS, BK)


@gluon.jit
def _stages(w_off, STAGES: gl.constexpr):
    """Shared memory for ``STAGES`` K steps of the code words at offsets ``w_off [W, M, BK / 8]``:
    ``[STAGES, W, M, BK / 8]`` int32."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    shape: gl.constexpr = [STAGES] + w_off.shape  # noqa: RUF005 (no starred items in Gluon's frontend)
    return gl.allocate_shared_memory(gl.int32, shape, layout)


@gluon.jit
def _copy_step(codes, w_base, w_off, step, steps, STAGES: gl.constexpr, BK: gl.constexpr):
    """Starts copying K step ``step``'s code words (offsets ``w_off`` from ``w_base``) into stage
    ``step % STAGES`` of ``codes`` (``cp.async``; nothing is read past the last of ``steps``).
    Each thread copies the words it loads itself later (``WORDS`` layout); the caller commits."""
    _async_load(
        codes.index(step % STAGES), w_base + w_off + step * (BK // 8), mask=(w_off >= 0) & (step < steps)
    )


# $1: a global address; L2 fetches the 128-byte line that holds it (``prefetch.global.L2``: no
# register waits for it, there is nothing to wait for). $0: a dummy result (inline asm needs one).
L2_PREFETCH_ASM = gl.constexpr("{ prefetch.global.L2 [$1]; mov.b32 $0, 0; }")
# Programmatic dependent launch (sm_90+): FC1's CTAs let FC2's start at once (FC2's CTAs then
# fill the SMs FC1's last wave leaves idle); FC2 waits for FC1's grid to finish and its memory to
# be visible before it reads FC1's output. Without a dependent launch both return at once.
LAUNCH_DEPENDENTS_ASM = gl.constexpr("{ griddepcontrol.launch_dependents; mov.b32 $0, 0; }")
WAIT_FOR_PREREQUISITES_ASM = gl.constexpr("{ griddepcontrol.wait; mov.b32 $0, 0; }")


@gluon.jit
def _grid_dependency(ASM: gl.constexpr):
    """One ``griddepcontrol`` instruction (:data:`LAUNCH_DEPENDENTS_ASM` or
    :data:`WAIT_FOR_PREREQUISITES_ASM`), once per thread."""
    gl.inline_asm_elementwise(ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _l2_prefetch_rows(w_base, line_off, steps, BK: gl.constexpr):
    """Asks L2 for every code word of a warp's rows over its ``steps`` K steps (``line_off`` the
    first word of each 128-byte line of step 0, :func:`l2_prefetch_layout`; a 128-column step
    shares its line with the next one, so those go two steps at a time)."""
    STRIDE: gl.constexpr = 2 if BK == 128 else 1
    for step in range(0, steps, STRIDE):
        gl.inline_asm_elementwise(
            L2_PREFETCH_ASM,
            "=r,l",
            [w_base + line_off + step * (BK // 8)],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )


@gluon.jit(do_not_specialize=["ROUTES"])  # one compile for every route count
def fc1_decode_kernel(
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
    ROUTES,
    limit,
    HAS_LIMIT: gl.constexpr,
    MODE: gl.constexpr,
    PREFETCH: gl.constexpr,
    STAGES: gl.constexpr,
    OVERLAP: gl.constexpr,
    WARPS: gl.constexpr,
    BK: gl.constexpr,
    SPLIT_K: gl.constexpr,
    ROWS: gl.constexpr,
    TILE: gl.constexpr,
):
    """FC1 + SwiGLU of up to ``TILE`` routes x ``M * W'`` features (``M`` rows per warp, 16 or 32):
    ``out[p, slot(n)] = io(io(silu(gate)) * up)`` for sorted positions ``p`` of one tile.

    ``x [T, H]`` bf16 in permuted K order (A4 rows: already quantized with ``gs1``, the values
    ``e2m1 * block_scale``), ``w [E, 2I, H/8]`` int32 (the uint8 codes, 4 per word), ``ws [E,
    2I, H/32]`` uint16 (the e4m3 scale bytes, 2 per element), ``w_scale2 [E, 2]`` fp32, ``out
    [R, I]`` bf16 in permuted K order
    (FC2's input; A4 routes re-quantized with ``gs2[e]``), ``ROUTES = R``. ``MODE``: ``W4A16_MODE``,
    ``A4_MODE``, or ``SPLIT_MODE`` per token (``flag [T]`` uint8, 1 = A4); ``gs1 [1]``, ``gs2 [E]``
    fp32 encode scales
    (read in ``A4_MODE`` and ``SPLIT_MODE`` only). Routing tensors as in :mod:`triton_kernels` with
    ``TILE``-route tiles.
    ``SPLIT_K``: the ``WARPS`` warps stream K slices of the same ``M`` features (``W' = 1``,
    ``H % (WARPS * BK) == 0``); else each warp streams all of K for its own ``M`` features
    (``W' = WARPS``, ``H % BK == 0``). ``PREFETCH``: each warp loads step ``i + 1``'s weights
    before step ``i``'s MMAs; ``STAGES``: the code words go through shared memory ``STAGES - 1``
    steps ahead. ``OVERLAP`` (sm_90+): FC2 is launched as this grid's programmatic dependent and
    may start as soon as every CTA here has (:data:`LAUNCH_DEPENDENTS_ASM`). Only a tile's own
    routes are read (:func:`_live`). Grid ``(max_tiles, I / (M W'))``; ``BK % 128 == 0``, ``I % 128 == 0``.
    """
    WORDS: gl.constexpr = words_layout(WARPS, BK, ROWS)
    SCALES: gl.constexpr = scale_layout(WARPS, BK, ROWS)
    ACC: gl.constexpr = mma_layout(WARPS)
    A: gl.constexpr = operand_layout(0, WARPS)
    B: gl.constexpr = operand_layout(1, WARPS)
    X: gl.constexpr = activation_layout(WARPS, BK, TILE)
    if OVERLAP:
        _grid_dependency(LAUNCH_DEPENDENTS_ASM)
    expert, rows, readable, idle = _tile(tile_expert_ptr, tile_row_ptr, num_tiles_ptr, ROUTES, TILE, X)
    if idle:
        return
    k_per_warp, n0, warp_rows, warp_cols = _warp_split(H, ROWS, WARPS, BK, SPLIT_K)
    row_words = gl.multiple_of(H // 8, 16)  # H % 128 == 0
    gate_off, gate_soff = _weight_offsets(n0, row_words, warp_rows, warp_cols // 8, WORDS, SCALES)
    up_off, up_soff = _weight_offsets(n0 + INTER, row_words, warp_rows, warp_cols // 8, WORDS, SCALES)
    expert_rows = expert.to(gl.int64) * (2 * INTER)
    w_base = w_ptr + expert_rows * row_words
    s_base = ws_ptr + expert_rows * (row_words // 4)
    token = gl.load(sorted_route_ptr + rows, mask=readable, other=0) // TOPK
    live = _live(seg_start_ptr, seg_count_ptr, expert, rows, readable)
    x_off = _activation_offsets(token, H, warp_cols, X, WARPS, BK)
    x_mask = live[None, None, :]
    acc_g = gl.zeros([WARPS, ROWS, TILE], gl.float32, ACC)
    acc_u = gl.zeros([WARPS, ROWS, TILE], gl.float32, ACC)
    steps = k_per_warp // BK
    if STAGES > 0:
        # code words go through shared memory, STAGES - 1 steps ahead (cp.async: no registers
        # held while in flight); the scale bytes one step ahead in registers
        gate, up = _stages(gate_off, STAGES), _stages(up_off, STAGES)
        for step in gl.static_range(STAGES - 1):
            _copy_step(gate, w_base, gate_off, step, steps, STAGES, BK)
            _copy_step(up, w_base, up_off, step, steps, STAGES, BK)
            async_copy.commit_group()
        gs, us = gl.load(s_base + gate_soff), gl.load(s_base + up_soff)
        for i in range(steps):
            _copy_step(gate, w_base, gate_off, i + STAGES - 1, steps, STAGES, BK)
            _copy_step(up, w_base, up_off, i + STAGES - 1, steps, STAGES, BK)
            async_copy.commit_group()
            xb = gl.load(x_ptr + x_off, mask=x_mask, other=0.0)
            s_base += BK // 32
            more = i + 1 < steps
            ngs = gl.load(s_base + gate_soff, mask=(gate_soff >= 0) & more, other=0)
            nus = gl.load(s_base + up_soff, mask=(up_soff >= 0) & more, other=0)
            async_copy.wait_group(STAGES - 1)  # step i's copies are done
            gw, uw = gate.index(i % STAGES).load(WORDS), up.index(i % STAGES).load(WORDS)
            acc_g = _mma_step(gw, gs, xb, acc_g, WORDS, A, B, WARPS, BK)
            acc_u = _mma_step(uw, us, xb, acc_u, WORDS, A, B, WARPS, BK)
            gs, us = ngs, nus
            x_ptr += BK
    elif PREFETCH:
        # step i + 1's weights are loaded before step i's MMAs: two steps in flight per warp
        gw, gs = gl.load(w_base + gate_off), gl.load(s_base + gate_soff)
        uw, us = gl.load(w_base + up_off), gl.load(s_base + up_soff)
        for _ in range(1 - steps % 2):  # an even count: one step here, the rest in pairs below
            w_base += BK // 8
            s_base += BK // 32
            gw, gs, uw, us, acc_g, acc_u = _fc1_step(
                x_ptr + x_off, x_mask, w_base, s_base, gate_off, gate_soff, up_off, up_soff,
                gw, gs, uw, us, acc_g, acc_u, WORDS, A, B, WARPS, BK,
            )  # fmt: skip
            x_ptr += BK
        for _ in range((steps - 1) // 2):  # pairs: the second step loads into the first's registers
            w_base += BK // 8
            s_base += BK // 32
            hgw, hgs, huw, hus, acc_g, acc_u = _fc1_step(
                x_ptr + x_off, x_mask, w_base, s_base, gate_off, gate_soff, up_off, up_soff,
                gw, gs, uw, us, acc_g, acc_u, WORDS, A, B, WARPS, BK,
            )  # fmt: skip
            x_ptr += BK
            w_base += BK // 8
            s_base += BK // 32
            gw, gs, uw, us, acc_g, acc_u = _fc1_step(
                x_ptr + x_off, x_mask, w_base, s_base, gate_off, gate_soff, up_off, up_soff,
                hgw, hgs, huw, hus, acc_g, acc_u, WORDS, A, B, WARPS, BK,
            )  # fmt: skip
            x_ptr += BK
        xb = gl.load(x_ptr + x_off, mask=x_mask, other=0.0)
        acc_g = _mma_step(gw, gs, xb, acc_g, WORDS, A, B, WARPS, BK)
        acc_u = _mma_step(uw, us, xb, acc_u, WORDS, A, B, WARPS, BK)
    else:
        for _ in range(steps):
            # weights first: their addresses are known before the activations' (one load chain less)
            gw, gs = gl.load(w_base + gate_off), gl.load(s_base + gate_soff)
            uw, us = gl.load(w_base + up_off), gl.load(s_base + up_soff)
            xb = gl.load(x_ptr + x_off, mask=x_mask, other=0.0)
            acc_g = _mma_step(gw, gs, xb, acc_g, WORDS, A, B, WARPS, BK)
            acc_u = _mma_step(uw, us, xb, acc_u, WORDS, A, B, WARPS, BK)
            w_base += BK // 8
            s_base += BK // 32
            x_ptr += BK
    # Undo the 2**-7 of the dequantization; epilogue as triton_kernels.
    gate = _epilogue_index(acc_g, SPLIT_K)
    up = _epilogue_index(acc_u, SPLIT_K)
    n, out_rows, out_mask = _epilogue_rows(gate, n0, rows, live)
    route = gl.load(sorted_route_ptr + out_rows, mask=out_mask, other=0)
    is_a4 = _route_is_a4(flag_ptr, route, out_mask, TOPK, MODE)
    gate = gate * _alpha(gl.load(w_scale2_ptr + expert * 2), gs1_ptr, is_a4, MODE)
    up = up * _alpha(gl.load(w_scale2_ptr + expert * 2 + 1), gs1_ptr, is_a4, MODE)
    h = swiglu(gate, up, limit, HAS_LIMIT, gl.bfloat16)
    if MODE != W4A16_MODE:
        h = _requantize(h, gs2_ptr + expert, is_a4, MODE)
    # FC2 reads this in permuted K order: physical column n goes to its logical slot, which is
    # held by column 32 b + 8 c + 4 h + 2 q + p of slot 32 b + 16 q + 4 c + 2 h + p.
    q = n % 8
    slot = 16 * (2 * ((n // 8) % 4) + (q // 2) % 2) + 4 * ((n // 32) % 4) + 2 * (q % 2) + q // 4
    column = (
        slot - slot % 32 + 8 * ((slot // 4) % 4) + 4 * ((slot // 2) % 2) + 2 * ((slot // 16) % 2) + slot % 2
    )
    column = (n // 128) * 128 + column
    gl.store(out_ptr + out_rows * INTER + column, h, mask=out_mask & (n < INTER))


@gluon.jit(do_not_specialize=["ROUTES"])
def fc2_decode_kernel(
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
    ROUTES,
    MODE: gl.constexpr,
    PREFETCH: gl.constexpr,
    STAGES: gl.constexpr,
    OVERLAP: gl.constexpr,
    WARPS: gl.constexpr,
    BK: gl.constexpr,
    SPLIT_K: gl.constexpr,
    ROWS: gl.constexpr,
    TILE: gl.constexpr,
):
    """FC2 of up to ``TILE`` routes x ``M * W'`` outputs: ``y[route(p), n] = io(acc * alpha2)``.

    ``h [R, I]`` bf16 in permuted K order (sorted positions), ``w [E, H, I/8]`` int32, ``ws
    [E, H, I/32]`` uint16 (scale byte pairs), ``w_scale2 [E]`` fp32, ``y [R, H]`` bf16 (one row per route),
    ``ROUTES = R``. ``MODE``, ``gs2 [E]`` and ``flag [T]`` as in :func:`fc1_decode_kernel`
    (alpha2 of an A4 route: ``w_scale2[e] / gs2[e]``). ``SPLIT_K``, ``PREFETCH`` and the routes
    read as there, with K = ``I``; grid ``(max_tiles, H / (M W'))``; ``BK % 128 == 0``.
    ``OVERLAP`` (launched as FC1's programmatic dependent, sm_90+): a CTA may start while FC1
    still runs, so it first asks L2 for all of its code words (lines in layout ``L2``), then
    waits for FC1 (:data:`WAIT_FOR_PREREQUISITES_ASM`) before it reads ``h`` or writes ``y``.
    """
    WORDS: gl.constexpr = words_layout(WARPS, BK, ROWS)
    SCALES: gl.constexpr = scale_layout(WARPS, BK, ROWS)
    ACC: gl.constexpr = mma_layout(WARPS)
    A: gl.constexpr = operand_layout(0, WARPS)
    B: gl.constexpr = operand_layout(1, WARPS)
    X: gl.constexpr = activation_layout(WARPS, BK, TILE)
    expert, rows, readable, idle = _tile(tile_expert_ptr, tile_row_ptr, num_tiles_ptr, ROUTES, TILE, X)
    if idle:
        return
    k_per_warp, n0, warp_rows, warp_cols = _warp_split(INTER, ROWS, WARPS, BK, SPLIT_K)
    row_words = gl.multiple_of(INTER // 8, 16)  # INTER % 128 == 0
    w_off, s_off = _weight_offsets(n0, row_words, warp_rows, warp_cols // 8, WORDS, SCALES)
    expert_rows = expert.to(gl.int64) * H
    w_base = w_ptr + expert_rows * row_words
    s_base = ws_ptr + expert_rows * (row_words // 4)
    h_off = _activation_offsets(rows, INTER, warp_cols, X, WARPS, BK)
    live = _live(seg_start_ptr, seg_count_ptr, expert, rows, readable)
    h_mask = live[None, None, :]
    acc = gl.zeros([WARPS, ROWS, TILE], gl.float32, ACC)
    steps = k_per_warp // BK
    if OVERLAP:
        L2: gl.constexpr = l2_prefetch_layout(WARPS, BK, ROWS)
        lines = _row_offsets(n0, row_words, warp_rows, warp_cols // 8, 32, L2)
        _l2_prefetch_rows(w_base, lines, steps, BK)
        _grid_dependency(WAIT_FOR_PREREQUISITES_ASM)
    if STAGES > 0:  # as in fc1_decode_kernel
        codes = _stages(w_off, STAGES)
        for step in gl.static_range(STAGES - 1):
            _copy_step(codes, w_base, w_off, step, steps, STAGES, BK)
            async_copy.commit_group()
        ws = gl.load(s_base + s_off)
        for i in range(steps):
            _copy_step(codes, w_base, w_off, i + STAGES - 1, steps, STAGES, BK)
            async_copy.commit_group()
            hb = gl.load(h_ptr + h_off, mask=h_mask, other=0.0)
            s_base += BK // 32
            nws = gl.load(s_base + s_off, mask=(s_off >= 0) & (i + 1 < steps), other=0)
            async_copy.wait_group(STAGES - 1)
            acc = _mma_step(codes.index(i % STAGES).load(WORDS), ws, hb, acc, WORDS, A, B, WARPS, BK)
            ws = nws
            h_ptr += BK
    elif PREFETCH:  # as in fc1_decode_kernel
        ww, ws = gl.load(w_base + w_off), gl.load(s_base + s_off)
        for _ in range(1 - steps % 2):
            w_base += BK // 8
            s_base += BK // 32
            ww, ws, acc = _fc2_step(
                h_ptr + h_off, h_mask, w_base, s_base, w_off, s_off, ww, ws, acc, WORDS, A, B, WARPS, BK
            )
            h_ptr += BK
        for _ in range((steps - 1) // 2):
            w_base += BK // 8
            s_base += BK // 32
            hww, hws, acc = _fc2_step(
                h_ptr + h_off, h_mask, w_base, s_base, w_off, s_off, ww, ws, acc, WORDS, A, B, WARPS, BK
            )
            h_ptr += BK
            w_base += BK // 8
            s_base += BK // 32
            ww, ws, acc = _fc2_step(
                h_ptr + h_off, h_mask, w_base, s_base, w_off, s_off, hww, hws, acc, WORDS, A, B, WARPS, BK
            )
            h_ptr += BK
        hb = gl.load(h_ptr + h_off, mask=h_mask, other=0.0)
        acc = _mma_step(ww, ws, hb, acc, WORDS, A, B, WARPS, BK)
    else:
        for _ in range(steps):
            ww, ws = gl.load(w_base + w_off), gl.load(s_base + s_off)
            hb = gl.load(h_ptr + h_off, mask=h_mask, other=0.0)
            acc = _mma_step(ww, ws, hb, acc, WORDS, A, B, WARPS, BK)
            w_base += BK // 8
            s_base += BK // 32
            h_ptr += BK
    y = _epilogue_index(acc, SPLIT_K)
    n, out_rows, out_mask = _epilogue_rows(y, n0, rows, live)
    route = gl.load(sorted_route_ptr + out_rows, mask=out_mask, other=0)
    is_a4 = _route_is_a4(flag_ptr, route, out_mask, TOPK, MODE)
    y = y * _alpha(gl.load(w_scale2_ptr + expert), gs2_ptr + expert, is_a4, MODE)
    gl.store(y_ptr + route * H + n, y.to(gl.bfloat16), mask=out_mask & (n < H))


@triton.jit
def permute_k_kernel(x_ptr, out_ptr, H, BH: tl.constexpr):
    """``out[t, 128 b + m] = x[t, 128 b + logical_to_physical(column_to_logical(m))]`` (``x``,
    ``out`` ``[T, H]``, ``H % 128 == 0``); grid ``(T, cdiv(H, BH))``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    column = cols % 128
    slot = column - column % 32 + 16 * ((column // 2) % 2) + 4 * ((column // 8) % 4) + 2 * ((column // 4) % 2)
    slot += column % 2
    p = slot % 4
    c = (slot // 4) % 4
    sigma = slot // 16
    physical = (cols - column) + 32 * c + 8 * (sigma // 2) + 4 * (p % 2) + p // 2 + 2 * (sigma % 2)
    mask = cols < H
    tl.store(out_ptr + t * H + cols, tl.load(x_ptr + t * H + physical, mask=mask), mask=mask)


@gluon.constexpr_function
def scale_layout(warps: int, block_k: int, rows: int) -> gl.DistributedLinearLayout:
    """Layout of one step's scale byte pairs ``[warps, rows, block_k / 32]`` (uint16: the bytes of
    scale groups ``2 i`` and ``2 i + 1``): thread ``(r, c)`` holds the pair of its code bytes ``16
    c .. 16 c + 15`` (one per 128-column step) of rows ``r + 8 i``, as in
    :func:`words_layout`."""
    pairs = block_k // 32
    regs = [[0, 8, 0], *_bases(2, 4, pairs), *_bases(1, 16, rows)]
    lanes = [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=lanes,
        warp_bases=_bases(0, 1, warps),
        block_bases=[],
        shape=[warps, rows, pairs],
    )


@gluon.constexpr_function
def l2_prefetch_layout(warps: int, block_k: int, rows: int) -> gl.DistributedLinearLayout:
    """Layout of one step's L2 prefetch addresses ``[warps, rows, lines]``: the first code word
    of each 128-byte line (``lines = max(1, block_k / 256)``) of a warp's rows in one K step (a
    128-column step is half a line). The lanes hold distinct lines while there are as many
    lines as lanes, else two lanes ask for the same line."""
    lines = max(1, block_k // 256)
    bases = [*_bases(2, 1, lines), *_bases(1, 1, rows)]
    return gl.DistributedLinearLayout(
        reg_bases=bases[5:],
        lane_bases=(bases + [[0, 0, 0]] * 5)[:5],
        warp_bases=_bases(0, 1, warps),
        block_bases=[],
        shape=[warps, rows, lines],
    )


@gluon.constexpr_function
def activation_layout(warps: int, block_k: int, routes: int) -> gl.DistributedLinearLayout:
    """Layout of one step's activations ``[warps, block_k, routes]`` as loaded: thread ``(n, c)``
    (``n = lane / 4``, ``c = lane % 4``) holds the 8 consecutive columns ``32 b + 8 c ..`` (one
    128-bit load) of route ``n + 8 i`` for each 32-column group ``b``; axis 0 is the warp.
    :func:`_b_operand` relabels it into the B operand of :func:`words_layout`."""
    regs = [[0, 1, 0], [0, 2, 0], [0, 4, 0], *_bases(1, 32, block_k), *_bases(2, 8, routes)]
    lanes = [[0, 8, 0], [0, 16, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=lanes,
        warp_bases=_bases(0, 1, warps),
        block_bases=[],
        shape=[warps, block_k, routes],
    )
