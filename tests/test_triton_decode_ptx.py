"""The decode kernels' inline PTX and the scale factors' PTX they share with the prefill kernels,
interpreted bit for bit on the CPU (``ptx_subset``): every e4m3 scale byte and every e2m1 code in
every nibble position against the format tables, and the nibble order the K relabelling
(``logical_to_physical``) is built on.

Expected values come from torch's float8_e4m3fn decoding and the e2m1 table below, not from the
package."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from helpers.markers import needs_gluon
from helpers.ptx_subset import bf16_to_float, float_to_bf16, run

pytestmark = needs_gluon

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
NAN_BYTES = (0x7F, 0xFF)


def e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def factor_of(byte: int) -> int:
    """The bf16 factor SCALE_PAIR_FACTORS_ASM decodes from ``byte`` (as the low byte of a pair)."""
    from a4prefill.ops.backends.triton.numerics import SCALE_PAIR_FACTORS_ASM

    return run(SCALE_PAIR_FACTORS_ASM.value, {2: byte})[0]


def _expected_factor_bits(byte: int) -> int:
    # the NaN bytes decode as +-480 (documented in docs/numerics.md)
    expected = {0x7F: 480.0, 0xFF: -480.0}.get(byte, e4m3(byte) if byte not in NAN_BYTES else 0.0)
    return float_to_bf16(expected * 2.0**119)


def test_every_pair_of_scale_bytes_decodes_to_the_e4m3_values_times_2_119():
    """All 65536 pairs ``(low, high)`` of a uint16 at once: each half is its own byte's factor."""
    from a4prefill.ops.backends.triton.numerics import SCALE_PAIR_FACTORS_ASM

    pairs = torch.arange(65536, dtype=torch.int64)
    out = run(SCALE_PAIR_FACTORS_ASM.value, {2: pairs})
    table = torch.tensor([_expected_factor_bits(b) for b in range(256)], dtype=torch.int64)
    assert torch.equal(out[0], table[pairs & 0xFF])
    assert torch.equal(out[1], table[pairs >> 8])


@pytest.mark.parametrize("extension", ["zero", "sign"])
def test_every_two_scale_bytes_in_two_registers_decode_to_one_bf16x2_of_their_factors(extension):
    """The prefill kernels' form (``SCALE_BYTES_FACTORS_ASM``): all 65536 pairs of bytes, each in
    the low byte of its own 32-bit register, zero- or sign-extended (the kernels load them as
    uint8 or int8): the low half of the result is the first byte's factor, the high half the
    second's, and the extension bits change nothing."""
    from a4prefill.ops.backends.triton.numerics import SCALE_BYTES_FACTORS_ASM

    pairs = torch.arange(65536, dtype=torch.int64)
    first, second = pairs & 0xFF, pairs >> 8

    def extended(byte: torch.Tensor) -> torch.Tensor:
        return byte if extension == "zero" else torch.where(byte >= 0x80, byte | 0xFFFFFF00, byte)

    out = run(SCALE_BYTES_FACTORS_ASM.value, {1: extended(first), 2: extended(second)})[0]
    table = torch.tensor([_expected_factor_bits(b) for b in range(256)], dtype=torch.int64)
    assert torch.equal(out & 0xFFFF, table[first])
    assert torch.equal(out >> 16, table[second])


# The two forms of numerics.word_pair_dequant_lines: the decode kernels' (its factor a bf16 in
# $5, used in both halves) and the prefill consumers' (the factor already in both halves of $5)
WORD_PAIR_FORMS = ("decode CODES_ASM", "prefill WORD_PAIR_DEQUANT_ASM")


def _codes_outputs(word: int, factor: int, form: str = WORD_PAIR_FORMS[0]) -> list[int]:
    """The 8 bf16 results of ``form``, in output order: $0 low/high, $1 low/high, ..."""
    from a4prefill.ops.backends.triton.decode_asm import CODES_ASM
    from a4prefill.ops.backends.triton.numerics import WORD_PAIR_DEQUANT_ASM

    if form == WORD_PAIR_FORMS[0]:
        out = run(CODES_ASM.value, {4: word, 5: factor})
    else:
        out = run(WORD_PAIR_DEQUANT_ASM.value, {4: word, 5: factor | factor << 16})
    return [(out[n] >> shift) & 0xFFFF for n in range(4) for shift in (0, 16)]


@functools.cache
def _nibble_order(form: str = WORD_PAIR_FORMS[0]) -> list[int]:
    """Which nibble of the code word lands in each of the 8 results of ``form`` (found by
    probing)."""
    factor = factor_of(0x38)  # scale 1.0
    order = []
    for slot in range(8):
        (nibble,) = [
            n for n in range(8) if _codes_outputs(1 << (4 * n), factor, form)[slot] != float_to_bf16(0.0)
        ]  # code 1 = 0.5 in nibble n only
        order.append(nibble)
    return order


@pytest.mark.parametrize("form", WORD_PAIR_FORMS)
def test_the_outputs_hold_the_documented_nibbles(form):
    """$0 = (n0, n4), $1 = (n1, n5), $2 = (n2, n6), $3 = (n3, n7): half s=0 is $0 and $1."""
    assert _nibble_order(form) == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("form", WORD_PAIR_FORMS)
@pytest.mark.parametrize("scale_byte", [b for b in range(256) if b not in NAN_BYTES])
def test_every_code_in_every_nibble_is_e2m1_times_scale_times_2_minus_7(scale_byte, form):
    factor = factor_of(scale_byte)
    scale = e4m3(scale_byte)
    order = _nibble_order(form)
    generator = random.Random(scale_byte)
    for code in range(16):
        for position in range(8):
            nibbles = [generator.randrange(16) for _ in range(8)]
            nibbles[position] = code
            word = sum(n << (4 * i) for i, n in enumerate(nibbles))
            results = _codes_outputs(word, factor, form)
            for slot, nibble in enumerate(order):
                expected = float_to_bf16(E2M1[nibbles[nibble]] * scale * 2.0**-7)
                assert results[slot] == expected, (hex(word), slot, bf16_to_float(results[slot]))


def test_the_k_relabelling_follows_the_simulated_nibble_order():
    """Slot ``16 (2 h + s) + 4 c + p`` is lane group c's byte group h, half s, element p; the
    element-to-nibble map is the one the PTX was just shown to produce."""
    from a4prefill.ops.backends.triton.decode_layouts import logical_to_physical

    order = _nibble_order()  # result index 4 s + p holds nibble order[4 s + p]
    expected = {}
    for lane_group in range(4):
        for byte_group in range(4):
            for half in range(2):
                for element in range(4):
                    slot = 16 * (2 * byte_group + half) + 4 * lane_group + element
                    expected[slot] = 32 * lane_group + 8 * byte_group + order[4 * half + element]
    assert [logical_to_physical(slot) for slot in range(128)] == [expected[s] for s in range(128)]
    assert sorted(expected.values()) == list(range(128))
