"""The warp-specialized Hopper prefill GEMM of the ``triton`` backend (Gluon, sm_90a; issue 23;
what MoE calls of 64 or more routes per expert run, ``schedules.choose_prefill_tiles``):
``grouped_w4_gemm_ws_kernel``, the register-weights GEMM of :mod:`prefill_kernels`
(``grouped_w4_gemm_rs_kernel``) with its copies and its two warpgroups decoupled, and persistent.

A work item is ``ITEM_ROWS`` (128 or 256) weight rows of one expert times ``BT`` sorted routes
of it (one route tile of the routing times one row block: :func:`_works`). An activation row is
read from L2 once per work item of its tile, so 256-row items halve that traffic (calls of every
precision mode on 32-route and 128-route tiles run them: ``schedules.choose_prefill_tiles``).
The kernel is persistent: program ``p`` of ``P`` (one per SM, or two or three per SM at small
route tiles: ``PrefillGemm.ctas_per_sm``) takes items ``p, p + P, ...`` of the routing's live
tiles, read on the device (no host sync), as three partitions (``gl.warp_specialize``) that meet
only at mbarriers, never at a CTA barrier:

- a **producer** (``PRODUCER_WARPS`` warps, few registers; ``prefill.ws_partitions``): per K
  step of 64 columns it waits until ring slot ``s % DEPTH`` is free (``empty``), then one thread
  announces the step's TMA bytes on the slot's ``ready`` barrier (``mbarrier.expect``) and issues
  two TMA boxes (``cp.async.bulk.tensor``: the code bytes of the item's weight rows, for FC1 a
  5-D box whose rows land in the SwiGLU row order, :func:`code_box`; the ``BT`` activation rows
  from the tile's first sorted position), and every thread ``cp.async``-copies one row's 4
  scale bytes (under TMA's 16-byte minimum box row) and arrives when they land
  (``cp.async.mbarrier.arrive.noinc``); ``ready`` completes when all threads arrived and all the
  TMA bytes landed (in the A8 register-weights mode each thread stores its row's scale bytes and
  block exponent itself, and one thread arrives once more after a barrier of the partition,
  :func:`_produce`). The activation rows are in sorted order: FC2's are, FC1's are gathered by
  token before the launch (``prefill.launch_prefill_gemm``: one ``[routes, K]`` copy), since
  Hopper's TMA has no gather, or, with ``X_BY_TOKEN``, copied by token by the producer's threads
  (``cp.async``, 16 bytes each) from ``x`` in the consumers' column order (bf16: a ``[T, K]``
  copy);
- two **consumers** (but with ``A_SETS = WGMMAS = 2``), the default partition (the item's first
  half of the rows) and a worker (the second half), one warpgroup each (64 rows, one wgmma of
  M 64 per step, or 128 rows, two): per step each waits for ``ready``, reads its rows' code and
  scale bytes in :func:`~prefill_kernels.fragment_codes_layout` (the code rows as
  the TMA wrote them, in :func:`~prefill_kernels.fragment_code_rows_layout`, then reshaped),
  dequantizes them into its wgmma A registers, issues the wgmma on the slot's rows, retires it
  and releases the slot (one arrival each, so ``empty`` counts two); after an item's last step
  each runs the epilogue of its rows (:func:`~prefill_kernels._epilogue` from ``n0 + R * w``,
  ``R`` its rows: the SwiGLU row pairing of :func:`~prefill_kernels._weight_row` holds per 16
  rows, so the halves are independent).

The ring step ``s`` counts on across a program's items, so the producer copies the next item's
first steps while the consumers run the epilogue of the last one. A consumer dequantizes while
the other's wgmma runs. Same arguments, numerics and epilogues as the register-weights kernel
(``x``'s columns in ``prefill.mma_column_order``; the ModelOpt code layout as loaded).

With ``WGMMAS = 2`` (``PrefillGemm.wgmmas_per_step``) each step runs as two wgmmas of 32 columns,
the second half dequantized while the first half's wgmma runs (:func:`_mainloop`, or with
``LOADS_AHEAD`` :func:`_steps_loading_ahead`); with ``A_SETS = 2`` as well (the default of
256-route tiles) one wgmma stays in flight across steps too, and both consumer warpgroups form the
default partition (8 warps, one code path for the 128 rows; one arrival per slot, so ``empty``
counts one) with the producer as the only worker. Why one partition: ptxas serializes every wgmma
of the kernel ("C7512 ... insufficient register resources", a wait after each) when two wgmma
groups stay in flight across the K loop's steps in a worker partition (Triton 3.6 and 3.9;
``tests/test_triton_prefill_on_cpu.py`` checks the SASS). ``A_SETS = 2`` with one wgmma per step
keeps the two consumer partitions: each dequantizes the next step while its step's wgmma runs, one
group in flight (:func:`_mainloop_ahead`). ``LOADS_AHEAD`` (``PrefillGemm.loads_ahead``) keeps one
A register set and moves only the next step's shared-memory loads under the step's wgmma
(:func:`_steps_loading_ahead`), with one or two wgmmas a step.

Ordering (checked on the CPU by the TTGIR interpreter, which runs the partitions one at a time and
switches at every mbarrier wait and after every arrival): slot ``s % DEPTH`` is refilled for
ring step ``s + DEPTH`` only after both consumers released it, which each does after the wgmma
that read its rows retired; a consumer reads a slot only after its ``ready`` phase completed,
which needs every producer thread's scale copies (or, A8 with register weights, stores) and all
TMA bytes of that step to have landed. Proxies: the wgmma reads the rows in the async proxy;
where the producer's threads wrote them (``X_BY_TOKEN``'s ``cp.async``, generic proxy) each
consumer fences the proxies after its ``ready`` wait (A8's weights converted into shared memory:
after its own stores, :mod:`prefill_a8_kernels`). Nothing else is fenced: what a TMA wrote is
visible to the consumers' loads and wgmmas once the phase completed, and the scale bytes (and
the A8 register-weights producer's stores) are read by generic loads only.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from a4prefill.ops.backends.triton.prefill_a8_kernels import (
    A8_REGISTERS,
    A8_SHARED,
    A8_STEP,
    bytes_of_words,
    mainloop_a8,
    mainloop_a8_quarters,
    mainloop_a8_wide,
    weight_exponents,
)
from a4prefill.ops.backends.triton.prefill_kernels import (
    EPILOGUE_SWIGLU,
    _dequant_fragment,
    _epilogue,
    _scale_pointers,
    _tile,
    _weight_row,
    acc_layout,
    fragment_code_rows_layout,
    fragment_codes_layout,
    row_piece_layout,
    scale_copy_layout,
)

# cp.async into shared memory: ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared``
# before (same arguments); the TMA load likewise
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

STEP: gl.constexpr = gl.constexpr(64)  # K columns per step
# a shared-memory view as another element type: ``reinterpret`` in Triton 3.9 (the CPU test
# machines), ``_reinterpret`` in 3.6 (the H200's and H100's; same arguments)
_PUBLIC_REINTERPRET: gl.constexpr = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


def code_box(swiglu: bool, item_rows: int, step_bytes: int) -> list[int]:
    """The TMA box of one step's code bytes of a work item, over :func:`code_view`'s view: FC1
    (SwiGLU) ``[1, item_rows / 16, 2, 8, step_bytes]`` (expert, group of 8 gate rows, gate or up,
    row, byte), whose ``item_rows`` rows land in shared memory in the kernel's row order
    (``prefill_kernels._weight_row``: 8 gate rows, the 8 up rows of the same intermediate
    columns, and so on), one copy a step; else ``[item_rows, step_bytes]``."""
    return [1, item_rows // 16, 2, 8, step_bytes] if swiglu else [item_rows, step_bytes]


def code_view(codes: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """``codes`` uint8 ``[E, N, K / 2]`` as the kernel's TMA copies index it (no copy): FC1
    (SwiGLU, ``N = 2 I``: gate rows, then up rows) ``[E, I / 8, 2, 8, K / 2]`` (row ``8 g + r``
    of the gate half, or of the up half), else ``[E * N, K / 2]``."""
    experts, n, half_k = codes.shape
    if swiglu:
        return codes.view(experts, 2, n // 16, 8, half_k).permute(0, 2, 1, 3, 4)
    return codes.view(experts * n, half_k)


def tma_boxes(
    routes: int, swiglu: bool, a8: bool = False, item_rows: int = 128
) -> tuple[tuple[list[int], Any], tuple[list[int], Any]]:
    """``((x_box, x_layout), (code_box, code_layout))``: the block shapes and shared layouts of the
    kernel's TMA copies, per step. Activation rows: ``routes`` rows by one step of 128 bytes (64
    bf16 columns, or with ``a8`` one A8 block of 128 e4m3 columns), 128-byte swizzle (the wgmma's
    B layout); code bytes: :func:`code_box` (the step's 32 bytes of each row, 64 with ``a8``)."""
    step = int(A8_STEP) if a8 else int(STEP)
    x_box, codes_box = [routes, step], code_box(swiglu, item_rows, step // 2)
    return (
        (x_box, gl.NVMMASharedLayout.get_default_for(x_box, gl.float8e4nv if a8 else gl.bfloat16)),
        (codes_box, gl.NVMMASharedLayout.get_default_for(codes_box, gl.uint8)),
    )


def tma_descriptors(
    x: torch.Tensor, codes: torch.Tensor, routes: int, swiglu: bool, a8: bool = False, item_rows: int = 128
) -> tuple[Any, Any]:
    """Host tensor descriptors of the kernel's TMA copies (:func:`tma_boxes`): ``x`` ``[R, K]``,
    the activation rows in sorted order (bf16, or float8_e4m3fn with ``a8``), and ``codes`` uint8
    ``[E, N, K / 2]`` through :func:`code_view`. Both contiguous with 16-byte aligned rows (``K``
    a multiple of 64, of 128 with ``a8``); boxes reaching past row ``R`` read zeros there."""
    (x_box, x_layout), (codes_box, code_layout) = tma_boxes(routes, swiglu, a8, item_rows)
    return (
        TensorDescriptor.from_tensor(x, x_box, x_layout),
        TensorDescriptor.from_tensor(code_view(codes, swiglu), codes_box, code_layout),
    )


@gluon.constexpr_function
def code_words_layout(rows: int, warps: int) -> gl.DistributedLinearLayout:
    """:func:`~prefill_kernels.fragment_code_rows_layout` over the same bytes as int32 words
    ``[rows, 8]`` (word ``w`` of a row is its bytes ``4 w`` to ``4 w + 3``, little endian): a
    thread holds 8 consecutive bytes of a row there, so each of its words whole, in the same
    registers, lanes and warps."""
    rows_layout = fragment_code_rows_layout(rows, warps)

    def words(bases: list[list[int]]) -> list[list[int]]:  # the byte bases inside a word dropped
        return [[row, byte // 4] for row, byte in bases if byte % 4 == 0]

    return gl.DistributedLinearLayout(
        reg_bases=words(rows_layout.reg_bases),
        lane_bases=words(rows_layout.lane_bases),
        warp_bases=words(rows_layout.warp_bases),
        block_bases=[],
        shape=[rows, 8],
    )


@gluon.constexpr_function
def code_ring_layout(box_layout: gl.NVMMASharedLayout) -> gl.NVMMASharedLayout:
    """The shared layout of the ring's ``[ITEM_ROWS, step bytes]`` code slots: the code box's
    swizzle in two dimensions. TMA swizzles by shared-memory address, so a box of any rank lands
    as this layout says when its rows are the slot's rows in order (:func:`code_box`)."""
    return gl.NVMMASharedLayout(box_layout.swizzle_byte_width, 8)


@gluon.jit
def _works(N, num_tiles_ptr, ITEM_ROWS: gl.constexpr):
    """``(n_blocks, works)``: a work item ``w`` is route tile ``w // n_blocks`` times weight-row
    block ``w % n_blocks`` (``ITEM_ROWS`` rows each); ``works`` counts those of the routing's live
    tiles."""
    n_blocks = N // ITEM_ROWS
    return n_blocks, n_blocks * gl.load(num_tiles_ptr)


@gluon.constexpr_function
def consumer_rows(item_rows: int, warps: int) -> int:
    """A consumer partition's weight rows of each work item: half of ``item_rows`` for a
    partition of one warpgroup (4 warps, one of two), all of them for the 8-warp partition of both
    warpgroups."""
    return item_rows * warps // 8


@gluon.constexpr_function
def scale_group_layout(steps: int, warps: int) -> gl.BlockedLayout:
    """``[steps, rows, 4]`` scale bytes of ``steps`` steps (8: a row's 32 bytes, one L2 sector
    where the scales are 32-byte aligned) for ``cp.async``: 4 bytes a thread, a row's steps on
    consecutive lanes (8 lanes a sector, 4 rows a warp instruction), the warps on the rows.

    A trade: the 8 lanes of a row write 8 planes of the scale ring, ``rows * 4`` bytes apart (a
    multiple of 128), so one shared-memory bank: 8 store wavefronts a copy instead of 1 (shared
    memory shapes are powers of two, so a plane cannot be padded). Per 64-column step of a
    256-row item that is 64 store wavefronts and 32 sector lookups, where the per-step copy
    (each lane its own row's 4 bytes) takes 8 and 256, and asks L2 8 times as often."""
    return gl.BlockedLayout([1, 1, 4], [steps, 32 // steps, 1], [1, warps, 1], [2, 0, 1])


@gluon.jit
def _scale_group_slot(s_ring, j, SCALE_GROUPS: gl.constexpr):
    """Group slot ``j`` of the scale ring ``[SCALE_GROUPS * G, ITEM_ROWS, 4]`` (a step's plane per
    slot, as the consumers index it): the ``[G, ITEM_ROWS, 4]`` view of planes ``G j`` to ``G j +
    G - 1`` that one group's copy writes (the ring viewed as ``[SCALE_GROUPS, G, ITEM_ROWS, 4]``,
    the same bytes: both layouts unswizzled, row-major)."""
    PLAIN3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    G: gl.constexpr = s_ring.shape[0] // SCALE_GROUPS
    shape: gl.constexpr = [SCALE_GROUPS, G, s_ring.shape[1], s_ring.shape[2]]
    if _PUBLIC_REINTERPRET:
        groups = s_ring.reinterpret(gl.uint8, shape, PLAIN3)
    else:
        groups = s_ring._reinterpret(gl.uint8, shape, PLAIN3)
    return groups.index(j)


@gluon.jit
def _scale_group_offsets(expert, n0, N, K, EPILOGUE: gl.constexpr, G: gl.constexpr, ITEM_ROWS: gl.constexpr):
    """The ``[G, ITEM_ROWS, 4]`` int32 offsets (:func:`scale_group_layout`) into the scale bytes
    (``[E * N, K / 16]``, fewer than 2**31: the launcher checks) of steps 0 to ``G - 1`` of the
    expert's ``ITEM_ROWS`` weight rows from ``n0`` (rows as ``prefill_kernels._weight_row``):
    step ``p``'s 4 bytes of a row at ``4 p`` on; the group from step ``j`` on at ``+ 4 j``. Int32,
    not pointers: in the two-CTA schedules the producer has 40 registers a thread, and a thread of
    a 256-row item holds 16 offsets."""
    SGL: gl.constexpr = scale_group_layout(G, gl.num_warps())
    ps = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, SGL)))
    rs = gl.arange(0, ITEM_ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, SGL)))
    bs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, SGL)))
    scale_rows = expert * N + _weight_row(n0, rs, N, EPILOGUE)
    # the row stride written as a multiple of the group's bytes (K a multiple of 64 G), so that
    # the compiler proves each thread's 4 bytes aligned
    row_offsets = scale_rows * ((K // (64 * G)) * (4 * G))
    return row_offsets[None, :, None] + (ps * 4)[:, None, None] + bs[None, None, :]


@gluon.jit
def _produce(
    tensors, EPILOGUE: gl.constexpr, A8: gl.constexpr, X_BY_TOKEN: gl.constexpr, SCALE_GROUPS: gl.constexpr
):
    """The producer partition: for each of the program's work items in turn, every step's copies into
    its ring slot, ``ready`` when all landed. One thread issues the step's two TMA boxes (the code
    bytes of the item's weight rows, :func:`code_box`; the ``BT`` activation rows from the tile's
    first sorted position) after one ``expect`` of their bytes; every thread ``cp.async``-copies
    one row's scale bytes (4, or 8 for an A8 step; a TMA box row takes at least 16) and, with
    ``A8`` at an item's last step, ``BT / 128`` routes' activation scales (``xs [ROUTES]`` fp32
    in sorted order, 0 past ``ROUTES``), and arrives when they land (``noinc``). With ``A8 =
    A8_REGISTERS`` each thread loads its row's 8 scale bytes into registers instead, as two
    int32 words (``bytes_of_words``) a step ahead: the next step's load is issued after this
    step's stores and is first used after the next wait for a free slot (loaded as 8 bytes, the
    compiled loop unpacked them, and so waited for the load, right after it). It stores them and
    the row's block exponent (``prefill_a8_kernels.weight_exponents``, ``p_ring [DEPTH,
    ITEM_ROWS]`` int32, ``rings[6]``) into the slot, and the partition arrives once more after
    its stores (the consumers' conversion then skips the exponent's reduction across lanes).
    With ``X_BY_TOKEN`` the step's activation rows are not a TMA box: every thread
    ``cp.async``-copies 16-byte pieces of the tile's rows from ``x_rows_ptr`` (``[T, K]``, the
    columns in the order the consumers read: the kernel's docstring) by token,
    ``sorted_route[p] // TOPK`` (the token
    of position 0 for positions past ``ROUTES``, whose columns no epilogue writes), the pieces'
    int32 element offsets computed once per work item (``T * K < 2**31``: the launcher checks;
    64-bit addresses kept across the steps spilled in the 256-route A8 FC1 with Triton 3.6); the
    same ``noinc`` arrival covers them.
    With a scale ring of its own (``SCALE_GROUPS`` groups of ``G`` steps, ``s_ring [SCALE_GROUPS *
    G, ITEM_ROWS, 4]``) the threads copy the scale bytes of ``G`` steps at a group's first step
    instead, a row's ``4 G`` bytes (one 32-byte sector where ``scales`` is 32-byte aligned, as
    torch allocates) on 8 lanes, into the group's slot (:func:`_scale_group_offsets`,
    :func:`_scale_group_slot`); the ``noinc`` arrivals of the group's later steps, after those
    copies, also wait for them, so each step's ``ready`` covers its scale bytes.
    The ring runs on across work items:
    ``done`` counts the steps of the program's earlier items. ``tensors``: the kernel's ``x_desc``
    to ``ROUTES`` arguments, ``xs_ptr``, ``x_rows_ptr``, ``sorted_route_ptr``, ``TOPK`` and the
    rings and barriers."""
    (
        x_desc,
        codes_desc,
        scales_ptr,
        tile_expert_ptr,
        tile_row_ptr,
        seg_start_ptr,
        seg_count_ptr,
        num_tiles_ptr,
        N,
        K,
        ROUTES,
        xs_ptr,
        x_rows_ptr,
        sorted_route_ptr,
        TOPK,
        rings,
    ) = tensors
    c_ring = rings[0]
    s_ring = rings[1]
    x_ring = rings[2]
    ready = rings[3]
    empty = rings[4]
    DEPTH: gl.constexpr = x_ring.shape[0]
    BT: gl.constexpr = x_ring.shape[1]
    ITEM_ROWS: gl.constexpr = c_ring.shape[1]
    X_STEP_BYTES: gl.constexpr = x_ring.shape[2] * x_ring.dtype.primitive_bitwidth // 8
    CODE_STEP: gl.constexpr = codes_desc.block_type.shape[-1]  # code bytes of a row per step
    # the TMA boxes' bytes: the code bytes and, unless X_BY_TOKEN, the activation rows
    STEP_BYTES: gl.constexpr = ITEM_ROWS * CODE_STEP + (0 if X_BY_TOKEN else BT * X_STEP_BYTES)
    n_blocks, works = _works(N, num_tiles_ptr, ITEM_ROWS)
    SCALE_BYTES: gl.constexpr = scale_copy_layout(2 * CODE_STEP, gl.num_warps())  # a row's per thread
    # with a scale ring of its own, the steps of one group (as the kernel allocated the ring)
    SECTOR_STEPS: gl.constexpr = s_ring.shape[0] // SCALE_GROUPS if SCALE_GROUPS else 0
    if A8:
        XS: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        xs_routes = gl.arange(0, BT, layout=XS)
    done = 0
    for work in range(gl.program_id(0), works, gl.num_programs(0)):
        steps, expert, row0, _, n0, _ = _tile(
            work // n_blocks,
            work % n_blocks,
            tile_expert_ptr,
            tile_row_ptr,
            seg_start_ptr,
            seg_count_ptr,
            num_tiles_ptr,
            K,
            ITEM_ROWS,
            2 * CODE_STEP,
        )
        if X_BY_TOKEN:  # the tile's rows by token: a 16-byte piece's address per thread and row
            XL: gl.constexpr = row_piece_layout(X_STEP_BYTES, x_ring.dtype.primitive_bitwidth, gl.num_warps())
            x_pos = row0 + gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
            x_token = gl.load(sorted_route_ptr + x_pos, mask=x_pos < ROUTES, other=0) // TOPK
            x_cols = gl.arange(0, 2 * CODE_STEP, layout=gl.SliceLayout(0, XL))
            x_offsets = x_token[:, None] * K + x_cols[None, :]  # int32: the launcher checks T * K
        if A8 == A8_REGISTERS:  # each row's scale bytes one step ahead, as two int32 words
            word_ptrs = _scale_pointers(scales_ptr, expert, n0, N, K, EPILOGUE, ITEM_ROWS, 2 * CODE_STEP, 4)
            next_words = gl.load(word_ptrs)
        elif SECTOR_STEPS:  # a group of steps' scale bytes per row: one sector, 8 lanes
            group_offsets = _scale_group_offsets(expert, n0, N, K, EPILOGUE, SECTOR_STEPS, ITEM_ROWS)
        else:
            scale_ptrs = _scale_pointers(scales_ptr, expert, n0, N, K, EPILOGUE, ITEM_ROWS, 2 * CODE_STEP)
        for step in range(steps):
            s = done + step
            slot = s % DEPTH
            # the slot's previous use released by both consumers (its first use passes at once)
            mbarrier.wait(empty.index(slot), ((s // DEPTH) & 1) ^ 1)
            ready_slot = ready.index(slot)
            mbarrier.expect(ready_slot, STEP_BYTES)
            if EPILOGUE == EPILOGUE_SWIGLU:  # the item's gate and up rows in the kernel's order
                _tma_load(
                    codes_desc,
                    [expert, n0 // 16, 0, 0, step * CODE_STEP],
                    ready_slot,
                    c_ring.index(slot).reshape(codes_desc.block_type.shape),
                )
            else:
                _tma_load(codes_desc, [expert * N + n0, step * CODE_STEP], ready_slot, c_ring.index(slot))
            if X_BY_TOKEN:
                _async_load(x_ring.index(slot), x_rows_ptr + (x_offsets + step * 2 * CODE_STEP))
            else:
                _tma_load(x_desc, [row0, step * 2 * CODE_STEP], ready_slot, x_ring.index(slot))
            if A8 == A8_REGISTERS:  # the scale bytes through registers, each row's exponent with them
                step_scales = gl.convert_layout(bytes_of_words(next_words), SCALE_BYTES)
                s_ring.index(slot).store(step_scales)
                rings[6].index(slot).store(weight_exponents(step_scales))
                # the next step's words, in flight from here to their first use, after the next
                # wait for a free slot
                next_words = gl.load(
                    word_ptrs + (step + 1) * (CODE_STEP // 32), mask=step + 1 < steps, other=0
                )
                mbarrier.arrive(ready_slot)  # after a barrier of the partition: every thread's stores
            elif SECTOR_STEPS:
                # the next group's scale bytes, into its slot of the scale ring (the steps a
                # group's slot stays unused: schedules.PrefillGemm.scale_ring_groups)
                if step % SECTOR_STEPS == 0:
                    j = (s // SECTOR_STEPS) % SCALE_GROUPS
                    group = _scale_group_slot(s_ring, j, SCALE_GROUPS)
                    _async_load(group, scales_ptr + (group_offsets + step * (CODE_STEP // 8)))
            else:
                _async_load(s_ring.index(slot), scale_ptrs + step * (CODE_STEP // 8))
            if A8:  # noqa: SIM102 (a constexpr branch: compiled out without A8)
                if step == steps - 1:  # the routes' scales, applied once after the item's last block
                    pos = row0 + xs_routes
                    _async_load(rings[5].index(slot), xs_ptr + pos, mask=pos < ROUTES)
            async_copy.mbarrier_arrive(ready_slot, increment_count=False)
        done += steps


@gluon.jit
def _wait_for_weights(
    rings, s, HALF: gl.constexpr, ROWS: gl.constexpr, FENCE_ROWS: gl.constexpr, AS_WORDS: gl.constexpr = False
):
    """Ring step ``s`` for a consumer of ``ROWS`` weight rows (rows ``ROWS * HALF`` on of the slot): waits
    until the slot's copies landed (with ``FENCE_ROWS``, the slot's activation rows written by
    ``cp.async``, then a proxy fence: those generic-proxy writes before the wgmma's async-proxy reads;
    rows and code bytes a TMA wrote, and the scale bytes this consumer reads itself, need none, as in
    :func:`prefill_a8_kernels.mainloop_a8`), then loads its rows' code bytes ``[ROWS, 4, 8]`` in
    :func:`~prefill_kernels.fragment_codes_layout` (the code rows as the TMA wrote them, in
    :func:`~prefill_kernels.fragment_code_rows_layout`, then reshaped: registers unchanged), or with
    ``AS_WORDS`` the same bytes as int32 words ``[ROWS, 8]`` in :func:`code_words_layout` (a value
    carried across a loop's back edge as words stays in 32-bit registers: :func:`_code_bytes`), and
    scale bytes ``[ROWS, 4]`` (the ring's slot of step ``s``, or with a scale ring of its own,
    ``SCALE_GROUPS`` groups of ``G`` steps, its slot ``s % (SCALE_GROUPS * G)``). Returns ``(codes,
    scales)``."""
    c_ring, s_ring, x_ring, ready = rings[0], rings[1], rings[2], rings[3]
    DEPTH: gl.constexpr = x_ring.shape[0]
    FL: gl.constexpr = fragment_codes_layout(ROWS, gl.num_warps(), 8)
    slot = s % DEPTH
    mbarrier.wait(ready.index(slot), (s // DEPTH) & 1)
    if FENCE_ROWS:  # rows written by cp.async (generic proxy), read by the wgmma (async proxy)
        fence_async_shared()
    if AS_WORDS:  # the slot's bytes viewed as int32 (the swizzle follows the byte address either way)
        ITEM_ROWS: gl.constexpr = c_ring.shape[1]
        WORDS: gl.constexpr = gl.NVMMASharedLayout(c_ring.layout.swizzle_byte_width, 32)
        if _PUBLIC_REINTERPRET:
            word_ring = c_ring.reinterpret(gl.int32, [DEPTH, ITEM_ROWS, 8], WORDS)
        else:
            word_ring = c_ring._reinterpret(gl.int32, [DEPTH, ITEM_ROWS, 8], WORDS)
        codes = (
            word_ring.index(slot)
            .slice(HALF * ROWS, ROWS, dim=0)
            .load(code_words_layout(ROWS, gl.num_warps()))
        )
    else:
        code_rows = (
            c_ring.index(slot)
            .slice(HALF * ROWS, ROWS, dim=0)
            .load(fragment_code_rows_layout(ROWS, gl.num_warps()))
        )
        codes = gl.convert_layout(gl.reshape(code_rows, [ROWS, 4, 8]), FL)
    # the ring's slot of step s, or the step's in a scale ring of its own (SCALE_GROUPS)
    scales = s_ring.index(s % s_ring.shape[0]).slice(HALF * ROWS, ROWS, dim=0).load(gl.SliceLayout(2, FL))
    return codes, scales


@gluon.jit
def _mainloop(
    done,
    steps,
    HALF: gl.constexpr,
    rings,
    BT: gl.constexpr,
    FENCE_ROWS: gl.constexpr,
    LOADS_AHEAD: gl.constexpr,
    WGMMAS: gl.constexpr = 1,
):
    """A consumer's ``steps`` steps of one work item, ring steps ``done`` on: its rows' fp32
    accumulator ``[ROWS, BT]`` (:func:`consumer_rows`). Per step: wait for the slot's copies
    (:func:`_wait_for_weights` with ``FENCE_ROWS``), dequantize its rows' weights into the A
    registers, issue the step's ``WGMMAS`` wgmmas (:func:`_issue_step`), retire them (the next
    step's dequantization writes the same registers) and release the slot: nothing in flight
    across steps, so with two wgmmas a step the two consumer partitions still alternate at the
    tensor core. With ``LOADS_AHEAD`` (``PrefillGemm.loads_ahead``) the same steps with each
    step's bytes loaded while the step before runs its wgmmas (:func:`_steps_loading_ahead`).

    (Two sets of A registers with one wgmma left in flight while the next one is issued, as
    ``grouped_w4_gemm_rs_kernel``'s ``A_SETS = 2``, were tried in the tenth round with one
    consumer per partition: ptxas serialized every wgmma of the kernel, "insufficient register
    resources", the same that :func:`_mainloop_halves` meets in a worker partition; it was slower
    on the H200. :func:`_mainloop_ahead` keeps at most one in flight.)"""
    x_ring, empty = rings[2], rings[4]
    DEPTH: gl.constexpr = x_ring.shape[0]
    ACC: gl.constexpr = acc_layout(BT, gl.num_warps())
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    ROWS: gl.constexpr = consumer_rows(rings[0].shape[1], gl.num_warps())
    acc = gl.zeros([ROWS, BT], gl.float32, layout=ACC)
    if LOADS_AHEAD:
        acc = _steps_loading_ahead(acc, done, steps, HALF, rings, FENCE_ROWS, A_LAYOUT, WGMMAS)
    else:
        for step in range(steps):
            s = done + step
            slot = s % DEPTH
            codes, scales = _wait_for_weights(rings, s, HALF, ROWS, FENCE_ROWS)
            acc, first, second = _issue_step(codes, scales, x_ring.index(slot), acc, A_LAYOUT, WGMMAS)
            acc, first, second = warpgroup_mma_wait(num_outstanding=0, deps=(acc, first, second))
            mbarrier.arrive(empty.index(slot))
    return acc


@gluon.jit
def _code_bytes(words, ROWS: gl.constexpr):
    """Code words ``[ROWS, 8]`` int32 in :func:`code_words_layout` -> the code bytes ``[ROWS, 4, 8]``
    uint8 in :func:`~prefill_kernels.fragment_codes_layout` that :func:`_wait_for_weights` loads
    without ``AS_WORDS``: the same bytes in the same threads (ptxas keeps them in the words'
    registers; ``tests/test_triton_prefill_on_cpu.py`` checks the K loop's SASS)."""
    FL: gl.constexpr = fragment_codes_layout(ROWS, gl.num_warps(), 8)
    return gl.convert_layout(gl.reshape(bytes_of_words(words), [ROWS, 4, 8]), FL)


@gluon.jit
def _issue_step(codes, scales, x_slot, acc, A_LAYOUT: gl.constexpr, WGMMAS: gl.constexpr):
    """Dequantize one step's code bytes ``[ROWS, 4, 8]`` and scale bytes (:func:`_wait_for_weights`;
    with ``AS_WORDS`` the words through :func:`_code_bytes`) into the A registers and issue the
    step's wgmmas on the activation rows ``x_slot``: one over the step's 64 columns, or with
    ``WGMMAS = 2`` two of 32, each half's A operand in registers of its own
    (:func:`_byte_halves`), the second half dequantized while the first half's wgmma runs. Returns
    ``(acc, first, second)``: the wgmmas in flight and their A operands (with one wgmma both are
    its A operand), every one a dependency of the wait that retires them."""
    ROWS: gl.constexpr = codes.shape[0]
    if WGMMAS == 1:
        a = _dequant_fragment(codes, scales, A_LAYOUT, ROWS)
        return warpgroup_mma(a, x_slot.permute((1, 0)), acc, is_async=True), a, a
    else:
        HALF_STEP: gl.constexpr = STEP // 2
        FL_HALF: gl.constexpr = fragment_codes_layout(ROWS, gl.num_warps(), 4)
        first_codes, second_codes = _byte_halves(codes, FL_HALF)
        scales = gl.convert_layout(scales, gl.SliceLayout(2, FL_HALF))  # the same registers
        first = _dequant_fragment(first_codes, scales, A_LAYOUT, ROWS)
        acc = warpgroup_mma(first, x_slot.slice(0, HALF_STEP, dim=1).permute((1, 0)), acc, is_async=True)
        second = _dequant_fragment(second_codes, scales, A_LAYOUT, ROWS)
        acc = warpgroup_mma(
            second, x_slot.slice(HALF_STEP, HALF_STEP, dim=1).permute((1, 0)), acc, is_async=True
        )
        return acc, first, second


@gluon.jit
def _steps_loading_ahead(
    acc,
    done,
    steps,
    HALF: gl.constexpr,
    rings,
    FENCE_ROWS: gl.constexpr,
    A_LAYOUT: gl.constexpr,
    WGMMAS: gl.constexpr,
):
    """:func:`_mainloop`'s steps with ``LOADS_AHEAD``, into ``acc``: per step ``s``, dequantize the
    bytes loaded before, issue the step's ``WGMMAS`` wgmmas (:func:`_issue_step`; with two, both
    retired together, as :func:`_mainloop` does), wait for ring step
    ``s + 1``'s copies and load its code words and scale bytes (:func:`_wait_for_weights` with
    ``AS_WORDS``; ptxas keeps the shared-memory loads between the last wgmma and its wait, so
    their latency runs under the tensor core's work), retire the wgmmas and release step ``s``'s
    slot. The item's first step is loaded before the loop and its last step loads nothing ahead
    (the next item's steps are the next call's), so no slot is waited for that the item does not
    consume. One A register set; the words carried across the back edge add 2 registers per row
    of a thread. Returns ``acc`` with every wgmma retired and every slot of the item released.

    Timed against the plain steps on an H100 (thirty-first round, ``benchmarks/results``): 6-7%
    faster at 512 tokens (32-route tiles), 4-5% at 1024 and 4096 (128-route tiles of 256 rows),
    2-4% slower at 2048 (64-route tiles of 128 rows, which keep the plain steps); the
    thirty-second round's one run: 5.4% and 4.3% at 512 and 1024, level at 4096; the
    thirty-third round's five runs at 4096: 1.3% on the mean. With two wgmmas a step (the
    ``_h2_la`` candidates): level with one wgmma a step in the thirty-third round's runs."""
    x_ring, empty = rings[2], rings[4]
    DEPTH: gl.constexpr = x_ring.shape[0]
    ROWS: gl.constexpr = acc.shape[0]
    words, scales = _wait_for_weights(rings, done, HALF, ROWS, FENCE_ROWS, True)
    for step in range(steps - 1):
        s = done + step
        codes = _code_bytes(words, ROWS)
        acc, first, second = _issue_step(codes, scales, x_ring.index(s % DEPTH), acc, A_LAYOUT, WGMMAS)
        words, scales = _wait_for_weights(rings, s + 1, HALF, ROWS, FENCE_ROWS, True)
        acc, first, second = warpgroup_mma_wait(num_outstanding=0, deps=(acc, first, second))
        mbarrier.arrive(empty.index(s % DEPTH))
    last = done + steps - 1
    codes = _code_bytes(words, ROWS)
    acc, first, second = _issue_step(codes, scales, x_ring.index(last % DEPTH), acc, A_LAYOUT, WGMMAS)
    acc, first, second = warpgroup_mma_wait(num_outstanding=0, deps=(acc, first, second))
    mbarrier.arrive(empty.index(last % DEPTH))
    return acc


@gluon.jit
def _mainloop_ahead(
    done, steps, last, HALF: gl.constexpr, rings, BT: gl.constexpr, a, FENCE_ROWS: gl.constexpr
):
    """:func:`_mainloop` with two A register sets (``FENCE_ROWS`` as there): each step's successor is
    dequantized while the step's wgmma runs. ``a`` holds step ``done``'s A operand (dequantized before
    the call); per step ``s``: wait for ring step ``s + 1``'s copies and dequantize them into the other
    set, wait on ``ready`` of step ``s + 1`` once more, retire step ``s``'s wgmma, release its slot,
    then issue step ``s + 1``'s wgmma. One wgmma is in flight across the loop's back edge and retired
    before the next is issued (ptxas keeps that in a worker partition, unlike two in flight). The
    second ``ready`` wait (already complete) is a block boundary: without it ptxas sinks the
    dequantization below the wgmma wait, which nothing after it needs
    (``tests/test_triton_prefill_on_cpu.py`` checks the SASS).

    The ring steps run on across work items, so the next item's first step is dequantized during
    this item's last wgmma; ``last``, the program's last ring step, stops that at the program's
    end (its final step dequantizes itself again: no slot the producer never fills is waited
    for). Returns ``(acc, a)``: the fp32 accumulator ``[ROWS, BT]`` with every wgmma retired
    and every slot of the item released, and the A operand of ring step ``done + steps``."""
    x_ring, empty = rings[2], rings[4]
    DEPTH: gl.constexpr = x_ring.shape[0]
    ACC: gl.constexpr = acc_layout(BT, gl.num_warps())
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    ROWS: gl.constexpr = consumer_rows(rings[0].shape[1], gl.num_warps())
    acc = gl.zeros([ROWS, BT], gl.float32, layout=ACC)
    acc = warpgroup_mma(a, x_ring.index(done % DEPTH).permute((1, 0)), acc, is_async=True)
    for step in range(1, steps):
        s = done + step
        codes, scales = _wait_for_weights(rings, s, HALF, ROWS, FENCE_ROWS)
        a_next = _dequant_fragment(codes, scales, A_LAYOUT, ROWS, False)
        mbarrier.wait(rings[3].index(s % DEPTH), (s // DEPTH) & 1)
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        mbarrier.arrive(empty.index((s - 1) % DEPTH))
        a = a_next
        acc = warpgroup_mma(a, x_ring.index(s % DEPTH).permute((1, 0)), acc, is_async=True)
    s = gl.minimum(done + steps, last)
    codes, scales = _wait_for_weights(rings, s, HALF, ROWS, FENCE_ROWS)
    a_next = _dequant_fragment(codes, scales, A_LAYOUT, ROWS, False)
    mbarrier.wait(rings[3].index(s % DEPTH), (s // DEPTH) & 1)
    acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
    mbarrier.arrive(empty.index((done + steps - 1) % DEPTH))
    return acc, a_next


@gluon.jit
def _byte_halves(codes, HALF_LAYOUT: gl.constexpr):
    """codes ``[BW, 4, 8]`` in :func:`~prefill_kernels.fragment_codes_layout` -> ``(first,
    second)``, each ``[BW, 4, 4]`` in ``HALF_LAYOUT`` (that layout with 4 bytes per group): bytes
    0-3 and 4-7 of each group, the A operands of a step's first and second 32 MMA columns. A
    thread holds all 8 bytes of its groups, so this only renames registers."""
    BW: gl.constexpr = codes.shape[0]
    halves = gl.permute(gl.reshape(codes, [BW, 4, 2, 4]), (0, 1, 3, 2))
    first, second = gl.split(halves)
    return gl.convert_layout(first, HALF_LAYOUT), gl.convert_layout(second, HALF_LAYOUT)


@gluon.jit
def _mainloop_halves(done, steps, HALF: gl.constexpr, rings, BT: gl.constexpr, FENCE_ROWS: gl.constexpr):
    """:func:`_mainloop` (``FENCE_ROWS`` as there) with each step's 64 columns as two wgmmas of 32 and
    two A register sets, one wgmma always in flight, across steps too: per step, dequantize the
    first half, issue its wgmma, retire the previous step's second half (and release that step's
    slot), dequantize the second half, issue its wgmma, retire the first half. ``second`` stays
    live, a loop-carried value, until the next step's wait retires its wgmma. Only in the default
    partition with both consumer warpgroups (``HALF`` 0, 8 warps; module docstring: ptxas keeps
    this pipeline there, not in a worker). (Two wgmmas a step with one A set, both retired at the
    step's end, are :func:`_mainloop`'s ``WGMMAS = 2``.)

    Returns the fp32 accumulator ``[ROWS, BT]`` with every wgmma retired and every slot
    of the item released."""
    x_ring, empty = rings[2], rings[4]
    DEPTH: gl.constexpr = x_ring.shape[0]
    HALF_STEP: gl.constexpr = STEP // 2
    ROWS: gl.constexpr = consumer_rows(rings[0].shape[1], gl.num_warps())
    ACC: gl.constexpr = acc_layout(BT, gl.num_warps())
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    FL_HALF: gl.constexpr = fragment_codes_layout(ROWS, gl.num_warps(), 4)
    acc = gl.zeros([ROWS, BT], gl.float32, layout=ACC)
    second = gl.zeros([ROWS, HALF_STEP], gl.bfloat16, layout=A_LAYOUT)  # none in flight yet
    for step in range(steps):
        s = done + step
        codes, scales = _wait_for_weights(rings, s, HALF, ROWS, FENCE_ROWS)
        first_codes, second_codes = _byte_halves(codes, FL_HALF)
        scales = gl.convert_layout(scales, gl.SliceLayout(2, FL_HALF))  # the same registers
        x_slot = x_ring.index(s % DEPTH)
        first = _dequant_fragment(first_codes, scales, A_LAYOUT, ROWS)
        acc = warpgroup_mma(first, x_slot.slice(0, HALF_STEP, dim=1).permute((1, 0)), acc, is_async=True)
        acc, second = warpgroup_mma_wait(num_outstanding=1, deps=(acc, second))
        if step > 0:  # the previous step's second half retired: its slot is free
            mbarrier.arrive(empty.index((s - 1) % DEPTH))
        second = _dequant_fragment(second_codes, scales, A_LAYOUT, ROWS)
        acc = warpgroup_mma(
            second, x_slot.slice(HALF_STEP, HALF_STEP, dim=1).permute((1, 0)), acc, is_async=True
        )
        acc, first = warpgroup_mma_wait(num_outstanding=1, deps=(acc, first))
    acc, second = warpgroup_mma_wait(num_outstanding=0, deps=(acc, second))
    if steps > 0:
        mbarrier.arrive(empty.index((done + steps - 1) % DEPTH))
    return acc


@gluon.jit
def _item_epilogue(
    acc,
    tensors,
    expert,
    row0,
    seg_end,
    n0,
    live_tile,
    EPILOGUE: gl.constexpr,
    MODE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    ROWS: gl.constexpr,
    BT: gl.constexpr,
    OUT_MMA_ORDER: gl.constexpr,
):
    """:func:`~prefill_kernels._epilogue` of a consumer's accumulator ``[ROWS, BT]``: weight rows
    from ``n0``, the tile's sorted positions from ``row0``; ``tensors`` as :func:`_consume`'s."""
    _epilogue(
        acc,
        tensors[0],  # out_ptr
        tensors[1],  # scale2_ptr
        tensors[5],  # sorted_route_ptr
        expert,
        row0,
        seg_end,
        n0,
        live_tile,
        tensors[11],  # N
        tensors[13],  # ROUTES
        tensors[14],  # TOPK
        tensors[15],  # limit
        tensors[2],  # gs1_ptr
        tensors[3],  # gs2_ptr
        tensors[4],  # flag_ptr
        EPILOGUE,
        MODE,
        HAS_LIMIT,
        ROWS,
        BT,
        OUT_MMA_ORDER,
    )


@gluon.jit
def _consume(
    HALF: gl.constexpr,
    tensors,
    EPILOGUE: gl.constexpr,
    MODE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    BT: gl.constexpr,
    OUT_MMA_ORDER: gl.constexpr,
    A8: gl.constexpr,
    WGMMAS: gl.constexpr,
    A_SETS: gl.constexpr,
    X_BY_TOKEN: gl.constexpr,
    LOADS_AHEAD: gl.constexpr,
):
    """A consumer partition of ``R`` weight rows of each work item (:func:`consumer_rows`), rows
    ``R * HALF`` on (one warpgroup, half the item's rows, ``HALF`` 0 or 1; the 8-warp partition of
    both warpgroups with ``A_SETS = WGMMAS = 2``, all of them): for each of the program's work
    items in turn, every step's dequantization and wgmma (:func:`_mainloop` with one A set,
    :func:`_mainloop_halves` with ``A_SETS = WGMMAS = 2``, :func:`_mainloop_ahead`
    with ``A_SETS = 2`` and one wgmma per step, or with ``A8`` (one A set)
    :func:`prefill_a8_kernels.mainloop_a8`, or
    :func:`~prefill_a8_kernels.mainloop_a8_wide` with ``BT`` 256, whose two halves take an
    epilogue each, or with ``WGMMAS = 4`` :func:`~prefill_a8_kernels.mainloop_a8_quarters`, whose
    four quarters do), then the epilogue of its rows, while the producer already copies the next
    item's first steps. ``tensors``: the kernel's ``out_ptr`` to ``limit`` arguments (those of
    the epilogue go to :func:`_item_epilogue` as they are), then the rings and barriers.
    ``X_BY_TOKEN``: the rows come by ``cp.async``, and every mainloop's ``FENCE_ROWS`` (a proxy
    fence after each ``ready`` wait, none where a TMA wrote the rows). ``LOADS_AHEAD`` (one A set,
    not ``A8``): :func:`_mainloop` loads each step ahead
    (:func:`_steps_loading_ahead`), with ``WGMMAS`` 1 or 2."""
    tile_expert_ptr, tile_row_ptr, seg_start_ptr = tensors[6], tensors[7], tensors[8]
    seg_count_ptr, num_tiles_ptr, N, K, rings = tensors[9], tensors[10], tensors[11], tensors[12], tensors[16]
    ROWS: gl.constexpr = consumer_rows(rings[0].shape[1], gl.num_warps())
    ITEM_ROWS: gl.constexpr = rings[0].shape[1]
    n_blocks, works = _works(N, num_tiles_ptr, ITEM_ROWS)
    AHEAD: gl.constexpr = A_SETS == 2 and WGMMAS == 1  # _mainloop_ahead (W4A16 only)
    if AHEAD:  # the program's last ring step, and its first step's A operand
        items = (works - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)
        last = items * (K // STEP) - 1
        ACC: gl.constexpr = acc_layout(BT, gl.num_warps())
        A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        a = gl.zeros([ROWS, STEP], gl.bfloat16, layout=A_LAYOUT)
        if last >= 0:
            first_codes, first_scales = _wait_for_weights(rings, 0, HALF, ROWS, X_BY_TOKEN)
            a = _dequant_fragment(first_codes, first_scales, A_LAYOUT, ROWS, False)
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
            ITEM_ROWS,
            A8_STEP if A8 else STEP,
        )
        rows = n0 + HALF * ROWS
        # the item's accumulators, each of a part of the tile's routes: one, or with A8 on
        # 256-route tiles two halves or four quarters; then an epilogue for each
        if A8 and BT == 256:
            if WGMMAS == 4:  # four quarters of 64
                parts = mainloop_a8_quarters(done, steps, HALF, rings, BT, X_BY_TOKEN)
            else:  # two halves of 128
                parts = mainloop_a8_wide(done, steps, HALF, rings, BT, A8, WGMMAS, X_BY_TOKEN)
        elif A8:
            parts = (mainloop_a8(done, steps, HALF, rings, BT, A8, WGMMAS, X_BY_TOKEN),)
        elif AHEAD:
            acc, a = _mainloop_ahead(done, steps, last, HALF, rings, BT, a, X_BY_TOKEN)
            parts = (acc,)
        elif A_SETS == 2:  # and two wgmmas a step: the 8-warp partition
            parts = (_mainloop_halves(done, steps, HALF, rings, BT, X_BY_TOKEN),)
        else:
            parts = (_mainloop(done, steps, HALF, rings, BT, X_BY_TOKEN, LOADS_AHEAD, WGMMAS),)
        PART: gl.constexpr = parts[0].shape[1]
        for part in gl.static_range(len(parts)):
            _item_epilogue(
                parts[part],
                tensors,
                expert,
                row0 + part * PART,
                seg_end,
                rows,
                live_tile,
                EPILOGUE,
                MODE,
                HAS_LIMIT,
                ROWS,
                PART,
                OUT_MMA_ORDER,
            )
        done += steps


# ROUTES unspecialized: a call's route count must not pick another compiled kernel (a compile while
# serving after the load-time warm-up)
@gluon.jit(do_not_specialize=["ROUTES"])
def grouped_w4_gemm_ws_kernel(
    x_desc,
    codes_desc,
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
    EPILOGUE: gl.constexpr,
    MODE: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    BT: gl.constexpr,
    DEPTH: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    PRODUCER_REGISTERS: gl.constexpr,
    CONSUMER_REGISTERS: gl.constexpr,
    OUT_MMA_ORDER: gl.constexpr,
    ITEM_ROWS: gl.constexpr = 128,
    xs_ptr=None,
    A8: gl.constexpr = 0,
    WGMMAS: gl.constexpr = 1,
    A_SETS: gl.constexpr = 1,
    x_rows_ptr=None,
    X_BY_TOKEN: gl.constexpr = False,
    LOADS_AHEAD: gl.constexpr = False,
    SCALE_GROUPS: gl.constexpr = 0,
):
    """``grouped_w4_gemm_rs_kernel``'s product and epilogues for work items of ``ITEM_ROWS`` (128,
    or 256 with ``BT`` at most 128) weight rows and ``BT`` routes, warp-specialized and persistent
    (module docstring): launched with 4 warps
    (the default partition, consumer 0), plus a consumer warpgroup and ``PRODUCER_WARPS``
    producer warps as workers (``PRODUCER_REGISTERS`` and ``CONSUMER_REGISTERS`` per thread,
    ``setmaxnreg``). ``WGMMAS = 2``: two wgmmas per step (with ``A8`` and register weights a
    step converted in two K halves); ``WGMMAS = 4`` (``A8`` with register weights, ``BT`` 256 only:
    ``PrefillGemm.a8_route_quarters``): the step's routes as four quarters of 64 promoted while
    the next quarter's wgmma runs (:func:`prefill_a8_kernels.mainloop_a8_quarters`, an epilogue
    each); with ``A_SETS = 2``
    too, launched with 8 warps, both consumer warpgroups, and the producer as the only worker
    (``CONSUMER_REGISTERS`` not read). ``A_SETS = 2`` alone (not with ``A8``): the next step
    dequantized while the step's wgmma runs. ``x_desc`` and ``codes_desc`` are
    :func:`tma_descriptors`' (the activation rows in sorted order: FC1's gathered by token before
    the launch; :func:`tma_descriptors` with the same ``item_rows``). ``DEPTH`` ring slots, each a
    step's code bytes (``ITEM_ROWS`` x 32), scale bytes (``ITEM_ROWS`` x 4) and activation rows
    (``BT`` x 64 bf16).
    Grid ``(P,)``, any ``P >= 1`` (``prefill.persistent_programs`` times the schedule's
    ``ctas_per_sm``: one per SM, or two or three CTAs sharing an SM, with ``maxnreg`` and the
    partitions' registers of ``schedules.WS_SHARED_SM_REGISTERS``).

    ``A8`` (``MODE`` W4A16, ``BT`` 128, or 256 as two halves of 128 sharing each step's converted
    weights; ``tma_descriptors(..., a8=True)``): every route A8, the
    consumers of :mod:`prefill_a8_kernels` on steps of one A8 block (code bytes 128 x 64, scale
    bytes 128 x 8, activation rows ``BT`` x 128 e4m3; with an item's last step the rows' scales,
    ``xs_ptr`` fp32 ``[ROUTES]`` in sorted order; ``A_SETS = 1``), each consumer with a ``[64,
    128]`` e4m3 buffer of its converted weights (``A8`` = ``prefill_a8_kernels.A8_SHARED``), or
    none, the weights converted into the wgmma's A registers and the rows' columns in the A8
    fragment order (``A8_REGISTERS``; each row's block exponent computed by the producer,
    :func:`_produce`).

    ``X_BY_TOKEN`` (FC1; ``PrefillGemm.rows_by_token``): the producer copies each tile's
    activation rows itself, by token, from ``x_rows_ptr`` (``[T, K]``: bf16 with the columns in
    ``prefill.mma_column_order``, or with ``A8`` e4m3 in the order its consumers read), 16 bytes
    a ``cp.async``, into the same swizzled slots the TMA box fills otherwise (no ``[routes, K]``
    gather before the launch); ``x_desc`` then only gives the slots' type and layout (a
    descriptor of ``x_rows_ptr``'s tensor). ``xs_ptr`` stays in sorted order.

    ``LOADS_AHEAD`` (``A_SETS = 1``, not ``A8``): each consumer loads the next step's code and
    scale bytes while the step's wgmmas run (:func:`_steps_loading_ahead`).

    ``SCALE_GROUPS`` (not ``A8``; ``PrefillGemm.scale_sectors``, ``K`` a multiple of 512): the
    scale bytes in a ring of their own, ``SCALE_GROUPS`` slots of 8 steps' bytes, copied once per
    8 steps as one 32-byte sector a row (:func:`_produce`), instead of a step's 4 bytes a row in
    each ring slot."""
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    ONE_PARTITION: gl.constexpr = A_SETS == 2 and WGMMAS == 2  # both consumer warpgroups, 8 warps
    CONSUMERS: gl.constexpr = 1 if ONE_PARTITION else 2  # consumer partitions
    BARRIER: gl.constexpr = mbarrier.MBarrierLayout()
    CODE_STEP: gl.constexpr = codes_desc.block_type.shape[-1]  # code bytes of a row per step
    c_ring = gl.allocate_shared_memory(
        gl.uint8, [DEPTH, ITEM_ROWS, CODE_STEP], code_ring_layout(codes_desc.layout)
    )
    if SCALE_GROUPS:  # a scale ring of its own: SCALE_GROUPS groups of one sector's steps
        gl.static_assert(A8 == 0, "SCALE_GROUPS: W4A16, A4 and split calls only")
        G: gl.constexpr = 32 // (CODE_STEP // 8)  # steps whose scale bytes make a row's sector
        # a group's slot is refilled G * SCALE_GROUPS steps on, once step G * SCALE_GROUPS - DEPTH
        # on was released: not before the group's last step (schedules.PrefillGemm.scale_ring_groups)
        gl.static_assert(SCALE_GROUPS * G >= DEPTH + G - 1, "SCALE_GROUPS too few for DEPTH")
        s_ring = gl.allocate_shared_memory(gl.uint8, [SCALE_GROUPS * G, ITEM_ROWS, CODE_STEP // 8], PLAIN2)
    else:
        s_ring = gl.allocate_shared_memory(gl.uint8, [DEPTH, ITEM_ROWS, CODE_STEP // 8], PLAIN2)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [DEPTH, BT, 2 * CODE_STEP], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], BARRIER)
    empty = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], BARRIER)
    for slot in gl.static_range(DEPTH):
        # every producer thread (its scale copies, with X_BY_TOKEN its row copies) and the TMA
        # boxes' expect
        # (and with A8_REGISTERS the partition's arrival after its stores of the scale bytes)
        mbarrier.init(ready.index(slot), count=PRODUCER_WARPS * 32 + 1 + (A8 == A8_REGISTERS))
        mbarrier.init(empty.index(slot), count=CONSUMERS)  # each consumer partition once
    if A8:
        PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        xs_ring = gl.allocate_shared_memory(gl.float32, [DEPTH, BT], PLAIN1)
        if A8 == A8_SHARED:
            A8_ROWS: gl.constexpr = ITEM_ROWS // 2  # each of the two consumer warpgroups' rows
            A_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([A8_ROWS, A8_STEP], gl.float8e4nv)
            # each consumer's converted weights, one buffer each
            a_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, A8_ROWS, A8_STEP], A_LAYOUT)
            rings = (c_ring, s_ring, x_ring, ready, empty, xs_ring, a_smem)
        else:  # each row's block exponent, from the producer (_produce)
            p_ring = gl.allocate_shared_memory(gl.int32, [DEPTH, ITEM_ROWS], PLAIN1)
            rings = (c_ring, s_ring, x_ring, ready, empty, xs_ring, p_ring)
    else:  # A8's rings have 2 more
        rings = (c_ring, s_ring, x_ring, ready, empty)  # type: ignore[assignment]
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
    producer = (
        x_desc,
        codes_desc,
        scales_ptr,
        tile_expert_ptr,
        tile_row_ptr,
        seg_start_ptr,
        seg_count_ptr,
        num_tiles_ptr,
        N,
        K,
        ROUTES,
        xs_ptr,
        x_rows_ptr,
        sorted_route_ptr,
        TOPK,
        rings,
    )
    if ONE_PARTITION:  # both warpgroups in the default partition (8 warps), the producer a worker
        gl.warp_specialize(
            [
                (
                    _consume,
                    (
                        0,
                        consumer,
                        EPILOGUE,
                        MODE,
                        HAS_LIMIT,
                        BT,
                        OUT_MMA_ORDER,
                        A8,
                        WGMMAS,
                        A_SETS,
                        X_BY_TOKEN,
                        LOADS_AHEAD,
                    ),
                ),
                (_produce, (producer, EPILOGUE, A8, X_BY_TOKEN, SCALE_GROUPS)),
            ],
            [PRODUCER_WARPS],
            [PRODUCER_REGISTERS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _consume,
                    (
                        0,
                        consumer,
                        EPILOGUE,
                        MODE,
                        HAS_LIMIT,
                        BT,
                        OUT_MMA_ORDER,
                        A8,
                        WGMMAS,
                        A_SETS,
                        X_BY_TOKEN,
                        LOADS_AHEAD,
                    ),
                ),
                (
                    _consume,
                    (
                        1,
                        consumer,
                        EPILOGUE,
                        MODE,
                        HAS_LIMIT,
                        BT,
                        OUT_MMA_ORDER,
                        A8,
                        WGMMAS,
                        A_SETS,
                        X_BY_TOKEN,
                        LOADS_AHEAD,
                    ),
                ),
                (_produce, (producer, EPILOGUE, A8, X_BY_TOKEN, SCALE_GROUPS)),
            ],
            [4, PRODUCER_WARPS],
            [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
        )
