"""Triton kernels of the ``triton`` MoE backend (imported lazily: needs triton).

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

Routing layout shared by the kernels (built by :mod:`a4prefill.ops.backends.triton_moe`):
routes ``r = t * top_k + j`` are sorted by expert into ``sorted_route [R]``; expert ``e`` owns
sorted positions ``[seg_start[e], seg_start[e] + seg_count[e])``; GEMM tile ``i < num_tiles[0]``
covers ``BLOCK_M`` sorted positions from ``tile_row[i]`` of expert ``tile_expert[i]``.
Routes with an expert id outside ``[0, E)`` sit in no tile and are ignored.
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
def _e2m1_round(scaled):
    """e2m1 magnitude (fp32) and code (int32, 0..7) of ``|scaled|`` <= 6, ties to even code."""
    m = tl.abs(scaled)
    code = (
        (m > 0.25).to(tl.int32)
        + (m >= 0.75).to(tl.int32)
        + (m > 1.25).to(tl.int32)
        + (m >= 1.75).to(tl.int32)
        + (m > 2.5).to(tl.int32)
        + (m >= 3.5).to(tl.int32)
        + (m > 5.0).to(tl.int32)
    )
    value = tl.where(
        code < 4,
        code.to(tl.float32) * 0.5,
        tl.where(code == 4, 2.0, tl.where(code == 5, 3.0, tl.where(code == 6, 4.0, 6.0))),
    )
    return value, code


@triton.jit
def _quantize_groups(v, gs, inv_gs, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Quantize fp32 ``v [ROWS, COLS]`` per 16 columns with encode scale ``gs`` (scalar or [ROWS, 1]).

    Returns the dequantized blocks ``e2m1 * block_scale`` (fp32 [ROWS, COLS], no global scale),
    the signed codes (int32 [ROWS, COLS], 0..15) and the block scales (fp32 [ROWS, COLS // 16]).
    """
    g = tl.reshape(v, [ROWS, COLS // 16, 16])
    amax = tl.max(tl.abs(g), axis=2)
    scale = _rne_e4m3(tl.minimum(gs * (amax * 0.16666666666666666), 448.0))
    denom = scale * inv_gs
    # ones shaped like denom (denom is finite), built from it: Gluon callers (triton_decode) cannot
    # make a tensor without a layout
    multiplier = tl.where(denom == 0.0, 0.0, tl.math.div_rn(denom * 0.0 + 1.0, denom))
    scaled = g * multiplier[:, :, None]
    scaled = tl.minimum(tl.maximum(scaled, -6.0), 6.0)
    magnitude, code = _e2m1_round(scaled)
    negative = (scaled < 0.0) & (code > 0)
    code = code | tl.where(negative, 8, 0)
    value = tl.where(negative, -magnitude, magnitude) * scale[:, :, None]
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
    sbyte = tl.load(s_ptrs, mask=mask_n[:, None], other=0).to(tl.int32)
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
        """
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
        """,
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


@triton.jit(do_not_specialize=["T"])  # one compile for every token count
def quantize_rows_kernel(
    x_ptr,
    out_ptr,
    codes_ptr,
    scales_ptr,
    flag_ptr,
    gs_ptr,
    T,
    H,
    MODE: tl.constexpr,
    WRITE_CODES: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
):
    """FC1 input of the A4 path: ``out [T, H] = e2m1 * block_scale`` of ``x [T, H]`` quantized
    with the shared ``gs_ptr[0]`` (rows whose flag is 0 in ``SPLIT_MODE`` are copied unchanged).
    With WRITE_CODES also packed codes uint8 [T, H/2] and e4m3 scale bytes uint8 [T, H/16]."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rmask = rows < T
    mask = rmask[:, None] & (cols[None, :] < H)
    x = tl.load(x_ptr + rows[:, None] * H + cols[None, :], mask=mask, other=0.0)
    gs = tl.load(gs_ptr)
    inv_gs = tl.math.div_rn(gs * 0.0 + 1.0, gs)
    value, code, scale = _quantize_groups(x.to(tl.float32), gs, inv_gs, BT, BH)
    result = value.to(x.dtype)
    if MODE == SPLIT_MODE:
        flag = tl.load(flag_ptr + rows, mask=rmask, other=0)
        result = tl.where(flag[:, None] != 0, result, x)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], result, mask=mask)
    if WRITE_CODES:
        pairs = tl.reshape(code, [BT, BH // 2, 2])
        low, high = tl.split(pairs)
        packed = (low | (high << 4)).to(tl.uint8)
        pcols = tl.program_id(1) * (BH // 2) + tl.arange(0, BH // 2)
        pmask = rmask[:, None] & (pcols[None, :] < H // 2)
        tl.store(codes_ptr + rows[:, None] * (H // 2) + pcols[None, :], packed, mask=pmask)
        sbits = scale.to(tl.int32, bitcast=True)
        # fp32 -> e4m3 bits for values that are exactly e4m3 (>= 0).
        exp = (sbits >> 23) & 0xFF
        normal_byte = ((exp - 120) << 3) | ((sbits >> 20) & 7)
        sub_byte = (scale * 512.0).to(tl.int32)
        byte = tl.where(exp >= 121, normal_byte, sub_byte).to(tl.uint8)
        scols = tl.program_id(1) * (BH // 16) + tl.arange(0, BH // 16)
        smask = rmask[:, None] & (scols[None, :] < H // 16)
        tl.store(scales_ptr + rows[:, None] * (H // 16) + scols[None, :], byte, mask=smask)


@triton.jit(do_not_specialize=["R"])  # one compile per R_BLOCK, whatever R
def route_prep_kernel(
    ids_ptr,
    sorted_route_ptr,
    seg_start_ptr,
    seg_count_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    num_tiles_ptr,
    R,
    E,
    BLOCK_M: tl.constexpr,
    R_BLOCK: tl.constexpr,
    E_BLOCK: tl.constexpr,
):
    """One program: sort ``R <= R_BLOCK`` routes by expert id and build the tile table.

    Ids outside [0, E) go to the sentinel bucket E (no tile). ``E_BLOCK > E`` (power of two).
    """
    r = tl.arange(0, R_BLOCK)
    ids = tl.load(ids_ptr + r, mask=r < R, other=E).to(tl.int32)
    key = tl.where((ids >= 0) & (ids < E), ids, E)
    hist = tl.histogram(key, E_BLOCK)
    hist = tl.where(tl.arange(0, E_BLOCK) < E, hist, 0)
    seg_start = tl.cumsum(hist, 0) - hist
    tiles = (hist + BLOCK_M - 1) // BLOCK_M
    tile_start = tl.cumsum(tiles, 0) - tiles
    e_index = tl.arange(0, E_BLOCK)
    tl.store(seg_start_ptr + e_index, seg_start, mask=e_index < E)
    tl.store(seg_count_ptr + e_index, hist, mask=e_index < E)
    tl.store(num_tiles_ptr, tl.sum(tiles, 0))
    ordered = tl.sort(key * R_BLOCK + r)
    expert = ordered // R_BLOCK
    route = ordered % R_BLOCK
    tl.store(sorted_route_ptr + r, route, mask=r < R)
    valid = expert < E
    safe_expert = tl.where(valid, expert, 0)
    local = r - tl.gather(seg_start, safe_expert, 0)
    tile = tl.gather(tile_start, safe_expert, 0) + local // BLOCK_M
    starts = valid & (local % BLOCK_M == 0)
    tl.store(tile_expert_ptr + tile, expert, mask=starts)
    tl.store(tile_row_ptr + tile, r, mask=starts)


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
def swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr, dtype: tl.constexpr):
    """``io(io(silu(gate)) * up)`` of fp32 ``gate``/``up`` (global scales applied), each first
    rounded to the io ``dtype``, clamped when ``HAS_LIMIT`` (gate <= limit, |up| <= limit): the
    FC1 epilogue math of :mod:`a4prefill.ops.reference`, shared with :mod:`triton_decode`."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    return (silu.to(dtype).to(tl.float32) * up).to(dtype)


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


@triton.jit
def combine_kernel(
    y_ptr,
    topk_w_ptr,
    topk_ids_ptr,
    out_ptr,
    w_scale2_ptr,
    gs2_ptr,
    flag_ptr,
    H,
    E,
    TOPK,
    FROM_ACC: tl.constexpr,
    MODE: tl.constexpr,
    PTX: tl.constexpr,
    BH: tl.constexpr,
):
    """``out[t] = io(sum_j fp32(topk_w[t, j]) * fp32(y[t * TOPK + j]))`` over valid ids only.

    ``FROM_ACC``: ``y`` holds FC2 split-K fp32 sums; ``y = io(acc * alpha2[e])`` is formed here.
    """
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    cmask = cols < H
    acc = tl.zeros([BH], dtype=tl.float32)
    dtype = out_ptr.dtype.element_ty
    for j in range(TOPK):
        expert = tl.load(topk_ids_ptr + t * TOPK + j)
        weight = tl.load(topk_w_ptr + t * TOPK + j).to(tl.float32)
        expert_vec = tl.zeros([BH], dtype=tl.int32) + expert
        valid = (expert_vec >= 0) & (expert_vec < E)
        y = tl.load(y_ptr + (t * TOPK + j) * H + cols, mask=cmask & valid, other=0.0)
        if FROM_ACC:
            safe = tl.where((expert >= 0) & (expert < E), expert, 0)
            alpha = tl.load(w_scale2_ptr + safe)
            y = _unscale(y, PTX)
            if MODE != W4A16_MODE:
                alpha_a4 = tl.math.div_rn(alpha, tl.load(gs2_ptr + safe))
                if MODE == A4_MODE:  # noqa: SIM108 (constexpr branch)
                    alpha = alpha_a4
                else:
                    alpha = tl.where(tl.load(flag_ptr + t) != 0, alpha_a4, alpha)
            y = (y * alpha).to(dtype)
        acc += weight * y.to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(dtype), mask=cmask)
