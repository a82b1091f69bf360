"""A small Gluon kernel with a TMA load for the TTGIR interpreter's tests (tests only): program
``p`` loads the box of ``ROWS x COLS`` at rows ``p * ROWS`` and column ``col0`` of a 2-D bf16
tensor through a host tensor descriptor into shared memory, on an mbarrier that expects
``EXPECT_BYTES``, waits for it (unless ``WAIT`` is false) and writes the box to ``out``
(``[programs * ROWS, COLS]``)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# ``async_load`` from Triton 3.7 on, ``async_copy_global_to_shared`` before (same arguments)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def tma_box_kernel(
    desc,
    out_ptr,
    col0,
    ROWS: gl.constexpr,
    COLS: gl.constexpr,
    EXPECT_BYTES: gl.constexpr,
    WAIT: gl.constexpr,
):
    """One box per program (module docstring); launched with 4 warps."""
    box = gl.allocate_shared_memory(gl.bfloat16, [ROWS, COLS], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.expect(ready, EXPECT_BYTES)
    _tma_load(desc, [gl.program_id(0) * ROWS, col0], ready, box)
    if WAIT:
        mbarrier.wait(ready, 0)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + rows[:, None] * COLS + cols[None, :], box.load(layout))
