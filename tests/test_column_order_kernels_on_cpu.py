"""``column_order_kernels.mma_order_rows_kernel`` (the prefill FC1's column permutation of the
hidden states, each thread permuting one 64-column block in its registers) on the CPU: its TTGIR
interpreted against ``x.index_select(1, mma_column_order(K))``, and its sm_90a SASS (16-byte
loads and stores, no shared memory). Its speed: ``benchmarks/bench_gather.py`` on a GPU; the GPU
test: ``tests/test_column_order_kernels_gpu.py``."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a4prefill.ops.backends.triton import kernel_modules, prefill
from a4prefill.ops.backends.triton.column_order_kernels import mma_order_rows_kernel
from a4prefill.ops.backends.triton.prefill import mma_column_order, mma_ordered_rows
from helpers.markers import needs_gluon

pytestmark = [pytest.mark.slow, needs_gluon]


@pytest.fixture(scope="module")
def interpreted() -> Any:
    """``mma_order_rows_kernel`` replaced by its interpreted TTGIR for the module's tests."""
    from helpers.gluon_on_cpu import InterpretedKernel

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            kernel_modules.column_order(), "mma_order_rows_kernel", InterpretedKernel(mma_order_rows_kernel)
        )
        yield kernel_modules.column_order().mma_order_rows_kernel


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 19), blocks=st.integers(1, 40))
def test_each_row_leaves_with_every_64_column_block_in_mma_column_order(interpreted, tokens, blocks):
    """Bit for bit ``x.index_select(1, mma_column_order(K))`` for any token count (a partial last
    program of rows) and any whole number of 64-column blocks (more than a program's 32: a second
    column of programs, its lanes past the row's end masked); every column of a row distinct and
    rows apart, so a misplaced pair shows; both implementations of ``mma_ordered_rows`` agree."""
    k = 64 * blocks
    bits = (
        torch.arange(tokens, dtype=torch.int32)[:, None] * 4099 + torch.arange(k, dtype=torch.int32)
    ) & 0x7FFF
    x = bits.to(torch.int16).view(torch.bfloat16)
    expected = x.index_select(1, mma_column_order(k, x.device))
    launches = len(interpreted.launches)
    ordered = mma_ordered_rows(x, "registers")
    assert interpreted.launches[launches:] == [
        (-(-tokens // prefill.MMA_ORDER_ROWS_PER_PROGRAM), -(-blocks // 32))
    ]
    assert torch.equal(ordered.view(torch.int16), expected.view(torch.int16))


def test_an_unknown_kernel_or_a_partial_block_is_refused_by_name():
    """``mma_ordered_rows``' ``kernel`` is ``"gather"`` or ``"registers"``; the registers kernel
    takes whole 64-column blocks only, said before any launch."""
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kernel must be 'gather' or 'registers', got 'smem'"):
        mma_ordered_rows(x, "smem")
    with pytest.raises(ValueError, match="multiple of 64, got 96"):
        mma_ordered_rows(torch.zeros(2, 96, dtype=torch.bfloat16), "registers")


def test_the_permutation_stays_in_registers_with_16_byte_loads_and_stores():
    """Compiled for sm_90a as the launcher specializes it: per thread and row one block of 128
    bytes read by 8 ``LDG.E.128`` and written by 8 ``STG.E.128`` (2 rows a thread: 16 each), and
    no shared memory, shuffle or barrier (the pair swap is a renaming of registers)."""
    from helpers.gluon_on_cpu import compile_sm90
    from test_triton_prefill_on_cpu import cuobjdump

    compiled = compile_sm90(
        mma_order_rows_kernel,
        {"x_ptr": "*i32", "out_ptr": "*i32", "T": "i32", "K2": "i32"},
        {"ROWS": prefill.MMA_ORDER_ROWS_PER_PROGRAM},
        4,
        {"x_ptr", "out_ptr", "K2"},
    )
    sass = cuobjdump(compiled, "-sass")
    ops = Counter(re.findall(r"\b(LDG\.E\S*|STG\.E\S*|LDS\S*|STS\S*|SHFL\S*|BAR\S*)", sass))
    rows_per_thread = prefill.MMA_ORDER_ROWS_PER_PROGRAM // 4
    assert ops == {"LDG.E.128": 8 * rows_per_thread, "STG.E.128": 8 * rows_per_thread}
