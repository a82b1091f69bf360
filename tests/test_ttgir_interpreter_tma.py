"""The TTGIR interpreter's TMA loads (``tests/helpers/ttgir_interpreter.py``) on a small Gluon
kernel compiled for sm_90a (``tests/helpers/tma_kernels.py``): a box lands with its mbarrier's
phase, rows and columns outside the tensor read as zeros, and the two mistakes a TMA pipeline
can make are caught: a byte count the copies do not meet leaves the phase open (the wait never
returns), and a read before the wait gets the shared memory's garbage."""

from __future__ import annotations

import pytest
import torch

from helpers.markers import needs_gluon

pytestmark = needs_gluon

ROWS, COLS = 64, 64
BOX_BYTES = ROWS * COLS * 2


def _launch(x: torch.Tensor, col0: int, programs: int, expect_bytes: int = BOX_BYTES, wait: bool = True):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from helpers.gluon_on_cpu import InterpretedKernel
    from helpers.tma_kernels import tma_box_kernel

    layout = gl.NVMMASharedLayout.get_default_for([ROWS, COLS], gl.bfloat16)
    descriptor = TensorDescriptor.from_tensor(x, [ROWS, COLS], layout)
    out = torch.full((programs * ROWS, COLS), -1.0, dtype=torch.bfloat16)
    InterpretedKernel(tma_box_kernel)[(programs,)](
        descriptor, out, col0, ROWS=ROWS, COLS=COLS, EXPECT_BYTES=expect_bytes, WAIT=wait
    )
    return out


@pytest.mark.parametrize(("rows", "cols", "col0"), [(128, 64, 0), (100, 96, 40), (37, 80, 0)])
def test_boxes_land_with_the_phase_and_read_zeros_outside_the_tensor(rows, cols, col0):
    """Three programs' boxes of a ``rows x cols`` tensor from column ``col0``: the tensor's
    values where the box covers it, zeros past its last row and column."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).bfloat16()
    padded = torch.zeros(3 * ROWS, max(cols, col0 + COLS), dtype=torch.bfloat16)
    padded[: min(rows, 3 * ROWS), :cols] = x[: 3 * ROWS]
    out = _launch(x, col0, programs=3)
    assert torch.equal(out, padded[:, col0 : col0 + COLS])


@pytest.mark.parametrize("expect_bytes", [BOX_BYTES // 2, 2 * BOX_BYTES], ids=["too_few", "too_many"])
def test_a_byte_count_the_copy_does_not_meet_never_completes_the_phase(expect_bytes):
    from helpers.ttgir_interpreter import Deadlock

    with pytest.raises(Deadlock, match="waits forever"):
        _launch(torch.ones(ROWS, COLS).bfloat16(), 0, programs=1, expect_bytes=expect_bytes)


def test_a_read_before_the_wait_gets_garbage():
    out = _launch(torch.ones(ROWS, COLS).bfloat16(), 0, programs=1, wait=False)
    assert out.isnan().all()
