"""The PTX-subset interpreter's own semantics (``helpers.ptx_subset``), on values worked out by
hand from the PTX ISA's definitions, not from the interpreter: ``prmt.b32``'s default mode
(byte selection and sign replication, register selectors), ``cvt.rn.satfinite.e4m3x2.f32``'s
byte order, nearest-even ties and saturation, and the fp32 immediates. The kernels' inline PTX is
checked through it (``test_triton_decode_ptx``, the A8 weight conversion in
``test_triton_prefill_a8_on_cpu``), so it must match the hardware's definitions."""

from __future__ import annotations

import pytest
import torch

from helpers.ptx_subset import run

A, B = 0x44332211, 0x88776655  # source bytes 0-3: 11 22 33 44; 4-7: 55 66 77 88


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        (0x3210, A),  # the identity
        (0x7654, B),
        (0x0123, 0x11223344),  # byte reversal
        (0x4444, 0x55555555),
        (0x000F, 0x111111FF),  # nibble F: byte 7 (0x88) has its sign bit set: 0xFF
        (0x000B, 0x11111100),  # nibble B: byte 3 (0x44), sign bit clear: 0x00
        (0xFFFF3210, A),  # only the low 16 bits select
    ],
)
def test_prmt_selects_bytes_and_replicates_their_sign_by_nibble(selector, expected):
    out = run("{ prmt.b32 $0, $1, $2, $3; }", {0: 0, 1: A, 2: B, 3: selector})[0]
    assert out == expected
    tensor = run("{ prmt.b32 $0, $1, $2, $3; }", {0: 0, 1: A, 2: B, 3: torch.tensor([selector, 0x3210])})[0]
    assert tensor.tolist() == [expected, A]


@pytest.mark.parametrize(
    ("a_bits", "b_bits", "expected"),
    [
        (0x40400000, 0x3F800000, 0x4438),  # a = 3.0 -> 0x44 in the high byte, b = 1.0 -> 0x38
        (0x43E00000, 0x00000000, 0x7E00),  # 448 (the largest finite) and +0
        (0x44000000, 0xC4000000, 0x7EFE),  # +-512 saturate to +-448
        (0x3F880000, 0x3F980000, 0x383A),  # ties to even: 1.0625 -> 1.0 (0x38), 1.1875 -> 1.25 (0x3A)
        (0x3B400000, 0x80000000, 0x0280),  # the subnormal tie 1.5 * 2**-9 -> 2 * 2**-9; -0.0 keeps its sign
        (0x3B100000, 0x3B000000, 0x0101),  # 1.125 * 2**-9 -> 2**-9 (nearest), 2**-9 itself
    ],
)
def test_cvt_to_e4m3x2_puts_a_high_rounds_to_nearest_even_and_saturates(a_bits, b_bits, expected):
    out = run(
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $2; mov.b32 $0, {t, t}; }",
        {0: 0, 1: a_bits, 2: b_bits},
    )
    assert out[0] == expected | expected << 16


def test_fp32_immediates_and_exact_products_only():
    assert run("{ mul.rn.f32 $0, $1, 0f3FC00000; }", {0: 0, 1: 0x40000000})[0] == 0x40400000  # 2 * 1.5
    with pytest.raises(ValueError, match="not exact"):
        run("{ mul.rn.f32 $0, $1, $1; }", {0: 0, 1: 0x3F800001})  # (1 + 2**-23)**2 rounds
