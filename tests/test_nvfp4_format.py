"""The NVFP4 format: bit-exactness, rounding, saturation, packing, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from a4prefill.ops import nvfp4

GRID = torch.tensor(nvfp4.E2M1_MAGNITUDES)


def _values(packed: torch.Tensor) -> torch.Tensor:
    return nvfp4.e2m1_code_values(nvfp4.unpack_nibbles(packed))


@st.composite
def blocks(draw, max_rows: int = 4, max_blocks: int = 3):
    rows = draw(st.integers(1, max_rows))
    num_blocks = draw(st.integers(1, max_blocks))
    magnitude = draw(st.sampled_from([1e-4, 1e-2, 1.0, 30.0, 1e3]))
    values = draw(hnp.arrays(np.float32, (rows, num_blocks * 16), elements=st.floats(-3, 3, width=32)))
    x = torch.from_numpy(values) * magnitude
    if draw(st.booleans()):
        x[0, :16] = 0.0
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    encode_scale = (
        draw(st.floats(0.05, 20.0)) * nvfp4.E2M1_MAX * nvfp4.E4M3_MAX / float(x.abs().max().clamp(min=1e-6))
    )
    return x.to(dtype), encode_scale


def test_quantizer_is_bit_exact_with_vllm_reference():
    emulation = pytest.importorskip(
        "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils",
        reason="vLLM (the named reference) is installed by scripts/setup.sh",
    )
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for trial in range(10):
            spread = 10.0 ** torch.randint(-3, 3, (32, 1), generator=generator).float()
            x = (torch.randn(32, 128, generator=generator) * spread).to(dtype)
            x[1, 16:32] = 0
            gs = torch.tensor([2688.0 / float(x.float().abs().max()) * (0.2 + trial)], dtype=torch.float32)
            ref_values, ref_scales = emulation.ref_nvfp4_quant(x, gs, 16)
            packed, scales = nvfp4.quantize(x, gs)
            assert torch.equal(scales.float(), ref_scales)
            assert torch.equal(_values(packed), ref_values)


@given(blocks())
def test_round_trip_stays_within_half_a_code_step(case):
    x, encode_scale = case
    packed, scales = nvfp4.quantize(x, encode_scale)
    restored = nvfp4.dequantize(packed, scales, encode_scale)
    multiplier = (scales.float() / encode_scale).repeat_interleave(16, dim=1)
    target = (x.float() / torch.where(multiplier > 0, multiplier, 1.0)).clamp(-6, 6)
    # Half the gap between the grid values around each element: 0.25 below 2, 0.5 below 4, 1 above.
    half_step = torch.where(target.abs() < 2, 0.25, torch.where(target.abs() < 4, 0.5, 1.0))
    bound = half_step * multiplier * (1 + 1e-5) + 1e-30
    beyond = x.float().abs() > 6 * multiplier * (1 + 1e-5)
    within_grid = ((x.float() - restored).abs() <= bound) | beyond | (multiplier == 0)
    assert bool(within_grid.all())
    # Elements beyond the grid (saturated, or a block scale rounded down) land on +-6 * multiplier.
    assert torch.equal(restored[beyond].abs(), (6 * multiplier)[beyond])


@given(blocks())
def test_codes_are_valid_and_zero_is_never_negative(case):
    x, encode_scale = case
    packed, scales = nvfp4.quantize(x, encode_scale)
    codes = nvfp4.unpack_nibbles(packed)
    assert packed.dtype == torch.uint8 and packed.shape == (x.shape[0], x.shape[1] // 2)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (x.shape[0], x.shape[1] // 16)
    assert bool((codes < 16).all()) and not bool((codes == 8).any())
    assert bool((scales.float() >= 0).all()) and bool(torch.isfinite(scales.float()).all())


def test_zero_block_gets_zero_scale_and_zero_codes():
    x = torch.zeros(2, 32)
    x[1, 16:] = torch.linspace(-3, 3, 16)
    packed, scales = nvfp4.quantize(x, 100.0)
    assert scales.float()[0].tolist() == [0.0, 0.0] and scales.float()[1, 0] == 0.0
    assert bool((nvfp4.unpack_nibbles(packed)[:, :16] == 0).all())
    assert bool((nvfp4.unpack_nibbles(packed)[0] == 0).all())


def test_saturation_clamps_scale_at_448_and_values_at_6():
    x = torch.full((1, 16), 1e6)
    x[0, 1] = -1e6
    packed, scales = nvfp4.quantize(x, 1.0)
    assert scales.float().item() == 448.0
    assert nvfp4.dequantize(packed, scales, 1.0).flatten()[:2].tolist() == [6 * 448.0, -6 * 448.0]


def test_ties_resolve_to_the_even_code():
    # Block amax 6 with encode scale 1 gives block scale 1, so elements are rounded as they are.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    row = torch.tensor([6.0, *ties, *(-t for t in ties), 0.0])
    packed, scales = nvfp4.quantize(row.reshape(1, 16), 1.0)
    assert scales.float().item() == 1.0
    values = _values(packed).flatten().tolist()
    assert values[1:8] == expected
    assert values[8:15] == [-v for v in expected]


@given(
    codes=st.lists(st.integers(0, 15).filter(lambda c: c != 8), min_size=15, max_size=15),
    six_position=st.integers(0, 15),
    six_sign=st.sampled_from([7, 15]),
    scale_bits=st.integers(0x08, 0x7E),
    encode_scale=st.floats(1e-3, 1e4),
)
def test_requantizing_a_dequantized_block_with_a_six_gives_the_same_codes(
    codes, six_position, six_sign, scale_bits, encode_scale
):
    codes = [*codes[:six_position], six_sign, *codes[six_position:]]
    code_tensor = torch.tensor(codes, dtype=torch.uint8).reshape(1, 16)
    scales = torch.tensor([[scale_bits]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    packed = nvfp4.pack_nibbles(code_tensor)
    block = nvfp4.dequantize(packed, scales, encode_scale)
    repacked, rescales = nvfp4.quantize(block, encode_scale)
    assert torch.equal(rescales.view(torch.uint8), scales.view(torch.uint8))
    # Zero codes may come back with the sign of the dequantized zero dropped: compare values.
    assert torch.equal(_values(repacked), _values(packed))


def test_pack_puts_the_even_index_in_the_low_nibble():
    packed = nvfp4.pack_nibbles(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x0F]]
    assert nvfp4.unpack_nibbles(packed).tolist() == [[1, 2, 15, 0]]


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda c: len(c) % 2 == 0))
def test_pack_unpack_round_trip(codes):
    tensor = torch.tensor(codes, dtype=torch.uint8)
    assert torch.equal(nvfp4.unpack_nibbles(nvfp4.pack_nibbles(tensor)), tensor)


@pytest.mark.parametrize(
    ("x", "scale", "error", "message"),
    [
        (torch.randn(2, 24), 1.0, ValueError, "multiple of 16"),
        (torch.randint(0, 5, (2, 16)), 1.0, TypeError, "bfloat16, float16 or float32"),
        (torch.randn(32), 1.0, ValueError, "2-D"),
        (torch.randn(2, 16), math.inf, ValueError, "finite"),
        (torch.randn(2, 16), float("nan"), ValueError, "finite"),
        (torch.randn(2, 16), 0.0, ValueError, "> 0"),
        (torch.randn(2, 16), torch.tensor([1.0, 2.0]), ValueError, "one element"),
    ],
)
def test_quantize_rejects_bad_input_with_a_clear_error(x, scale, error, message):
    with pytest.raises(error, match=message):
        nvfp4.quantize(x, scale)


def test_dequantize_rejects_mismatched_block_scales():
    packed, scales = nvfp4.quantize(torch.randn(2, 32), 1.0)
    with pytest.raises(ValueError, match="block_scales shape"):
        nvfp4.dequantize(packed, scales[:, :1], 1.0)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        nvfp4.dequantize(packed, scales.float(), 1.0)


def test_the_layout_accessor_views_the_modelopt_tensors_without_copying():
    """``ExpertGemm`` (``NvFp4Experts.fc1``/``fc2``) hands out the loaded tensors and views of
    their storage: the kernels' int32 code words hold column ``8w + i`` in bits ``4i``, the
    uint16 scale pairs the first block in the low byte, and ``dequantized_blocks`` is the
    reference dequantization."""
    from a4prefill.ops import nvfp4
    from a4prefill.tools.tiny_layer import make_tiny_layer

    experts = make_tiny_layer(3, 64, 32, 2, seed=1, calibration_tokens=8).experts
    for gemm, codes, scales, scale_2 in (
        (experts.fc1, experts.w13_weight, experts.w13_weight_scale, experts.w13_weight_scale_2),
        (experts.fc2, experts.w2_weight, experts.w2_weight_scale, experts.w2_weight_scale_2),
    ):
        assert gemm.codes is codes and gemm.block_scales is scales and gemm.scale_2 is scale_2
        assert (gemm.experts, gemm.rows, gemm.columns) == (codes.shape[0], codes.shape[1], 2 * codes.shape[2])
        assert gemm.code_words().untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
        for view in (gemm.scale_bytes(), gemm.scale_pairs()):
            assert view.untyped_storage().data_ptr() == scales.untyped_storage().data_ptr()
        words = gemm.code_words().to(torch.int64) & 0xFFFFFFFF
        nibble = (words[..., None] >> (4 * torch.arange(8))) & 15  # [E, N, K/8, 8]
        low, high = codes & 15, codes >> 4
        assert torch.equal(nibble.flatten(-2), torch.stack((low, high), dim=-1).flatten(-2).long())
        pairs = gemm.scale_pairs().to(torch.int64)
        assert torch.equal(pairs & 255, gemm.scale_bytes()[..., 0::2].long())
        assert torch.equal(pairs >> 8, gemm.scale_bytes()[..., 1::2].long())
        assert torch.equal(gemm.dequantized_blocks(1), nvfp4.dequantize_blocks(codes[1], scales[1]))
