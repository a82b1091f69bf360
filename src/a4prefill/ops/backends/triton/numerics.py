"""Triton JIT building blocks of the ``triton`` backend's kernels (imported lazily: needs triton):
the kernels' ``MODE`` constexprs, e4m3 and e2m1 rounding, per-16 quantization
(:func:`_quantize_groups`), weight dequantization in Triton ops or inline PTX
(:func:`_dequant_tile`, :func:`_dequant_tile_ptx`) and SwiGLU (:func:`swiglu`). Used by
:mod:`shared_kernels` and :mod:`tiled_kernels`; the Gluon :mod:`decode_kernels` and
:mod:`prefill_kernels` use the quantization and SwiGLU.

Numerics (docs/numerics.md, sections 2 and 4; reference: :mod:`a4prefill.ops.reference`):

- NVFP4 weights are dequantized in registers to ``e2m1 * block_scale`` in the io dtype (exact),
  the MMA is ``tl.dot`` with fp32 accumulation, global scales are applied in the epilogue;
- e2m1 and e4m3 are decoded with bit tricks through fp16 (no fp8 dtype, no table): a code ``c``
  placed as fp16 bits ``(c & 7) << 9 | (c & 8) << 12`` is ``e2m1 * 2**-14``; an e4m3 byte ``b``
  placed as ``(b & 0x7f) << 7 | (b & 0x80) << 8`` is ``e4m3 * 2**-8``; their fp32 product times
  ``2**22`` is exact. With bf16 io the ``PTX`` variant does this in inline PTX with bf16x2 math
  (about 2 instructions per weight instead of about 10; see :func:`_dequant_tile_ptx`);
- activations are quantized with the operation order of :func:`a4prefill.ops.nvfp4.quantize_codes`
  (IEEE divisions via ``div_rn``, e4m3 round-to-nearest-even by bit manipulation), so codes and
  block scales are bit-exact with it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from a4prefill.ops import precision

# Row precision modes of the GEMM kernels.
# The kernels' MODE (a4prefill.ops.precision): every row W4A16, every row A4, or per token (a
# flag per token: 1 = A4, 0 = W4A16)
W4A16_MODE: tl.constexpr = tl.constexpr(precision.MODE_W4A16)
A4_MODE: tl.constexpr = tl.constexpr(precision.MODE_A4)
SPLIT_MODE: tl.constexpr = tl.constexpr(precision.MODE_SPLIT)


# Four packed code bytes (``$4``) and the bf16 factors ``scale * 2**119`` of their elements in
# pairs (``$5``: bytes 0 and 1, ``$6``: bytes 2 and 3) -> ``$0, $1``: the low nibbles (even K
# columns), ``$2, $3``: the high nibbles (odd columns), each bf16 ``e2m1 * scale * 2**-7``, exact.
# A ``prmt`` spreads two bytes over a bf16 pair, a few logic ops move each nibble's sign and e2m1
# bits to the bf16 bits of ``e2m1 * 2**-126``, one ``fma.rn.bf16x2`` per pair multiplies by the
# factor (at most 5 significant bits). Launched with ``pack=4`` by :func:`_dequant_tile_ptx` and
# the prefill kernels.
BYTE_DEQUANT_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, m, s, zero, nz, e0, e1, o0, o1;
mov.b32 zero, 0;
mov.b32 nz, 0x80008000;
prmt.b32 t0, $4, zero, 0x1404;
prmt.b32 t1, $4, zero, 0x3424;
shr.b32 m, t0, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, t0, 4; and.b32 s, s, 0x80008000;
or.b32 e0, m, s;
shr.b32 m, t1, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, t1, 4; and.b32 s, s, 0x80008000;
or.b32 e1, m, s;
shr.b32 m, t0, 6; and.b32 m, m, 0x01C001C0; and.b32 s, t0, 0x80008000;
or.b32 o0, m, s;
shr.b32 m, t1, 6; and.b32 m, m, 0x01C001C0; and.b32 s, t1, 0x80008000;
or.b32 o1, m, s;
fma.rn.bf16x2 $0, e0, $5, nz;
fma.rn.bf16x2 $1, e1, $6, nz;
fma.rn.bf16x2 $2, o0, $5, nz;
fma.rn.bf16x2 $3, o1, $6, nz;
}
""")


def word_pair_dequant_lines(factor: str) -> str:
    """The PTX lines (no braces, no declarations) that turn one code word ``$4`` (nibbles ``n0``
    .. ``n7`` from bit 0) into four bf16x2 registers ``$0``..``$3`` holding the pairs ``(n0,
    n4)``, ``(n1, n5)``, ``(n2, n6)``, ``(n3, n7)`` (the first nibble in the low half), each bf16
    ``e2m1 * scale * 2**-7``, exact. Per pair: the two signs (bits ``4 j + 3`` and ``4 j + 19``)
    move to bf16 bits 15 and 31 and the two magnitudes (bits ``4 j`` .. ``4 j + 2`` and ``+ 16``)
    to bits 6-8 and 22-24 (``e2m1 * 2**-126``), one shift and one mask each, merged, then one
    ``fma.rn.bf16x2`` multiplies by the register ``factor`` (``scale * 2**119`` in both halves;
    the caller declares ``m``, ``s``, ``nz = 0x80008000`` and, if it names one, ``factor``): no
    ``prmt``. Every right shift is a ``shr`` (the ALU; ``mul.hi`` by a power of two, the same
    shift on the FMA pipe, was slower in the prefill GEMMs and in the decode kernels:
    benchmarks/results/README.md, forty-fifth and forty-sixth rounds). The pairs are those an
    A register of the prefill wgmma holds when the step's columns are in
    ``prefill.mma_column_order``, and those of the decode kernels' code words
    (``decode_asm.CODES_ASM``)."""
    magnitudes = ("shl.b32 m, $4, 6;", "shl.b32 m, $4, 2;", "shr.b32 m, $4, 2;", "shr.b32 m, $4, 6;")
    lines = []
    for pair, (sign_shift, magnitude) in enumerate(zip((12, 8, 4, 0), magnitudes, strict=True)):
        shifted = f"shl.b32 s, $4, {sign_shift}; and.b32 s, s," if sign_shift else "and.b32 s, $4,"
        sign = f"{shifted} 0x80008000;"
        lines.append(
            f"{sign}\n{magnitude} and.b32 m, m, 0x01C001C0; or.b32 s, s, m;\n"
            f"fma.rn.bf16x2 ${pair}, s, {factor}, nz;\n"
        )
    return "".join(lines)


# One code word (``$4``) and its group's bf16 factor ``scale * 2**119`` (``$5``: in both halves;
# ``$6`` not read) -> ``$0``..``$3``: :func:`word_pair_dequant_lines`'s pairs, with every right
# shift on the ALU (``shr``; as ``mul.hi`` on the FMA pipe the prefill GEMMs were slower at 4096
# tokens on an H100: benchmarks/results/README.md, forty-fifth round). What the prefill
# consumers' ``prefill_kernels._dequant_fragment`` launches.
WORD_PAIR_DEQUANT_ASM = tl.constexpr(
    "\n{\n.reg .b32 m, s, nz;\nmov.b32 nz, 0x80008000;\n" + word_pair_dequant_lines("$5") + "}\n"
)


def _scale_factors_asm(pack_bytes: str, write_results: str) -> str:
    """The inline PTX that turns two e4m3 scale bytes into their bf16 factors ``scale * 2**119``
    (exact, subnormal scales included; ``0x7f``/``0xff`` -> +-480 like :func:`e4m3_bytes_f32`),
    both bytes at once in one bf16x2 register ``w``. ``pack_bytes`` must leave the first byte in
    bits 15..8 of ``w`` and the second in bits 31..24 (the other bits are not read);
    ``write_results`` moves ``w`` into the outputs. Then a byte's sign is bf16 bit 15 of its
    half and its other bits go to bits 10..4: that bf16 is exactly ``e4m3 * 2**-120``; two bf16x2
    products by 2**120 and 2**119 follow. ``tests/helpers/ptx_subset.py`` runs both forms
    (``tests/test_triton_decode_ptx.py``)."""
    return (
        "{\n.reg .b32 w, m, c120, c119, nz;\nmov.b32 c120, 0x7B807B80;\nmov.b32 c119, 0x7B007B00;\n"
        "mov.b32 nz, 0x80008000;\n"
        + pack_bytes
        + "shr.b32 m, w, 4;\nand.b32 m, m, 0x07F007F0;\nand.b32 w, w, 0x80008000;\nor.b32 w, w, m;\n"
        "fma.rn.bf16x2 w, w, c120, nz;\nfma.rn.bf16x2 w, w, c119, nz;\n" + write_results + "}\n"
    )


# ``$2``: two e4m3 scale bytes as a zero-extended uint16 (byte 0 in bits 7..0) -> ``$0``, ``$1``:
# the bf16 factors of byte 0 and byte 1 (the decode kernels' scale pairs, ``decode_asm._factors``).
SCALE_PAIR_FACTORS_ASM = tl.constexpr(
    _scale_factors_asm("prmt.b32 w, $2, $2, 0x1202;\n", "mov.b32 {$0, $1}, w;\n")
)

# ``$1``, ``$2``: one e4m3 scale byte each, in bits 7..0 (bits 31..8 not read: zero or sign
# extension alike) -> ``$0``: their bf16 factors as one bf16x2 (``$1``'s in the low half). Launched
# with ``pack=2`` over int32 scale bytes by the prefill kernels (``prefill_kernels.scale_factors``).
SCALE_BYTES_FACTORS_ASM = tl.constexpr(
    _scale_factors_asm("prmt.b32 w, $1, $2, 0x4000;\n", "mov.b32 $0, w;\n")
)


@triton.jit
def _rne_e4m3(s):
    """Round fp32 ``s`` in [0, 448] to the nearest e4m3 value (ties to even), as fp32."""
    bits = s.to(tl.int32, bitcast=True)
    # Normal range: keep 3 mantissa bits, round to nearest even.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal range (< 2**-6): multiples of 2**-9; the fp32 ulp at 2**14 is 2**-9.
    big = s + 16384.0
    subnormal = big - 16384.0
    return tl.where(s < 0.015625, subnormal, normal)


@triton.jit
def _e2m1_round(m):
    """e2m1 magnitude (fp32) and code (int32, 0..7) of ``m`` in [0, 6], ties to the even code.

    The magnitude by one rounding addition: ``(m + c) - c`` with ``c`` 2**22, 2**23 or 2**24 where
    e2m1's step is 0.5 (``m`` < 2), 1 (< 4) or 2 (up to 6): fp32's spacing at ``c`` is that step,
    so the addition rounds ``m`` to the nearest multiple of it, ties to the even multiple, which
    is the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); the
    subtraction is exact. ``c`` is ``max(m, 1)``'s power of two (its exponent bits alone) times
    2**22. The code from the magnitude: ``2 m`` below 1, else the fp32 exponent and top mantissa
    bit (1.0 -> 2, ..., 6.0 -> 7)."""
    c = (tl.maximum(m, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True) * 4194304.0
    magnitude = (m + c) - c
    top_bits = magnitude.to(tl.int32, bitcast=True) >> 22
    code = tl.where(magnitude < 1.0, (magnitude * 2.0).to(tl.int32), top_bits - 252)
    return magnitude, code


@triton.jit
def _quantize_groups(v, gs, inv_gs, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Quantize fp32 ``v [ROWS, COLS]`` per 16 columns with encode scale ``gs`` (scalar or [ROWS, 1]).

    Returns the dequantized blocks ``e2m1 * block_scale`` (fp32 [ROWS, COLS], no global scale),
    the signed codes (int32 [ROWS, COLS], 0..15) and the block scales (fp32 [ROWS, COLS // 16]).
    Bit-exact with :func:`a4prefill.ops.nvfp4.quantize_codes` for finite ``v`` and an encode
    scale whose reciprocal and the multipliers ``1 / (block_scale / gs)`` are finite (``gs``
    roughly within 2**-100 to 2**100: ModelOpt encode scales are ``448 * 6 / amax``). Outside
    that a multiplier may overflow to inf, ``0 * inf`` is NaN and such a block's values are not
    the reference's (nor were they with this function's earlier form)."""
    g = tl.reshape(v, [ROWS, COLS // 16, 16])
    amax = tl.max(tl.abs(g), axis=2)
    scale = _rne_e4m3(tl.minimum(gs * (amax * 0.16666666666666666), 448.0))
    denom = scale * inv_gs
    # ones shaped like denom (denom is finite), built from it: Gluon callers (decode_kernels) cannot
    # make a tensor without a layout
    multiplier = tl.where(denom == 0.0, 0.0, tl.math.div_rn(denom * 0.0 + 1.0, denom))
    scaled = g * multiplier[:, :, None]
    # |clamp(scaled, -6, 6)|; the sign is scaled's
    magnitude, code = _e2m1_round(tl.minimum(tl.abs(scaled), 6.0))
    sign = scaled.to(tl.int32, bitcast=True) & -2147483648
    negative = (sign != 0) & (magnitude > 0.0)
    code = code | tl.where(negative, 8, 0)
    # the magnitude with scaled's sign, times the scale; + 0.0 turns the -0.0 of a negative value
    # that rounds to 0 into the reference's +0.0 and changes nothing else
    signed = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    value = signed * scale[:, :, None] + 0.0
    return tl.reshape(value, [ROWS, COLS]), tl.reshape(code, [ROWS, COLS]), scale


@triton.jit
def _dequant_tile(w_ptrs, s_ptrs, mask_n, BN: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr):
    """Load packed e2m1 ``[BN, BK/2]`` and e4m3 scales ``[BN, BK/16]``; return ``[BN, BK]`` in DTYPE."""
    packed = tl.load(w_ptrs, mask=mask_n[:, None], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BN, BK])
    values = (((codes & 7) << 9) | ((codes & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
    scales = _scales_f32(s_ptrs, mask_n)
    w = tl.reshape(values.to(tl.float32), [BN, BK // 16, 16]) * (scales * 16384.0)[:, :, None]
    return tl.reshape(w, [BN, BK]).to(DTYPE)


@triton.jit
def _scales_f32(s_ptrs, mask_n):
    """Load e4m3 block-scale bytes ``[BN, G]`` and decode them to fp32 (exact)."""
    return e4m3_bytes_f32(tl.load(s_ptrs, mask=mask_n[:, None], other=0))


@triton.jit
def e4m3_bytes_f32(scale_bytes):
    """e4m3 bytes (uint8, any shape) -> fp32 values, exact (``0x7f``/``0xff`` -> +-480, not NaN)."""
    sbyte = scale_bytes.to(tl.int32)
    sbits = ((sbyte & 0x7F) << 7) | ((sbyte & 0x80) << 8)
    return sbits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _dequant_tile_ptx(w_ptrs, s_ptrs, mask_n, BN: tl.constexpr, BK: tl.constexpr):
    """Like :func:`_dequant_tile` for bf16, in inline PTX (sm_80+), returning ``w * 2**-7``.

    Four packed bytes per PTX block: a ``prmt`` spreads two bytes over a bf16 pair, a few logic
    ops move each nibble's sign and e2m1 bits to the bf16 bits of ``e2m1 * 2**-126``, and one
    ``fma.rn.bf16x2`` per pair multiplies by ``bf16(scale * 2**119)`` (exact: at most 5
    significant bits). The even (low nibble) and odd K columns are joined back into K order.
    """
    groups: tl.constexpr = BK // 16
    packed = tl.load(w_ptrs, mask=mask_n[:, None], other=0)
    factor = (_scales_f32(s_ptrs, mask_n) * 6.646139978924579e35).to(tl.bfloat16)
    codes = tl.reshape(packed, [BN, groups, 8])
    scale = tl.broadcast_to(factor[:, :, None], [BN, groups, 8])
    even, odd = tl.inline_asm_elementwise(
        BYTE_DEQUANT_ASM,
        "=r,=r,=r,=r,r,r,r",
        [codes, scale],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )
    even = tl.reshape(even, [BN, BK // 2])
    odd = tl.reshape(odd, [BN, BK // 2])
    return tl.reshape(tl.join(even, odd), [BN, BK])


@triton.jit
def _unscale(acc, PTX: tl.constexpr):
    """Undo the ``2**-7`` that the PTX dequantization folds into the weights."""
    if PTX:
        acc = acc * 128.0
    return acc


@triton.jit
def swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr, dtype: tl.constexpr, IEEE_DIV: tl.constexpr = True):
    """``io(io(silu(gate)) * up)`` of fp32 ``gate``/``up`` (global scales applied), each first
    rounded to the io ``dtype``, clamped when ``HAS_LIMIT`` (gate <= limit, |up| <= limit): the
    FC1 epilogue math of :mod:`a4prefill.ops.reference`, shared with :mod:`decode_kernels` and
    :mod:`prefill_kernels`. silu's division is IEEE-rounded (``div.rn``, as torch's), or with
    ``IEEE_DIV=False`` approximate (``div.full.f32``, within 2 fp32 ulps before the io rounding:
    the prefill kernels, where the IEEE division's slow path cost up to 30% of FC1 on an H200)."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    denominator = 1.0 + tl.exp(-gate)
    silu = tl.math.div_rn(gate, denominator) if IEEE_DIV else tl.math.fdiv(gate, denominator)
    return (silu.to(dtype).to(tl.float32) * up).to(dtype)
