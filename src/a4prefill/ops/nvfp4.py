"""The NVFP4 format: quantize, dequantize, pack and unpack (pure torch, any device).

Layout (docs/numerics.md, section 2):

- codes: ``uint8 [M, K/2]``, two e2m1 nibbles per byte, the element with the even K index in
  the low nibble, bit 3 of a nibble is the sign; magnitudes ``{0, .5, 1, 1.5, 2, 3, 4, 6}``;
- block scales: ``float8_e4m3fn [M, K/16]``, one per 16 consecutive elements along K;
- one fp32 *encode* scale ``gs`` per tensor: ``x ~= e2m1 * block_scale / gs``.

The quantizer is bit-exact, codes and scales, with vLLM's ``ref_nvfp4_quant`` (the named
reference of the numerics contract); no other code in this package computes NVFP4 codes.
"""

from __future__ import annotations

import math

import torch

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Boundaries between consecutive e2m1 magnitudes and whether the boundary itself rounds up.
# Ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
_ROUNDING_BOUNDARIES = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def check_encode_scale(encode_scale: torch.Tensor | float, name: str = "encode_scale") -> torch.Tensor:
    """Return ``encode_scale`` as a one-element fp32 tensor; raise if it is not finite and > 0.

    Reads the value on the host (one device read for a CUDA tensor): call it at preparation
    time, never per step.
    """
    if isinstance(encode_scale, torch.Tensor):
        if encode_scale.numel() != 1:
            raise ValueError(f"{name} must hold one element, got shape {tuple(encode_scale.shape)}")
        value = float(encode_scale.detach().reshape(()).item())
        scale = encode_scale.detach().reshape(1).to(torch.float32)
    else:
        value = float(encode_scale)
        scale = torch.tensor([value], dtype=torch.float32)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return scale


def _check_float_matrix(x: torch.Tensor, name: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] % BLOCK_SIZE != 0:
        raise ValueError(f"{name}: K={x.shape[1]} must be a multiple of {BLOCK_SIZE}")


def round_to_e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """Round fp32 values already clamped to [-6, 6] to e2m1 codes (uint8 in [0, 15]).

    Ties resolve to the even code; a value that rounds to zero gets code 0 (never -0).
    """
    magnitude = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for boundary, tie_rounds_up in _ROUNDING_BOUNDARIES:
        above = magnitude >= boundary if tie_rounds_up else magnitude > boundary
        code += above.to(torch.uint8)
    negative = (values < 0) & (code > 0)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_code_values(codes: torch.Tensor) -> torch.Tensor:
    """Map unpacked e2m1 codes (uint8 in [0, 15]) to their fp32 values."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``uint8 [..., K]`` (values < 16, K even) into bytes ``uint8 [..., K/2]``."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes: last dimension {codes.shape[-1]} must be even")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``uint8 [..., K/2]`` into codes ``uint8 [..., K]`` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _reciprocal_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x == 0, torch.zeros_like(x), 1.0 / torch.where(x == 0, torch.ones_like(x), x))


def quantize_codes(x: torch.Tensor, encode_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` without argument checks; see :func:`quantize`.

    ``encode_scale`` is a one-element fp32 tensor on ``x.device`` (already validated). For the
    hot path of backends that have prepared their scales once. Returns unpacked codes
    ``uint8 [M, K]`` and block scales ``float8_e4m3fn [M, K/16]``.
    """
    m, k = x.shape
    blocks = x.reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    gs = encode_scale.reshape(())
    # Same operation order as the reference: gs * (amax * fp32(1/6)), clamp, then the cast.
    scale = gs * (block_amax * (1.0 / E2M1_MAX))
    scale = scale.clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
    multiplier = _reciprocal_or_zero(scale.to(torch.float32) * _reciprocal_or_zero(gs))
    scaled = (blocks.to(torch.float32) * multiplier).clamp(-E2M1_MAX, E2M1_MAX)
    codes = round_to_e2m1_codes(scaled.reshape(m, k))
    return codes, scale.reshape(m, k // BLOCK_SIZE)


def quantize(x: torch.Tensor, encode_scale: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [M, K]`` (bf16/fp16/fp32, K % 16 == 0) to NVFP4 with encode scale ``gs``.

    Returns packed codes ``uint8 [M, K/2]`` and block scales ``float8_e4m3fn [M, K/16]``.
    ``encode_scale`` must be finite and > 0 (a float or a one-element tensor).
    """
    _check_float_matrix(x, "x")
    gs = check_encode_scale(encode_scale).to(x.device)
    codes, scales = quantize_codes(x, gs)
    return pack_nibbles(codes), scales


def _scale_blocks(values: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    """``values [..., K]`` times fp32 per-block ``multipliers [..., K/16]``, in fp32."""
    k = values.shape[-1]
    if multipliers.shape[-1] * BLOCK_SIZE != k or multipliers.shape[:-1] != values.shape[:-1]:
        raise ValueError(
            f"block_scales shape {tuple(multipliers.shape)} does not match the codes: expected "
            f"{(*values.shape[:-1], k // BLOCK_SIZE)}"
        )
    blocks = values.reshape(*values.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)
    return (blocks * multipliers.unsqueeze(-1)).reshape(values.shape)


def _apply_block_multipliers(packed: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    return _scale_blocks(e2m1_code_values(unpack_nibbles(packed)), multipliers)


def quantize_dequantize_blocks(x: torch.Tensor, encode_scale: torch.Tensor) -> torch.Tensor:
    """``e2m1 * block_scale`` (fp32 [M, K]) of ``x [M, K]`` quantized with ``encode_scale``.

    What an FP4 x FP4 MMA consumes: the global scale is left for the epilogue. No checks
    (``encode_scale`` is a validated one-element fp32 tensor on ``x.device``).
    """
    codes, block_scales = quantize_codes(x, encode_scale)
    return _scale_blocks(e2m1_code_values(codes), block_scales.to(torch.float32))


def _check_block_scales(block_scales: torch.Tensor) -> None:
    if block_scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"block_scales must be float8_e4m3fn, got {block_scales.dtype}")


def dequantize_blocks(packed: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """``e2m1 * block_scale`` as fp32 ``[..., K]`` (exact; no global scale applied).

    ``packed`` is ``uint8 [..., K/2]``, ``block_scales`` is ``float8_e4m3fn [..., K/16]``.
    """
    _check_block_scales(block_scales)
    return _apply_block_multipliers(packed, block_scales.to(torch.float32))


def dequantize(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    encode_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize ``packed [M, K/2]`` / ``block_scales [M, K/16]`` to ``dtype [M, K]``.

    Computes ``e2m1 * (block_scale / gs)`` in fp32 (vLLM's order), then casts to ``dtype``.
    """
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    _check_block_scales(block_scales)
    gs = check_encode_scale(encode_scale).to(packed.device).reshape(())
    return _apply_block_multipliers(packed, block_scales.to(torch.float32) / gs).to(dtype)
