"""A tiny interpreter for the PTX subset of the kernels' inline assembly (tests only).

Runs ``decode_asm.FACTOR_ASM``, ``CODES_ASM``, ``WORD_CODES_ASM``, ``numerics.BYTE_DEQUANT_ASM``
and ``prefill_a8_kernels.A8_WEIGHT_ASM`` bit for bit on the CPU: 32-bit integer ops (``mov``,
``and``, ``or``, ``shl``, ``shr``, ``mul.hi``/``mul.lo``/``mad.lo`` ``.u32``), ``prmt.b32``
(default mode: selector nibble ``i`` picks byte ``nibble & 7`` of ``{b, a}`` for output byte
``i``, or with the nibble's bit 3 set that byte's sign bit replicated over all 8 bits), the
unpacking ``mov.b32 {lo, hi}, x`` and packing ``mov.b32 x, {lo, hi}`` (two 16-bit halves),
``fma.rn.bf16x2`` (each half: the exact product plus addend, rounded to nearest even bf16,
subnormals kept), ``mov.f32`` and ``mul.rn.f32`` (refused where the fp32 product is not exact:
the subset meets only exact ones) and ``cvt.rn.satfinite.e4m3x2.f32 d, a, b`` (``a`` to the high
byte of the 16-bit ``d``, ``b`` to the low one; nearest even, saturating to +-448). Float
immediates are PTX's ``0fXXXXXXXX`` (fp32 bits). Operands
``$N`` are the asm's inputs and outputs as uint32 (16-bit outputs of the unpacking: uint16), either
Python ints or int64 torch tensors of one shape (every element one execution of the asm).
"""

from __future__ import annotations

import re
import struct
from typing import Any

import torch

MASK = 0xFFFFFFFF


def bf16_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def float_to_bf16(value: float) -> int:
    """Round ``value`` to bf16 bits, nearest even (exact for values with <= 24 significant bits
    in the fp32 range, which is all this interpreter meets)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if struct.unpack("<f", struct.pack("<I", bits))[0] != value:
        raise ValueError(f"{value!r} is not exact in fp32: the bf16 rounding would round twice")
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """int64 tensor of bf16 bit patterns -> float64 values."""
    return ((bits & 0xFFFF) << 16).to(torch.int32).view(torch.float32).double()


def _float_to_bf16_bits(values: torch.Tensor) -> torch.Tensor:
    """float64 tensor -> int64 bf16 bits, nearest even; raises where fp32 would round first."""
    single = values.float()
    if not torch.equal(single.double(), values):
        raise ValueError("a value is not exact in fp32: the bf16 rounding would round twice")
    bits = single.view(torch.int32).long() & MASK
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _fma_bf16x2(a: Any, b: Any, c: Any) -> Any:
    if not any(isinstance(v, torch.Tensor) for v in (a, b, c)):
        halves = []
        for shift in (0, 16):
            x, y, z = ((v >> shift) & 0xFFFF for v in (a, b, c))
            halves.append(float_to_bf16(bf16_to_float(x) * bf16_to_float(y) + bf16_to_float(z)))
        return halves[0] | (halves[1] << 16)
    a, b, c = torch.broadcast_tensors(*(torch.as_tensor(v, dtype=torch.int64) for v in (a, b, c)))
    out = torch.zeros_like(a)
    for shift in (0, 16):
        x, y, z = (_bf16_bits_to_float(v >> shift) for v in (a, b, c))
        out |= _float_to_bf16_bits(x * y + z) << shift
    return out


def _mul_hi(a: Any, b: Any) -> Any:
    """High 32 bits of the 64-bit product, exact also for int64 tensors (products < 2**48)."""
    return (((a >> 16) * b) + (((a & 0xFFFF) * b) >> 16)) >> 16


def _prmt(a: Any, b: Any, selector: Any) -> Any:
    """``prmt.b32`` default mode: output byte ``i`` is byte ``n & 7`` of the 8 bytes ``a`` (0..3),
    ``b`` (4..7), ``n`` the selector's nibble ``i`` (its low 16 bits); where ``n & 8``, that byte's
    bit 7 replicated over the 8 bits instead (0x00 or 0xFF). Ints or int64 tensors."""
    both = (a & MASK) | ((b & MASK) << 32)
    result = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (both >> (8 * (nibble & 7))) & 0xFF
        replicated = ((byte >> 7) & 1) * 0xFF
        chosen = byte + ((nibble >> 3) & 1) * (replicated - byte)  # select without a branch
        result = result | (chosen << (8 * i))
    return result


def _f32(bits: Any) -> Any:
    """fp32 value(s) of 32-bit pattern(s): a float, or a float64 tensor."""
    if isinstance(bits, torch.Tensor):
        return (bits & MASK).to(torch.int64).to(torch.int32).view(torch.float32).double()
    return struct.unpack("<f", struct.pack("<I", bits & MASK))[0]


def _f32_bits(values: Any) -> Any:
    """fp32 bits of exact fp32 value(s); raises where the value would round."""
    if isinstance(values, torch.Tensor):
        single = values.float()
        if not torch.equal(single.double(), values):
            raise ValueError("mul.rn.f32: a product is not exact in fp32 (the subset meets exact ones only)")
        return single.view(torch.int32).long() & MASK
    bits = struct.unpack("<I", struct.pack("<f", values))[0]
    if _f32(bits) != values:
        raise ValueError(f"mul.rn.f32: {values!r} is not exact in fp32")
    return bits


def _e4m3_bits(values: Any) -> Any:
    """e4m3 byte(s) of fp32 value(s): nearest even, saturating to +-448 (``satfinite``)."""
    tensor = torch.as_tensor(values, dtype=torch.float64).float().clamp(-448.0, 448.0)
    bits = tensor.to(torch.float8_e4m3fn).view(torch.uint8).long()
    return bits if isinstance(values, torch.Tensor) else int(bits)


def run(asm: str, operands: dict[int, Any]) -> dict[int, Any]:
    """Execute ``asm`` (one ``{ ... }`` block) with ``$N`` operands; returns every ``$N`` after."""
    registers: dict[str, Any] = {f"${n}": value & MASK for n, value in operands.items()}

    def value(token: str) -> Any:
        token = token.strip()
        if token in registers:
            return registers[token]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", token):
            return int(token, 0) & MASK
        if re.fullmatch(r"0f[0-9a-fA-F]{8}", token):
            return int(token[2:], 16)
        raise KeyError(f"unknown operand {token!r}")

    body = asm.strip().removeprefix("{").removesuffix("}")
    for statement in (s.strip() for s in body.split(";")):
        if not statement or statement.startswith(".reg"):
            continue
        opcode, _, rest = statement.partition(" ")
        unpack = re.fullmatch(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)", rest.strip())
        if opcode == "mov.b32" and unpack:
            low, high, source = unpack.groups()
            registers[low], registers[high] = value(source) & 0xFFFF, value(source) >> 16
            continue
        pack = re.fullmatch(r"(\S+)\s*,\s*\{\s*(\S+)\s*,\s*(\S+)\s*\}", rest.strip())
        if opcode == "mov.b32" and pack:
            dest, low, high = pack.groups()
            registers[dest] = (value(low) & 0xFFFF) | ((value(high) & 0xFFFF) << 16)
            continue
        args = [a.strip() for a in rest.split(",")]
        dest, sources = args[0], [value(a) for a in args[1:]]
        if opcode == "mov.b32":
            result = sources[0]
        elif opcode == "and.b32":
            result = sources[0] & sources[1]
        elif opcode == "or.b32":
            result = sources[0] | sources[1]
        elif opcode == "shl.b32":
            result = (sources[0] << sources[1]) & MASK
        elif opcode == "shr.b32":
            result = sources[0] >> sources[1]
        elif opcode == "mul.hi.u32":
            result = _mul_hi(sources[0], sources[1])
        elif opcode == "mul.lo.u32":
            result = (sources[0] * sources[1]) & MASK
        elif opcode == "mad.lo.u32":
            result = (sources[0] * sources[1] + sources[2]) & MASK
        elif opcode == "prmt.b32":
            result = _prmt(*sources)
        elif opcode == "fma.rn.bf16x2":
            result = _fma_bf16x2(*sources)
        elif opcode == "mov.f32":
            result = sources[0]
        elif opcode == "mul.rn.f32":
            result = _f32_bits(_f32(sources[0]) * _f32(sources[1]))
        elif opcode == "cvt.rn.satfinite.e4m3x2.f32":
            result = (_e4m3_bits(_f32(sources[0])) << 8) | _e4m3_bits(_f32(sources[1]))
        else:
            raise NotImplementedError(f"opcode {opcode!r} is not in the interpreted subset")
        registers[dest] = result
    return {int(name[1:]): v for name, v in registers.items() if name.startswith("$")}
