"""A tiny interpreter for the PTX subset of the kernels' inline assembly (tests only).

Runs ``numerics.SCALE_PAIR_FACTORS_ASM``, ``SCALE_BYTES_FACTORS_ASM``, ``BYTE_DEQUANT_ASM``,
``WORD_PAIR_DEQUANT_ASM``, ``decode_asm.CODES_ASM``, ``WORD_CODES_ASM`` and
``prefill_a8_kernels.A8_WEIGHT_ASM`` bit for bit on the CPU: 32-bit integer ops (``mov``, ``and``,
``or``, ``shl``, ``shr``), ``prmt.b32`` (default mode: selector nibble ``i`` picks
byte ``nibble & 7`` of ``{b, a}`` for output byte ``i``, or with the nibble's bit 3 set that byte's
sign bit replicated over all 8 bits), the unpacking ``mov.b32 {lo, hi}, x`` and packing ``mov.b32
x, {lo, hi}`` (two 16-bit halves), ``fma.rn.bf16x2`` (each half: the exact product plus addend,
rounded to nearest even bf16, subnormals kept), ``mov.f32`` and ``mul.rn.f32`` (refused where the
fp32 product is not exact: the subset meets only exact ones) and ``cvt.rn.satfinite.e4m3x2.f32 d,
a, b`` (``a`` to the high byte of the 16-bit ``d``, ``b`` to the low one; nearest even, saturating
to +-448). Float immediates are PTX's ``0fXXXXXXXX`` (fp32 bits). Operands ``$N`` are the asm's
inputs and outputs as uint32 (16-bit outputs of the unpacking: uint16), either Python ints or int64
torch tensors of one shape (every element one execution of the asm).

Tensors run as numpy int64 arrays inside (the interpreter calls this once per asm and program,
on a few hundred elements: per-operation overhead is what costs), and each asm is parsed once.
"""

from __future__ import annotations

import functools
import re
import struct
from typing import Any

import numpy as np
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


def _exact_fp32_bits(values: np.ndarray, what: str) -> np.ndarray:
    """float64 array -> int64 fp32 bit patterns; raises where fp32 would round (or a NaN)."""
    single = values.astype(np.float32)
    if not np.array_equal(single.astype(np.float64), values):
        raise ValueError(f"{what}: a value is not exact in fp32")
    return single.view(np.uint32).astype(np.int64)


with np.errstate(invalid="ignore"):  # the NaN patterns among the 65536
    BF16_VALUES = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)
"""The value of every bf16 bit pattern (index), as float64."""


def _fma_bf16x2(a: Any, b: Any, c: Any) -> Any:
    if not any(isinstance(v, np.ndarray) for v in (a, b, c)):
        halves = []
        for shift in (0, 16):
            x, y, z = ((v >> shift) & 0xFFFF for v in (a, b, c))
            halves.append(float_to_bf16(bf16_to_float(x) * bf16_to_float(y) + bf16_to_float(z)))
        return halves[0] | (halves[1] << 16)
    result = 0
    for shift in (0, 16):  # the low half, then the high one
        x, y, z = (BF16_VALUES[(v >> shift) & 0xFFFF] for v in (a, b, c))
        bits = _exact_fp32_bits(x * y + z, "fma.rn.bf16x2 (the bf16 rounding would round twice)")
        result = result | ((((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF) << shift)
    return result


def _prmt(a: Any, b: Any, selector: Any) -> Any:
    """``prmt.b32`` default mode: output byte ``i`` is byte ``n & 7`` of the 8 bytes ``a`` (0..3),
    ``b`` (4..7), ``n`` the selector's nibble ``i`` (its low 16 bits); where ``n & 8``, that byte's
    bit 7 replicated over the 8 bits instead (0x00 or 0xFF). Ints or int64 arrays."""
    result = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        from_b, shift = (nibble >> 2) & 1, 8 * (nibble & 3)
        byte = ((a >> shift) & 0xFF) * (1 - from_b) + ((b >> shift) & 0xFF) * from_b
        replicated = ((byte >> 7) & 1) * 0xFF
        chosen = byte + ((nibble >> 3) & 1) * (replicated - byte)  # select without a branch
        result = result | (chosen << (8 * i))
    return result


def _f32(bits: Any) -> Any:
    """fp32 value(s) of 32-bit pattern(s): a float, or a float64 array."""
    if isinstance(bits, np.ndarray):
        return (bits & MASK).astype(np.uint32).view(np.float32).astype(np.float64)
    return struct.unpack("<f", struct.pack("<I", bits & MASK))[0]


def _f32_bits(values: Any) -> Any:
    """fp32 bits of exact fp32 value(s); raises where the value would round."""
    if isinstance(values, np.ndarray):
        return _exact_fp32_bits(values, "mul.rn.f32 (the subset meets exact products only)")
    bits = struct.unpack("<I", struct.pack("<f", values))[0]
    if _f32(bits) != values:
        raise ValueError(f"mul.rn.f32: {values!r} is not exact in fp32")
    return bits


def _e4m3_bits(values: Any) -> Any:
    """e4m3 byte(s) of fp32 value(s): nearest even, saturating to +-448 (``satfinite``)."""
    tensor = torch.as_tensor(values, dtype=torch.float64).float().clamp(-448.0, 448.0)
    bits = tensor.to(torch.float8_e4m3fn).view(torch.uint8).long()
    return bits.numpy() if isinstance(values, np.ndarray) else int(bits)


# A parsed statement: ("unpack", (low, high, source)), ("pack", (dest, low, high)) or
# (opcode, (dest, *sources)); a source is a register name (str) or an immediate (int).
Statement = tuple[str, tuple[Any, ...]]


def _operand(token: str) -> str | int:
    token = token.strip()
    if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", token):
        return int(token, 0) & MASK
    if re.fullmatch(r"0f[0-9a-fA-F]{8}", token):
        return int(token[2:], 16)
    return token


@functools.cache
def _parse(asm: str) -> tuple[Statement, ...]:
    body = asm.strip().removeprefix("{").removesuffix("}")
    statements: list[Statement] = []
    for statement in (s.strip() for s in body.split(";")):
        if not statement or statement.startswith(".reg"):
            continue
        opcode, _, rest = statement.partition(" ")
        unpack = re.fullmatch(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)", rest.strip())
        pack = re.fullmatch(r"(\S+)\s*,\s*\{\s*(\S+)\s*,\s*(\S+)\s*\}", rest.strip())
        if opcode == "mov.b32" and unpack:
            low, high, source = unpack.groups()
            statements.append(("unpack", (low, high, _operand(source))))
        elif opcode == "mov.b32" and pack:
            dest, low, high = pack.groups()
            statements.append(("pack", (dest, _operand(low), _operand(high))))
        elif opcode not in _OPCODES:
            raise NotImplementedError(f"opcode {opcode!r} is not in the interpreted subset")
        else:
            dest, *sources = (a.strip() for a in rest.split(","))
            statements.append((opcode, (dest, *(_operand(a) for a in sources))))
    return tuple(statements)


_OPCODES: dict[str, Any] = {
    "mov.b32": lambda a: a,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "shl.b32": lambda a, b: (a << b) & MASK,
    "shr.b32": lambda a, b: a >> b,
    "prmt.b32": _prmt,
    "fma.rn.bf16x2": _fma_bf16x2,
    "mov.f32": lambda a: a,
    "mul.rn.f32": lambda a, b: _f32_bits(_f32(a) * _f32(b)),
    "cvt.rn.satfinite.e4m3x2.f32": lambda a, b: (_e4m3_bits(_f32(a)) << 8) | _e4m3_bits(_f32(b)),
}


def run(asm: str, operands: dict[int, Any]) -> dict[int, Any]:
    """Execute ``asm`` (one ``{ ... }`` block) with ``$N`` operands; returns every ``$N`` after."""
    registers: dict[str, Any] = {}
    for n, value in operands.items():
        if isinstance(value, torch.Tensor):
            value = value.numpy().astype(np.int64)
        registers[f"${n}"] = value & MASK

    def value(source: str | int) -> Any:
        if isinstance(source, int):
            return source
        if source not in registers:
            raise KeyError(f"unknown operand {source!r}")
        return registers[source]

    for opcode, arguments in _parse(asm):
        if opcode == "unpack":
            low, high, source = arguments
            registers[low], registers[high] = value(source) & 0xFFFF, value(source) >> 16
        elif opcode == "pack":
            dest, low, high = arguments
            registers[dest] = (value(low) & 0xFFFF) | ((value(high) & 0xFFFF) << 16)
        else:
            dest, *sources = arguments
            registers[dest] = _OPCODES[opcode](*(value(s) for s in sources))
    return {
        int(name[1:]): torch.from_numpy(v) if isinstance(v, np.ndarray) else v
        for name, v in registers.items()
        if name.startswith("$")
    }
