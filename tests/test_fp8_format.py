"""The A8 operands (``ops.fp8``, docs/numerics.md section 8) against an oracle in exact rational
arithmetic: every e4m3 value is built from its bits here, and rounding is to the nearest of
them with ties to the even code, so nothing below relies on torch's float8 cast."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from a4prefill.ops import fp8, nvfp4
from helpers.layers import EVERY_SCALE_BYTE


def e4m3_value(byte: int) -> Fraction | None:
    """The value of an e4m3fn byte from its bits (None for the NaN bytes 0x7f, 0xff)."""
    sign, exponent, mantissa = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return None
    if exponent == 0:
        magnitude = Fraction(mantissa, 8) * Fraction(1, 2**6)
    else:
        magnitude = (1 + Fraction(mantissa, 8)) * Fraction(2) ** (exponent - 7)
    return -magnitude if sign else magnitude


NON_NEGATIVE = sorted((e4m3_value(b), b) for b in range(0x7F))  # 0 .. 448, every code


def round_to_e4m3(value: Fraction) -> Fraction:
    """Nearest e4m3 value, ties to the even code (value within [-448, 448])."""
    magnitude = abs(value)
    assert magnitude <= 448
    best = min(NON_NEGATIVE, key=lambda pair: (abs(pair[0] - magnitude), pair[1] & 1))
    return -best[0] if value < 0 else best[0]


def e2m1_value(code: int) -> Fraction:
    magnitude = Fraction(nvfp4.E2M1_MAGNITUDES[code & 7]).limit_denominator(2)
    return -magnitude if code & 8 else magnitude


def smallest_exponent(largest_scale: Fraction) -> int:
    """The smallest integer p with 6 * largest <= 448 * 2**p, by search."""
    if largest_scale == 0:
        return 0
    p = -40
    while 6 * largest_scale > 448 * Fraction(2) ** p:
        p += 1
    return p


def weight_rows(scale_bytes: list[list[int]], codes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and e4m3 block scales of rows given as 8 scale bytes and 128 codes each."""
    packed = nvfp4.pack_nibbles(torch.tensor(codes, dtype=torch.uint8))
    scales = torch.tensor(scale_bytes, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return packed, scales


def test_every_code_and_scale_byte_converts_to_the_nearest_e4m3_value():
    """Exhaustive: every (non-NaN scale byte, code) pair, in a block whose largest scale is that
    byte (the exponent it alone gives) and in a block with a larger scale beside it (a larger
    exponent: the pair's product lands lower, into e4m3's subnormals or 0)."""
    for neighbour in (None, 0x7E):  # 0x7e = 448, the largest scale
        scale_bytes, codes = [], []
        for byte in EVERY_SCALE_BYTE.tolist():
            for code_block in (list(range(16)) * 8,):
                row_scales = [byte] * 8 if neighbour is None else [byte] * 7 + [neighbour]
                scale_bytes.append(row_scales)
                codes.append(code_block)
        packed, scales = weight_rows(scale_bytes, codes)
        values, exponents = fp8.weights(packed, scales)
        for row, row_scales in enumerate(scale_bytes):
            largest = max(abs(e4m3_value(b)) for b in row_scales)  # type: ignore[arg-type]
            p = smallest_exponent(largest)
            assert exponents[row, 0].item() == p, (row_scales, p)
            scale = e4m3_value(row_scales[0])
            assert scale is not None
            for column in range(16):  # group 0: this byte's scale, every code
                expected = round_to_e4m3(e2m1_value(codes[row][column]) * scale / Fraction(2) ** p)
                got = Fraction(values[row, column].float().item())
                assert got == expected, (hex(row_scales[0]), column, got, expected)


@given(
    st.lists(st.integers(0, 0x7E), min_size=8, max_size=8), st.lists(st.booleans(), min_size=8, max_size=8)
)
def test_the_block_exponent_is_the_smallest_that_keeps_six_times_the_largest_scale(magnitudes, negative):
    scale_bytes = [m | (0x80 if s else 0) for m, s in zip(magnitudes, negative, strict=True)]
    scales = torch.tensor([scale_bytes], dtype=torch.uint8).view(torch.float8_e4m3fn)
    largest = max(abs(e4m3_value(b)) for b in scale_bytes)  # type: ignore[arg-type]
    assert fp8.weight_exponents(scales).item() == smallest_exponent(largest)


finite_bf16 = st.integers(0, 0xFFFF).filter(lambda bits: (bits >> 7) & 0xFF != 0xFF)


@given(
    st.integers(1, 2).flatmap(
        lambda blocks: st.lists(finite_bf16, min_size=128 * blocks, max_size=128 * blocks)
    )
)
def test_activation_rows_quantize_as_the_contract_says(bits):
    """Per row (one or two 128-column blocks): ``a = max(amax, 2**-100)``, ``s = a / 448``, codes
    ``e4m3(clamp(fp32(x * fp32(448 / a))))``, rounded here by the exact oracle (numpy does the
    fp32 arithmetic). Hypothesis draws every finite bf16 bit pattern, subnormals included."""
    x = torch.tensor(bits, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16).reshape(1, -1)
    codes, scales = fp8.quantize_rows(x)
    assert scales.shape == (1,)
    values = x.float().numpy()[0]
    amax = np.float32(np.abs(values).max())
    if amax == 0:
        assert scales.item() == 0 and not codes.float().any()
        return
    floored = max(amax, np.float32(2.0**-100))
    assert scales.item() == float(floored / np.float32(448))
    multiplier = np.float32(448) / floored
    for column in range(len(values)):
        product = float(np.clip(values[column] * multiplier, -448, 448))
        assert Fraction(codes[0, column].float().item()) == round_to_e4m3(Fraction(product)), column


def test_a_rows_scale_is_its_largest_magnitude_over_every_block():
    """One scale per row, whatever its blocks hold: a row whose second block holds its largest
    value (448 times a power of two) and whose first block is 2**-10 of it keeps the first
    block's values at that ratio (codes 0.4375 = 448 * 2**-10, an exact e4m3 value), not
    scaled up on their own; a row of zeros gets scale 0."""
    x = torch.zeros(3, 256)
    x[0, :128] = 448 * 2.0**-10
    x[0, 128] = 448
    x[1] = -3.0
    codes, scales = fp8.quantize_rows(x * 2.0**5)
    assert scales.tolist() == [2.0**5, float(np.float32(96) / np.float32(448)), 0.0]  # fp32 division
    assert codes[0, :128].float().unique().tolist() == [0.4375]
    assert codes[0, 128].item() == 448 and not codes[2].float().any()


@pytest.mark.parametrize("k", [128, 384])
def test_the_block_product_applies_each_blocks_and_rows_factors(k):
    """Operands whose A8 forms are exact (activations e4m3 values times a power of two per row,
    with 448 in each row; weights with power-of-two scales, so each block of a weight row has
    its own exponent): the A8 product equals the W4A16 product of the same values exactly
    (integer-valued sums, no fp32 rounding), so a factor applied to the wrong block, row or
    column shows."""
    generator = torch.Generator().manual_seed(0)
    rows, n = 5, 6
    e4m3_small_integers = torch.tensor([0.0, 1, 2, 3, 4, 6, 8, -1, -2, -3, -5, -7])
    picks = torch.randint(0, len(e4m3_small_integers), (rows, k), generator=generator)
    x = e4m3_small_integers[picks]
    x[:, 0] = 448  # amax 448: the multiplier is exactly 1
    x = x * 2.0 ** torch.randint(-3, 4, (rows, 1), generator=generator)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scale_exponents = torch.randint(-4, 5, (n, k // 16), generator=generator).float()
    scales = (2.0**scale_exponents).to(torch.float8_e4m3fn)
    packed = nvfp4.pack_nibbles(codes)
    activation_codes, activation_scales = fp8.quantize_rows(x)
    fp8_weights, exponents = fp8.weights(packed, scales)
    assert torch.equal(activation_codes.float() * activation_scales[:, None], x)
    assert len(exponents.unique()) > 1  # blocks and rows of different exponents
    got = fp8.block_product(activation_codes, activation_scales, fp8_weights, exponents)
    expected = x.double() @ nvfp4.dequantize_blocks(packed, scales).double().T
    assert torch.equal(got.double(), expected)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: fp8.quantize_rows(torch.zeros(2, 96)), ValueError, "K=96 must be a multiple of 128"),
        (lambda: fp8.quantize_rows(torch.zeros(2, 128, dtype=torch.int32)), TypeError, "x must be bfloat16"),
        (lambda: fp8.quantize_rows(torch.zeros(128)), ValueError, "x must be 2-D"),
        (lambda: fp8.weight_exponents(torch.zeros(2, 8)), TypeError, "block_scales must be float8_e4m3fn"),
        (
            lambda: fp8.weight_exponents(torch.zeros(2, 4).to(torch.float8_e4m3fn)),
            ValueError,
            "block_scales: K=64 must be a multiple of 128",
        ),
        (
            lambda: fp8.block_product(
                torch.zeros(2, 128).to(fp8.FP8),
                torch.zeros(2, 1),
                torch.zeros(3, 256).to(fp8.FP8),
                torch.zeros(3, 2),
            ),
            ValueError,
            "differ in K",
        ),
        (
            lambda: fp8.block_product(
                torch.zeros(2, 128).to(fp8.FP8),
                torch.zeros(2, 1),
                torch.zeros(3, 128).to(fp8.FP8),
                torch.zeros(3, 1),
            ),
            ValueError,
            r"scales must be \[M\] = \[2\]",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_no_rows_give_no_rows():
    """A call's A8 row set may be empty (a split step without prefill rows): empty in, empty out."""
    from a4prefill.ops.reference import moe_reference_a8
    from a4prefill.tools.tiny_layer import make_tiny_layer

    codes, scales = fp8.quantize_rows(torch.zeros(0, 256, dtype=torch.bfloat16))
    assert codes.shape == (0, 256) and scales.shape == (0,)
    layer = make_tiny_layer(2, 128, 128, 1, calibrated=False)
    weights, exponents = fp8.weights(layer.experts.w13_weight[0], layer.experts.w13_weight_scale[0])
    assert fp8.block_product(codes[:, :128], scales, weights, exponents).shape == (0, 256)
    empty = torch.zeros(0, 128, dtype=torch.bfloat16)
    routing = (torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.int32))
    assert moe_reference_a8(empty, *routing, layer.experts).shape == (0, 128)


@pytest.mark.parametrize("seed", [1, 2])
def test_the_a8_reference_moe_stays_within_fp8_error_of_the_exact_moe(seed):
    """``moe_reference_a8`` on a tiny calibrated layer: within 8% (relative L2) of the exact MoE
    of the NVFP4 weights (fp32 activations, W4A16 reference), where each e4m3 operand alone
    carries about 2-3% (half an e4m3 step, RMS), and less than half of A4's error on the same
    calls; less exact than W4A16 with bf16 activations. A factor applied to the wrong block or
    a lost exponent shift gives errors of order 1."""
    from a4prefill.ops.reference import moe_reference, moe_reference_a8
    from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing

    layer = make_tiny_layer(4, 256, 128, 2, seed=seed, calibration_tokens=64)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(64, 256, generator=generator).bfloat16()
    weights, ids = random_routing(64, 4, 2, generator)
    exact = moe_reference(hidden.float(), weights, ids, layer.experts, None).float()

    def error(output: torch.Tensor) -> float:
        return float((output.float() - exact).norm() / exact.norm())

    a8 = error(moe_reference_a8(hidden, weights, ids, layer.experts))
    a4 = error(moe_reference(hidden, weights, ids, layer.experts, layer.a4_scales))
    w4a16 = error(moe_reference(hidden, weights, ids, layer.experts, None))
    assert w4a16 < a8 < 0.08
    assert a8 < a4 / 2
