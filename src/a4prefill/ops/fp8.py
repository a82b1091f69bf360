"""FP8 (float8_e4m3fn) operands of the A8 prefill rows: the format half of docs/numerics.md,
section 8, in plain torch (the oracle the A8 kernels will be tested against; issue 28).

The weights of an A8 GEMM are cut along K (the reduction dimension) into blocks of
:data:`A8_BLOCK` columns, each block of a weight row carrying a power of two; each activation row
carries one fp32 factor:

- **Activations** (:func:`quantize_rows`): per row, ``a = max(amax, 2**-100)`` with ``amax``
  the largest magnitude of the row's values (the floor keeps ``448 / a`` finite: bf16 and fp32
  reach ``2**-133`` and ``2**-149``); multiplier ``r = 448 / a`` (fp32, round to nearest), codes
  ``e4m3(clamp(x * r, -448, 448))`` (the fp32 product, then round to nearest even), decode scale
  ``s = a / 448`` (fp32). A row of zeros gets ``s = 0`` and zero codes. Dynamic: no calibration
  is read. (Per 128-column block until 2026-12-05: one factor per row lets a kernel promote each
  block by the weight row's power of two alone, one fused multiply-add an output, and apply
  ``s`` once; e4m3 keeps its relative precision over 2**15, so only values that far below the
  row's largest lose bits.)
- **Weights** (:func:`weights`): per row and block, the exponent ``p``, the smallest integer with
  ``6 * m <= 448 * 2**p`` where ``m`` is the block's largest ``|block_scale|`` (``p = 0`` for an
  all-zero block); FP8 weights ``e4m3(e2m1 * block_scale * 2**-p)`` (round to nearest even;
  never above 448, so never saturated). ``2**-p`` is a power of two, so a product of at most 4
  significant bits that lands in e4m3's normal range (``>= 2**-6``) is kept exactly; products
  with 5 significant bits (codes 1.5, 3, 6 times a scale mantissa 1.001, 1.011, 1.101, 1.110,
  1.111 in binary) are rounded, and values far below the block's largest (groups whose scale is
  much smaller than the block's largest) lose bits in e4m3's subnormal range or become 0.
- **Product** (:func:`block_product`): ``acc[m, n] = s[m] * (sum over blocks b, in ascending
  order, of partial[m, n, b] * 2**p[n, b])``, the sum in fp32, where ``partial`` is the FP8 x
  FP8 dot product of the block (exact products, fp32 sums here; the Hopper tensor cores sum with
  less precision inside a block, which is why each block is promoted to fp32 on its own).

Who may call: the reference MoE, tests, the A8 kernels' tests. Any device; no host sync.
"""

from __future__ import annotations

import torch

from a4prefill.ops import nvfp4

A8_BLOCK = 128
A8_READY = "A8 (dynamic scales)"  # a layer's load-time status when its prefill rows may run A8
E4M3_MAX = 448.0
AMAX_FLOOR = 2.0**-100
FP8 = torch.float8_e4m3fn


def a8_shape_reason(hidden: int, intermediate: int) -> str | None:
    """Why a layer of hidden size ``hidden`` and intermediate size ``intermediate`` cannot run
    A8 (both GEMMs' K must be multiples of :data:`A8_BLOCK`), or None if it can."""
    if hidden % A8_BLOCK or intermediate % A8_BLOCK:
        return (
            f"A8 needs hidden size H={hidden} and intermediate size I={intermediate} to be "
            f"multiples of {A8_BLOCK}"
        )
    return None


def _check_blocks(k: int, name: str) -> None:
    if k % A8_BLOCK != 0:
        raise ValueError(f"{name}: K={k} must be a multiple of {A8_BLOCK} for A8")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16, fp16 or fp32; K a multiple of :data:`A8_BLOCK`) -> ``(codes
    float8_e4m3fn [M, K], scales fp32 [M])``: each row's values are ``codes * scale`` up to the
    e4m3 rounding (module docstring)."""
    if x.dtype not in nvfp4.FLOAT_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    _check_blocks(x.shape[1], "x")
    values = x.to(torch.float32)
    amax = values.abs().amax(dim=1) if x.shape[1] else values.new_zeros(x.shape[0])
    floored = amax.clamp(min=AMAX_FLOOR)
    # tensors divided by tensors: IEEE divisions on every device (``448 / tensor`` is a reciprocal
    # and a product; a CUDA tensor divided by a Python number, a product by its reciprocal)
    e4m3_max = torch.full_like(floored, E4M3_MAX)
    multiplier = e4m3_max / floored
    codes = (values * multiplier[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return codes, torch.where(amax > 0, floored / e4m3_max, 0.0)


def weight_exponents(block_scales: torch.Tensor) -> torch.Tensor:
    """``block_scales float8_e4m3fn [..., K / 16]`` -> int32 ``p [..., K / 128]``: per 128-column
    block the smallest integer with ``6 * max|block_scale| <= 448 * 2**p`` (0 for a zero
    block). Exact: ``frexp`` of the float64 ratio, which no e4m3 scale puts on a power of two
    (``6 m / 448 = 2**p`` needs ``m = 7 / 3 * 2**(p + 6)``)."""
    if block_scales.dtype != FP8:
        raise TypeError(f"block_scales must be float8_e4m3fn, got {block_scales.dtype}")
    _check_blocks(block_scales.shape[-1] * nvfp4.BLOCK_SIZE, "block_scales")
    groups = A8_BLOCK // nvfp4.BLOCK_SIZE
    largest = block_scales.to(torch.float64).abs().unflatten(-1, (-1, groups)).amax(dim=-1)
    # ratio = mantissa * 2**exponent with 0.5 < mantissa < 1: 2**(exponent - 1) < ratio < 2**exponent
    _, exponent = torch.frexp(6.0 * largest / E4M3_MAX)
    return torch.where(largest > 0, exponent.to(torch.int32), 0)


def weights(packed: torch.Tensor, block_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 weights ``packed uint8 [..., N, K / 2]``, ``block_scales float8_e4m3fn [..., N, K /
    16]`` -> ``(float8_e4m3fn [..., N, K], p int32 [..., N, K / 128])``: ``e4m3(e2m1 *
    block_scale * 2**-p)`` (module docstring). The global scale (``scale_2``) stays apart."""
    exponents = weight_exponents(block_scales)
    exact = nvfp4.dequantize_blocks(packed, block_scales)  # e2m1 * block_scale, exact in fp32
    shift = torch.pow(2.0, -exponents.to(torch.float32)).repeat_interleave(A8_BLOCK, dim=-1)
    return (exact * shift).to(FP8), exponents


def block_product(
    codes: torch.Tensor, scales: torch.Tensor, fp8_weights: torch.Tensor, exponents: torch.Tensor
) -> torch.Tensor:
    """fp32 ``[M, N]``: ``scales[:, None] * sum_b partial_b * 2**exponents[:, b]``, the sum over
    the 128-column blocks in ascending order in fp32, ``partial_b`` the fp32 dot products of block
    ``b`` of ``codes [M, K]`` (activations, :func:`quantize_rows`, with their ``scales [M]``) and
    ``fp8_weights [N, K]`` (:func:`weights`, with their ``exponents [N, K / 128]``)."""
    m, k = codes.shape
    n = fp8_weights.shape[0]
    if fp8_weights.shape[1] != k:
        raise ValueError(f"codes [M, {k}] and fp8_weights {tuple(fp8_weights.shape)} differ in K")
    if tuple(scales.shape) != (m,):
        raise ValueError(f"scales must be [M] = [{m}] (one per activation row), got {tuple(scales.shape)}")
    blocks = k // A8_BLOCK  # explicit: M or N may be 0
    x = codes.to(torch.float32).reshape(m, blocks, A8_BLOCK).transpose(0, 1)  # [B, M, 128]
    w = fp8_weights.to(torch.float32).reshape(n, blocks, A8_BLOCK).transpose(0, 1)  # [B, N, 128]
    partials = torch.bmm(x, w.transpose(1, 2))  # [B, M, N]
    shifts = torch.pow(2.0, exponents.T.to(torch.float32))[:, None, :]  # [B, 1, N]
    accumulator = torch.zeros(m, n, dtype=torch.float32, device=codes.device)
    for partial, shift in zip(partials, shifts, strict=True):
        accumulator = accumulator + partial * shift
    return accumulator * scales[:, None]
