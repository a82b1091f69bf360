"""Decode kernels of the ``triton`` backend: grouped GEMMs for few rows per expert (Gluon), for
W4A16, A4 and split (per-token precision) calls.

Imported lazily (needs ``triton.experimental.gluon``, Triton 3.6+, and a CUDA GPU of sm_80+).
Launched by :func:`a4prefill.ops.backends.triton.fused.fused_moe`: its default for calls with
bf16 io and few routes per active expert (decode sizes), and any call whose
``GemmConfig.decode`` is set explicitly (the tests, the benchmark's sweep). The math is the one of
:mod:`tiled_kernels` (docs/numerics.md sections 2 and 4), the schedule is different:

- **Weights on the MMA's M side, routes on N.** One ``mma.sync.m16n8k16`` multiplies 16 weight
  rows by up to 8 routes of one expert. A decode step has one or two routes per expert, so no
  activation tile is padded to 16 rows, and the weights, not the activations, fill the MMA.
  A CTA's tile holds 8, 16 or 32 routes of one expert (``TILE``): each dequantized weight
  fragment then feeds ``TILE / 8`` MMAs, so an expert with more routes is read and dequantized
  once per tile rather than once per 8 routes.
- **Codes go from global memory straight into MMA registers.** Each thread loads 16
  consecutive code bytes (one 128-bit load) of two weight rows per 128-column step and turns
  them into bf16 in registers (:data:`decode_asm.CODES_ASM`; the scale bytes two at a time,
  :data:`numerics.SCALE_PAIR_FACTORS_ASM`): no layout conversion. The MMA operand layout
  (``k_width=4``) is reached by *relabelling K*: the thread's 32 physical columns become its
  logical K slots in the order of :func:`decode_layouts.logical_to_physical`. With ``STAGES``
  (``DecodeGemm.stages``) the same 16-byte chunks go through shared memory first: each thread
  ``cp.async``-copies its own chunks ``STAGES - 1`` K steps ahead and loads them back when their
  group is done, so the bytes in flight cost shared memory instead of registers; else
  ``PREFETCH`` keeps the next step's weights in registers, or nothing runs ahead.
- **The activations are permuted once to match** (:func:`permute_k_kernel`): column ``m`` of
  each 128-column block of the permuted activations is physical column
  ``logical_to_physical(column_to_logical(m))``. FC1 stores its output (FC2's input) directly
  in that order. :func:`decode_layouts.column_to_logical` makes each thread's 8 activations of a
  32-column group one 128-bit load that is already the B operand of its two MMAs (no register
  moves).
- **K or the rows are split over the warps of a CTA.** With a K split each warp streams its own
  K slice of the same 16 (or 32) weight rows (a batched MMA layout whose batch axis is the
  warp) and the fp32 partial sums are added across warps at the end: small token counts get
  many CTAs without atomics. With a row split each warp streams all of K for its own rows.

Numerics: FP4 weights are dequantized exactly to ``e2m1 * block_scale * 2**-7`` in bf16 (at
most 5 significant bits; the ``2**-7`` keeps the scale factor ``scale * 2**119`` below bf16's
largest value and is undone in fp32),
the MMAs accumulate in fp32, and the epilogues apply alpha, the io roundings, clamp, SwiGLU and
(A4 routes) the per-16 re-quantization of FC1's output with ``gs2[e]`` exactly as
:mod:`tiled_kernels` does, with the A4 activations quantized by the same pass before FC1. Only
the order of the fp32 additions differs.
Scale bytes are decoded as e4m3 values including subnormals and sign; like
:mod:`tiled_kernels`, the NaN bytes ``0x7f``/``0xff`` decode as 480/-480 (not NaN).

The layouts and the K relabelling: :mod:`decode_layouts`; the inline PTX: :mod:`decode_asm`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from a4prefill.ops.backends.triton.decode_asm import (
    LAUNCH_DEPENDENTS_ASM,
    WAIT_FOR_PREREQUISITES_ASM,
    _dequant_words,
    _factors,
    _grid_dependency,
    _l2_prefetch_rows,
)
from a4prefill.ops.backends.triton.decode_layouts import (
    _b_operand,
    _operand,
    activation_layout,
    l2_prefetch_layout,
    mma_layout,
    operand_layout,
    scale_layout,
    words_layout,
)
from a4prefill.ops.backends.triton.numerics import _quantize_groups, swiglu
from a4prefill.ops.precision import MODE_A4, MODE_SPLIT, MODE_W4A16

# The kernels' MODE (a4prefill.ops.precision), as Gluon constexprs
W4A16_MODE: gl.constexpr = gl.constexpr(MODE_W4A16)
A4_MODE: gl.constexpr = gl.constexpr(MODE_A4)
SPLIT_MODE: gl.constexpr = gl.constexpr(MODE_SPLIT)

# cp.async into shared memory: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared``
# before (same arguments: shared memory, pointers, mask)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


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
    ``tiled_kernels``' A4 epilogue (:func:`numerics._quantize_groups`): the values
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
    (read in ``A4_MODE`` and ``SPLIT_MODE`` only). Routing tensors as in :mod:`routing` with
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
    # Undo the 2**-7 of the dequantization; epilogue as tiled_kernels.
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
