"""The triton backend's A4 activation quantizer (``quantize.quantize_rows``: one Triton kernel,
``shared_kernels.quantize_rows_kernel``, on ``numerics._quantize_groups``, the per-16 rounding
that the tiled, decode and prefill kernels' A4 epilogues share), compiled for sm_90a and its
TTGIR interpreted on the CPU (``helpers.gluon_on_cpu.InterpretedKernel``), bit for bit against
the reference quantizer ``nvfp4.quantize``: codes, scale bytes and the ``e2m1 * block_scale``
values. The GPU test of the same contract is
``test_triton_backend.py::test_activation_quantization_is_bit_exact_with_the_reference``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a4prefill.ops import nvfp4
from a4prefill.ops.backends.triton.quantize import quantize_rows
from helpers.gluon_on_cpu import InterpretedKernel
from helpers.markers import needs_gluon

pytestmark = needs_gluon  # the kernel module imports triton

# e2m1's decision points (ties: 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5), its values, and a bf16 step
# either side of each, as multiples of a block scale
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@functools.cache
def shared_kernels():
    """The kernel module (imports triton: only once a test runs) and, one compile per argument
    types for the whole module, its quantizer interpreted on the CPU."""
    from a4prefill.ops.backends.triton import shared_kernels as module

    return module, InterpretedKernel(module.quantize_rows_kernel)


def bf16_neighbours(values: tuple[float, ...]) -> list[float]:
    """Each of ``values`` and the bf16 values just below and above it, positive and negative."""
    points = torch.tensor(values, dtype=torch.bfloat16)
    bits = points.view(torch.int16)
    around = torch.cat([points, (bits - 1).view(torch.bfloat16), (bits + 1).view(torch.bfloat16)])
    around = around[around.float() >= 0].float()
    return sorted({*around.tolist(), *(-around).tolist()})


def assert_quantized_as_the_reference(x: torch.Tensor, encode_scale: float) -> None:
    """``quantize_rows(x, write_codes=True)`` (interpreted) equals ``nvfp4.quantize`` and
    ``quantize_dequantize_blocks`` of ``x`` bit for bit."""
    encode = torch.tensor([encode_scale], dtype=torch.float32)
    module, interpreted = shared_kernels()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "quantize_rows_kernel", interpreted)
        values, codes, scales = quantize_rows(x, encode, write_codes=True)
    expected_codes, expected_scales = nvfp4.quantize(x, encode)
    assert codes is not None and scales is not None
    assert torch.equal(codes, expected_codes)
    assert torch.equal(scales.view(torch.uint8), expected_scales.view(torch.uint8))
    expected = nvfp4.quantize_dequantize_blocks(x, encode).to(x.dtype)
    assert torch.equal(values.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("power", [-6, 0, 3, 8])
def test_every_e2m1_tie_and_its_neighbours_round_as_the_reference(power):
    """Blocks whose largest magnitude is ``6 * 2**power`` (encode scale 1: block scale
    ``2**power``, so the kernel divides exactly) holding each e2m1 value and decision point and
    the bf16 values either side of it, times the block scale: ties go to the even code."""
    points = bf16_neighbours(E2M1_TIES + E2M1_VALUES)
    rows = []
    for start in range(0, len(points), 15):
        chunk = points[start : start + 15]
        rows.append([6.0, *chunk, *([0.0] * (15 - len(chunk)))])
    x = (torch.tensor(rows) * 2.0**power).to(torch.bfloat16)
    assert_quantized_as_the_reference(x, 1.0)


bf16_bits = st.integers(min_value=-(2**15), max_value=2**15 - 1).filter(
    lambda bits: (bits & 0x7F80) != 0x7F80  # not an infinity or NaN
)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.lists(bf16_bits, min_size=32, max_size=32),
    encode_scale=st.sampled_from([0.37, 1.0, 5.0, 2688.0 / 3.0, 1e-3]),
)
def test_any_bf16_rows_quantize_as_the_reference(bits, encode_scale):
    """Two rows of 16 bf16 values drawn from every finite bit pattern (subnormals, zeros and
    saturating block scales included), with encode scales whose divisions are inexact."""
    x = torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16).reshape(2, 16)
    assert_quantized_as_the_reference(x, encode_scale)
