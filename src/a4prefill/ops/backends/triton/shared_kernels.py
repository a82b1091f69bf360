"""The Triton kernels of the ``triton`` backend that both GEMM paths launch (imported lazily:
needs triton):

- :func:`route_prep_kernel`: one program sorts up to ``R_BLOCK`` routes by expert and builds the
  tile table (the routing layout of :mod:`routing`, which launches it);
- :func:`route_count_kernel`, :func:`route_offsets_kernel`, :func:`route_place_kernel`: the same
  for any number of routes, in chunks of ``CH`` routes (a histogram per chunk, one program for
  the prefix sums, a stable sort per chunk placed at its offsets; launched by :mod:`routing`);
- :func:`quantize_rows_kernel`: the FC1 input of A4 rows, ``e2m1 * block_scale`` (launched by
  :mod:`quantize`);
- :func:`combine_kernel`: the weighted top-k sum of FC2's rows into ``[T, H]`` (launched by
  :mod:`fused`; after a K split of the tiled FC2 it also applies alpha2);
- :func:`gather_rows_kernel`: the warp-specialized prefill FC1's activation rows in sorted order
  and MMA column order, in one pass (launched by :mod:`prefill`).

Numerics: :mod:`numerics`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from a4prefill.ops.backends.triton.numerics import A4_MODE, SPLIT_MODE, W4A16_MODE, _quantize_groups, _unscale


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


@triton.jit
def _sort_keys(ids_ptr, r, R, E):
    """The sort keys of routes ``r`` (int32): the expert id, ``E`` for an id outside ``[0, E)``
    and for ``r >= R`` (past the call's routes)."""
    ids = tl.load(ids_ptr + r, mask=r < R, other=E).to(tl.int32)
    return tl.where((ids >= 0) & (ids < E), ids, E)


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
    key = _sort_keys(ids_ptr, r, R, E)
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


@triton.jit(do_not_specialize=["R"])
def route_count_kernel(ids_ptr, scratch_ptr, R, E, CH: tl.constexpr, E_BLOCK: tl.constexpr):
    """Chunk ``c = program_id(0)`` (routes ``[c * CH, (c + 1) * CH)``): ``scratch[c, key]`` = its
    routes of each sort key (the expert id, ``E`` for ids outside ``[0, E)``), ``E_BLOCK > E``
    keys (power of two). Routes past ``R`` count as key ``E`` in the last chunk, where they sort
    after every route of it and are never placed (:func:`route_place_kernel`)."""
    c = tl.program_id(0)
    key = _sort_keys(ids_ptr, c * CH + tl.arange(0, CH), R, E)
    tl.store(scratch_ptr + c * E_BLOCK + tl.arange(0, E_BLOCK), tl.histogram(key, E_BLOCK))


@triton.jit(do_not_specialize=["C"])
def route_offsets_kernel(
    scratch_ptr,
    seg_start_ptr,
    seg_count_ptr,
    num_tiles_ptr,
    C,
    E,
    BLOCK_M: tl.constexpr,
    E_BLOCK: tl.constexpr,
    C_TILE: tl.constexpr,
):
    """One program over :func:`route_count_kernel`'s counts ``scratch [C, E_BLOCK]`` (int32,
    ``scratch`` has ``C + 2`` rows): row ``c`` becomes the routes of each key in chunks ``< c``,
    row ``C`` each key's first sorted position (the sentinel key ``E`` after every expert), row
    ``C + 1`` each expert's first tile (0 from ``E`` on); ``seg_start``, ``seg_count`` [E] and
    ``num_tiles`` [1] as :mod:`routing` lays them out. ``C_TILE`` chunks' counts per step."""
    e = tl.arange(0, E_BLOCK)
    total = tl.zeros([E_BLOCK], dtype=tl.int32)
    for c0 in range(0, C, C_TILE):
        rows = c0 + tl.arange(0, C_TILE)
        where = scratch_ptr + rows[:, None] * E_BLOCK + e[None, :]
        mask = (rows < C)[:, None]
        counts = tl.load(where, mask=mask, other=0)
        tl.store(where, tl.cumsum(counts, 0) - counts + total[None, :], mask=mask)
        total += tl.sum(counts, 0)
    key_start = tl.cumsum(total, 0) - total
    tiles = tl.where(e < E, (total + BLOCK_M - 1) // BLOCK_M, 0)
    tl.store(scratch_ptr + C * E_BLOCK + e, key_start)
    tl.store(scratch_ptr + (C + 1) * E_BLOCK + e, tl.cumsum(tiles, 0) - tiles)
    tl.store(seg_start_ptr + e, key_start, mask=e < E)
    tl.store(seg_count_ptr + e, total, mask=e < E)
    tl.store(num_tiles_ptr, tl.sum(tiles, 0))


@triton.jit(do_not_specialize=["R", "C"])
def route_place_kernel(
    ids_ptr,
    scratch_ptr,
    sorted_route_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    R,
    E,
    C,
    BLOCK_M: tl.constexpr,
    CH: tl.constexpr,
    E_BLOCK: tl.constexpr,
):
    """Chunk ``c = program_id(0)``: its routes sorted by key, stable by route index
    (``tl.sort`` of ``key * CH + i``), written to ``sorted_route`` from each key's offset for the
    chunk (:func:`route_offsets_kernel`'s rows ``c`` and ``C``); the route at a multiple of
    ``BLOCK_M`` within its expert's segment writes its tile's ``tile_expert`` and ``tile_row``
    (row ``C + 1``: the expert's first tile). Routes past ``R`` are not written."""
    c = tl.program_id(0)
    i = tl.arange(0, CH)
    key = _sort_keys(ids_ptr, c * CH + i, R, E)
    in_chunk = tl.histogram(key, E_BLOCK)
    run_start = tl.cumsum(in_chunk, 0) - in_chunk  # each key's first index among the sorted chunk
    e = tl.arange(0, E_BLOCK)
    earlier = tl.load(scratch_ptr + c * E_BLOCK + e)
    key_start = tl.load(scratch_ptr + C * E_BLOCK + e)
    tile_start = tl.load(scratch_ptr + (C + 1) * E_BLOCK + e)
    ordered = tl.sort(key * CH + i)
    sorted_key = ordered // CH
    route = c * CH + ordered % CH
    local = i - tl.gather(run_start, sorted_key, 0) + tl.gather(earlier, sorted_key, 0)
    position = tl.gather(key_start, sorted_key, 0) + local
    live = route < R
    tl.store(sorted_route_ptr + position, route, mask=live)
    starts = live & (sorted_key < E) & (local % BLOCK_M == 0)
    tile = tl.gather(tile_start, sorted_key, 0) + local // BLOCK_M
    tl.store(tile_expert_ptr + tile, sorted_key, mask=starts)
    tl.store(tile_row_ptr + tile, position, mask=starts)


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


@triton.jit(do_not_specialize=["R"])  # one compile for every route count
def gather_rows_kernel(
    x_ptr, sorted_route_ptr, out_ptr, R, K2, TOPK, BR: tl.constexpr, BLOCKS_FIRST: tl.constexpr
):
    """``out[p] = x[sorted_route[p] // TOPK]`` with each 64 columns in ``prefill.mma_column_order``
    (position ``32 w + 16 m + 8 e + 2 q + t`` takes column ``16 q + 8 w + 4 t + 2 m + e``), for
    ``p < R``. ``x [T, K]`` and ``out [R, K]`` bf16, seen as int32 column pairs (``K2 = K / 2``).
    The order splits pairs: output pair ``16 w + 8 m + 4 e + q`` takes half ``e`` of source pairs
    ``8 q + 4 w + m`` (its low half) and ``8 q + 4 w + 2 + m`` (its high half), so each two source
    pairs become two output pairs by 16-bit masks and shifts (a 2x2 transpose of halves), and
    every load and store moves whole pairs. ``BR`` rows by one 64-column block a program. Grid
    ``(cdiv(R, BR), K / 64)``, or with ``BLOCKS_FIRST`` ``(K / 64, cdiv(R, BR))``: programs
    launched one after the other then cover whole rows before the next rows (memory written in
    order) instead of one 64-column stripe of every row. What ``x.index_select(1,
    mma_column_order(K)).index_select(0, sorted_route // TOPK)`` gives, without the ``[T, K]``
    copy between."""
    row_axis: tl.constexpr = 1 if BLOCKS_FIRST else 0
    rows = tl.program_id(row_axis) * BR + tl.arange(0, BR)
    live = rows < R
    token = tl.load(sorted_route_ptr + rows, mask=live, other=0) // TOPK
    block = tl.program_id(1 - row_axis) * 32  # the block's first pair
    pairs = tl.arange(0, 32)
    source = token.to(tl.int64)[:, None] * K2 + block + pairs[None, :]
    loaded = tl.load(x_ptr + source, mask=live[:, None])  # [BR, 32]: pair 8 q + 4 w + 2 t + m
    low, high = tl.split(tl.permute(tl.reshape(loaded, (BR, 4, 2, 2, 2)), (0, 1, 2, 4, 3)))  # t = 0, 1
    first = (low & 0xFFFF) | (high << 16)  # e = 0: the low halves
    second = ((low >> 16) & 0xFFFF) | (high & -65536)  # e = 1: the high halves
    ordered = tl.reshape(tl.permute(tl.join(first, second), (0, 2, 3, 4, 1)), (BR, 32))  # [BR, w, m, e, q]
    target = rows.to(tl.int64)[:, None] * K2 + block + pairs[None, :]
    tl.store(out_ptr + target, ordered, mask=live[:, None])
