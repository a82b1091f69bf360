"""``prefill.mma_ordered_rows`` on a GPU (sm_90): the registers kernel
(``column_order_kernels.mma_order_rows_kernel``) writes the same bytes as the gather kernel and as
``x.index_select(1, mma_column_order(K))``, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from a4prefill.ops.backends.triton.prefill import mma_column_order, mma_ordered_rows
from helpers.markers import needs_gluon, needs_hopper

pytestmark = [pytest.mark.gpu, needs_gluon, needs_hopper]


@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (13, 2048), (300, 4096), (1031, 7168)])
def test_the_registers_kernel_writes_the_mma_column_order_eagerly_and_in_a_cuda_graph(tokens, hidden):
    """Bit for bit ``index_select`` (and the gather kernel's copy) for token counts off the
    program's 8 rows and hidden sizes of 1 to 112 blocks of 64 (a second column of programs with
    masked lanes at 7168); a CUDA-graph replay on new values of the same ``x`` gives theirs."""
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    columns = mma_column_order(hidden, x.device)
    expected = x.index_select(1, columns)
    ordered = mma_ordered_rows(x, "registers")
    assert torch.equal(ordered, expected)
    assert torch.equal(mma_ordered_rows(x, "gather"), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = mma_ordered_rows(x, "registers")
    x.copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, x.index_select(1, columns))
