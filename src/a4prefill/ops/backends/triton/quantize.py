"""A4 activations of the ``triton`` backend: rows quantized to NVFP4 on the GPU in one pass
(``shared_kernels.quantize_rows_kernel``), bit-exact with :func:`a4prefill.ops.nvfp4.quantize`.

Who may call: :func:`~a4prefill.ops.backends.triton.fused.fused_moe` (the FC1 input of A4 and
split calls), tests and benchmarks.
"""

from __future__ import annotations

import torch

from a4prefill.ops.backends.triton import kernel_modules
from a4prefill.ops.backends.triton.schedules import cdiv, next_pow2
from a4prefill.ops.precision import MODE_A4, MODE_SPLIT


def quantize_rows(
    x: torch.Tensor,
    encode_scale: torch.Tensor,
    row_flags: torch.Tensor | None = None,
    write_codes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Quantize ``x [T, H]`` (bf16/fp16) with the one-element fp32 ``encode_scale`` on the GPU.

    Returns ``e2m1 * block_scale`` in ``x.dtype`` ([T, H]; rows whose ``row_flags`` [T] entry is
    0 are copied unchanged) and, with ``write_codes``, packed codes uint8 [T, H/2] and block
    scales float8_e4m3fn [T, H/16] (bit-exact with :func:`a4prefill.ops.nvfp4.quantize`).
    """
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    codes = scales = None
    if write_codes:
        codes = torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(tokens, hidden // 16, dtype=torch.uint8, device=x.device)
    if tokens:
        block_h = min(256, next_pow2(hidden))
        grid = (cdiv(tokens, 16), cdiv(hidden, block_h))
        kernel_modules.shared().quantize_rows_kernel[grid](
            x,
            out,
            codes if codes is not None else out,
            scales if scales is not None else out,
            row_flags if row_flags is not None else out,
            encode_scale,
            tokens,
            hidden,
            MODE=MODE_A4 if row_flags is None else MODE_SPLIT,
            WRITE_CODES=write_codes,
            BT=16,
            BH=block_h,
            num_warps=4,
        )
    return out, codes, None if scales is None else scales.view(torch.float8_e4m3fn)
