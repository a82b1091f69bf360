"""The column permutation that the Hopper prefill FC1 reads its activation rows from, as one Gluon
kernel (issue 23; sm_90, part of what ``kernel_modules.prefill_imports`` checks).

A ``rows_by_token`` FC1 (``PrefillGemm.rows_by_token``) copies each route's row by token from a
``[T, K]`` copy of the hidden states with the columns of every 64-column block in
``prefill.mma_column_order``: pair ``4 b + q`` of a block (an int32 pair of bf16 columns) takes
pair ``8 q + b`` (``q < 4``, ``b < 8``). ``shared_kernels.gather_rows_kernel`` writes that copy today
(one route per token), at about 1.8 TB/s on an H200 against 4.2 for a plain copy (73 us of the
8192-token MoE call; ``benchmarks/results/README.md``, "thirty-fifth round", item 2): its
programs move 64 rows of one 64-column block each and permute through shared memory.
:func:`mma_order_rows_kernel` keeps the permutation in each thread's registers instead: a thread
owns one 64-column block of one row, reads its 32 pairs as 8 loads of 16 bytes, swaps the two
pair indices in its registers and writes 8 stores of 16 bytes; a warp's lanes take 32
consecutive blocks (4 KiB of a row), so a warp's loads and stores cover whole 128-byte lines.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

BLOCKS_PER_PROGRAM: gl.constexpr = gl.constexpr(32)  # 64-column blocks of a program: one a lane


@gluon.jit
def mma_order_rows_kernel(x_ptr, out_ptr, T, K2, ROWS: gl.constexpr):
    """``out[t] = x[t]`` with each 64-column block in ``prefill.mma_column_order`` (pair ``4 b +
    q`` of a block takes pair ``8 q + b``), for ``t < T``. ``x``, ``out``: ``[T, K]`` bf16 viewed
    as int32 column pairs (``K2 = K / 2``, ``K`` a multiple of 64), contiguous. A program moves
    ``ROWS`` rows (a multiple of its warps) by :data:`BLOCKS_PER_PROGRAM` blocks; each thread one
    block of one row, no shared memory. Grid ``(cdiv(T, ROWS), cdiv(K / 64,
    BLOCKS_PER_PROGRAM))``; no host sync."""
    W: gl.constexpr = gl.num_warps()
    BLOCKS: gl.constexpr = BLOCKS_PER_PROGRAM
    # [row, block, pair]: a thread holds one block's 32 pairs, in order, the lanes 32 blocks
    PAIRS: gl.constexpr = gl.BlockedLayout([1, 1, 32], [1, 32, 1], [W, 1, 1], [2, 1, 0])
    # [row, block, b, q] with q fastest: the same threads, the pairs of the output order
    SWAPPED: gl.constexpr = gl.BlockedLayout([1, 1, 8, 4], [1, 32, 1, 1], [W, 1, 1, 1], [3, 2, 1, 0])
    rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, PAIRS)))
    blocks = gl.program_id(1) * BLOCKS + gl.arange(
        0, BLOCKS, layout=gl.SliceLayout(0, gl.SliceLayout(2, PAIRS))
    )
    pairs = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, PAIRS)))
    row_offsets = gl.expand_dims(gl.expand_dims(rows.to(gl.int64) * K2, 1), 2)
    offsets = (
        row_offsets
        + gl.expand_dims(gl.expand_dims(blocks * 32, 0), 2)
        + gl.expand_dims(gl.expand_dims(pairs, 0), 1)
    )
    live = gl.expand_dims(gl.expand_dims(rows < T, 1), 2) & gl.expand_dims(
        gl.expand_dims(blocks * 32 < K2, 0), 2
    )
    live = gl.broadcast(live, offsets)[0]
    x = gl.load(x_ptr + offsets, mask=live)  # [row, block, 8 q + b]
    quads = gl.reshape(x, [ROWS, BLOCKS, 4, 8])  # [row, block, q, b]
    swapped = gl.convert_layout(gl.permute(quads, (0, 1, 3, 2)), SWAPPED)  # [row, block, b, q]
    out = gl.convert_layout(gl.reshape(swapped, [ROWS, BLOCKS, 32]), PAIRS)  # [row, block, 4 b + q]
    gl.store(out_ptr + offsets, out, mask=live)
