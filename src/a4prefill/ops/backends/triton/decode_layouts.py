"""Layouts of the ``triton`` backend's decode kernels (Gluon: imported lazily, with
:mod:`decode_kernels`): the K relabelling and the distributed layouts the kernels build from
their int constexprs.

- :func:`logical_to_physical`, :func:`column_to_logical`: the two maps of a 128-column K block,
  in plain Python (the kernels compute them inline: :func:`decode_kernels.permute_k_kernel` and
  ``fc1_decode_kernel``'s store; the tests check them against these);
- the layouts, ``gluon.constexpr_function`` s: :func:`words_layout`, :func:`scale_layout`,
  :func:`l2_prefetch_layout`, :func:`activation_layout`, :func:`mma_layout`,
  :func:`operand_layout`;
- :func:`_operand`, :func:`_b_operand`: the relabellings of loaded weights and activations into
  the MMA operands (no data moves between threads).

Who may call: :mod:`decode_kernels`, tests.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


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
