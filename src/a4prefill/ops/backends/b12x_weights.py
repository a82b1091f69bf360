"""Translate vLLM's ModelOpt NVFP4 MoE parameters into b12x 1.5.1's ``PackedWeights`` tensors.

Pure torch, any device; no b12x import except in :func:`to_packed_weights`. The caller's tensors
are never modified: every tensor of :class:`B12xTensors` is a fresh allocation.

b12x conventions (read in ``b12x/moe/fused_moe`` 1.5.1; docs/numerics.md, section 6):

- FC1 half order: b12x's kernels consume ``[up; gate]`` (b12x calls it ``W13Layout.W13``);
  vLLM stores ``[gate; up]`` (b12x's ``W31``). Given ``W31`` storage, b12x flips the caller's
  weight *and* block-scale storage in place at first use and pins it in a module-level registry.
  We therefore hand b12x our own copy already in ``[up; gate]`` order and declare ``W13``: no
  storage is flipped and nothing is pinned.
- Block scales: float8_e4m3fn, one per 16 K elements, in the 128x4 swizzled layout:
  ``[E, R, C]`` is zero-padded to ``[E, pad128(R), pad4(C)]`` and element ``(r, c)`` with
  ``r = 128*m + 32*a + b`` and ``c = 4*k + j`` lands at ``[m, k, b, a, j]`` of the
  ``[E, R/128, C/4, 32, 4, 4]`` view.
- Weight global scales: ModelOpt's ``weight_scale_2`` as-is (decode multipliers, fp32 [E]).
  b12x has one FC1 global scale per expert; vLLM's ``w13_weight_scale_2`` has one per half
  (gate, up). Where the halves differ, the larger is b12x's global scale and the other half's
  ratio to it is folded into that half's e4m3 block scales. That is exact, and done, only when
  the ratio is a power of two and every scaled block scale is an e4m3 value
  (:func:`fold_half_scales`); otherwise the translation raises (no silent approximation).
- Activation scales are *encode* scales ``1 / input_scale``: FC1 uses one shared scale for all
  experts, ``gs1 = 1 / max_e(w13_input_scale)`` (given as a uniform [E] vector so b12x can
  quantize each token once), FC2 the per-expert ``gs2[e] = 1 / w2_input_scale[e]``.
  b12x derives ``alpha = weight_scale_2 / gs`` itself (docs/numerics.md, section 4).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.nvfp4 import BLOCK_SIZE
from a4prefill.ops.scales import A4Scales

SCALE_ROW_TILE = 128
SCALE_COL_TILE = 4


def _align(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def swizzled_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded ``(rows, cols)`` of a 128x4-swizzled block-scale matrix of ``rows x cols``."""
    return _align(rows, SCALE_ROW_TILE), _align(cols, SCALE_COL_TILE)


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn [E, R, C]`` -> the 128x4 swizzled ``float8_e4m3fn [E, pad128(R), pad4(C)]``.

    Padding entries are zero. Returns a new contiguous tensor (bytes are moved, not converted).
    """
    if scales.dtype != torch.float8_e4m3fn or scales.ndim != 3:
        raise ValueError(
            f"block scales must be float8_e4m3fn [E, R, C], got {scales.dtype} {list(scales.shape)}"
        )
    experts, rows, cols = scales.shape
    rows_p, cols_p = swizzled_scale_shape(rows, cols)
    padded = torch.zeros(experts, rows_p, cols_p, dtype=torch.uint8, device=scales.device)
    padded[:, :rows, :cols] = scales.view(torch.uint8)
    tiles = padded.reshape(experts, rows_p // 128, 4, 32, cols_p // 4, 4)
    swizzled = tiles.permute(0, 1, 4, 3, 2, 5).contiguous().reshape(experts, rows_p, cols_p)
    return swizzled.view(torch.float8_e4m3fn)


def unswizzle_block_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_block_scales`: ``[E, pad128(R), pad4(C)]`` -> ``[E, R, C]``."""
    experts = swizzled.shape[0]
    rows_p, cols_p = swizzled_scale_shape(rows, cols)
    if swizzled.numel() != experts * rows_p * cols_p:
        raise ValueError(
            f"swizzled scales hold {swizzled.numel()} entries, expected {experts}x{rows_p}x{cols_p}"
        )
    tiles = swizzled.contiguous().view(torch.uint8).reshape(experts, rows_p // 128, cols_p // 4, 32, 4, 4)
    logical = tiles.permute(0, 1, 4, 3, 2, 5).reshape(experts, rows_p, cols_p)
    return logical[:, :rows, :cols].contiguous().view(torch.float8_e4m3fn)


def swap_gate_up(stack: torch.Tensor) -> torch.Tensor:
    """A new ``[E, 2I, X]`` tensor with the two row halves exchanged (gate-first <-> up-first)."""
    if stack.ndim != 3 or stack.shape[1] % 2:
        raise ValueError(f"expected [E, 2I, X] with an even row count, got {list(stack.shape)}")
    gate, up = stack.chunk(2, dim=1)
    return torch.cat((up, gate), dim=1).contiguous()


@dataclass(frozen=True)
class B12xTensors:
    """The tensors of b12x's ``PackedWeights`` for one layer (E experts, hidden H, inter. I).

    - ``w13`` uint8 [E, 2I, H/2], rows [0, I) up, [I, 2I) gate (b12x ``W13Layout.W13``)
    - ``w2`` uint8 [E, H, I/2]
    - ``w13_block_scales`` float8_e4m3fn [E, pad128(2I), pad4(H/16)] swizzled, same row order
    - ``w2_block_scales`` float8_e4m3fn [E, pad128(H), pad4(I/16)] swizzled
    - ``w13_global_scales`` / ``w2_global_scales`` fp32 [E]: ``weight_scale_2``
    - ``input_scale`` fp32 [E]: the shared FC1 encode scale repeated (units if uncalibrated)
    - ``intermediate_scale`` fp32 [E]: per-expert FC2 encode scales (units if uncalibrated)
    - ``calibrated``: whether the activation scales are real (A4 may run) or unit placeholders
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_block_scales: torch.Tensor
    w2_block_scales: torch.Tensor
    w13_global_scales: torch.Tensor
    w2_global_scales: torch.Tensor
    input_scale: torch.Tensor
    intermediate_scale: torch.Tensor
    calibrated: bool

    def clone(self) -> B12xTensors:
        """A deep copy (for a b12x plan that repacks its weights in place)."""
        clones = {f.name: getattr(self, f.name).clone() for f in fields(self) if f.name != "calibrated"}
        return replace(self, **clones)

    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return sum(
            getattr(self, f.name).numel() * getattr(self, f.name).element_size()
            for f in fields(self)
            if f.name != "calibrated"
        )


def fold_half_scales(
    w13_weight_scale: torch.Tensor, w13_weight_scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One FC1 global scale per expert from per-half ones, exactly.

    ``w13_weight_scale`` float8_e4m3fn [E, 2I, H/16] (gate rows first), ``w13_weight_scale_2``
    fp32 [E, 2]. Returns new block scales (same layout) and fp32 [E] global scales
    ``max(gate, up)`` such that ``e2m1 * block' * global == e2m1 * block * weight_scale_2[half]``
    for every element. Raises ``ValueError`` naming the expert where that cannot be exact.
    """
    scale_2 = w13_weight_scale_2.detach().to(torch.float32)
    global_scale = scale_2.amax(dim=1)
    ratio = scale_2 / global_scale.unsqueeze(1)  # [E, 2], 1 for the larger half
    mantissa, _ = torch.frexp(ratio)
    not_power_of_two = ((mantissa != 0.5) | (ratio * global_scale.unsqueeze(1) != scale_2)).any(dim=1)
    intermediate = w13_weight_scale.shape[1] // 2
    per_row = ratio.repeat_interleave(intermediate, dim=1).unsqueeze(2)  # [E, 2I, 1]
    scaled = w13_weight_scale.to(torch.float32) * per_row
    folded = scaled.to(torch.float8_e4m3fn)
    inexact = (folded.to(torch.float32) != scaled).flatten(1).any(dim=1) | not_power_of_two
    if bool(inexact.any()):
        expert = int(inexact.nonzero()[0])
        raise ValueError(
            f"w13_weight_scale_2: expert {expert} has gate/up global scales "
            f"{scale_2[expert].tolist()} whose ratio b12x cannot absorb exactly (b12x 1.5.1 has one "
            "FC1 global scale per expert; folding works only for power-of-two ratios that keep every "
            "block scale an e4m3 value). Serve this layer with another backend (A4PREFILL_BACKEND)."
        )
    return folded, global_scale.contiguous()


def translate_weights(experts: NvFp4Experts, a4_scales: A4Scales | None) -> B12xTensors:
    """Build :class:`B12xTensors` from validated ModelOpt tensors (see ``checks``) on their device.

    ``a4_scales`` None (the layer has no A4 scales) gives unit activation scales. Gate and up
    global scales that differ are folded exactly into the block scales (:func:`fold_half_scales`),
    or the translation raises. Reads scales on the host: call at preparation time.
    """
    gemm1, gemm2 = experts.fc1, experts.fc2
    num_experts = gemm1.experts
    device = gemm1.codes.device
    w13_block_scales, w13_global = fold_half_scales(gemm1.block_scales, gemm1.scale_2)
    if a4_scales is None:
        fc1 = torch.ones(num_experts, dtype=torch.float32, device=device)
        fc2 = torch.ones(num_experts, dtype=torch.float32, device=device)
    else:
        fc1 = a4_scales.fc1_encode_scale.to(device, torch.float32).reshape(1).repeat(num_experts).contiguous()
        fc2 = a4_scales.fc2_encode_scales.to(device, torch.float32).reshape(num_experts).clone()
    return B12xTensors(
        w13=swap_gate_up(gemm1.codes),
        w2=gemm2.codes.detach().clone().contiguous(),
        w13_block_scales=swizzle_block_scales(swap_gate_up(w13_block_scales)),
        w2_block_scales=swizzle_block_scales(gemm2.block_scales),
        w13_global_scales=w13_global,
        w2_global_scales=gemm2.scale_2.detach().to(torch.float32).clone().contiguous(),
        input_scale=fc1,
        intermediate_scale=fc2,
        calibrated=a4_scales is not None,
    )


def untranslate_weights(tensors: B12xTensors) -> tuple[NvFp4Experts, A4Scales | None]:
    """Back to vLLM's layout (gate first, unswizzled scales, one global scale used for both halves)
    and the A4 scales (None if the translation had none).

    For tests: the result dequantizes to exactly what the translated experts dequantize to.
    """
    _, two_i, hidden_half = tensors.w13.shape
    hidden = hidden_half * 2
    intermediate = two_i // 2
    w13_scale = unswizzle_block_scales(tensors.w13_block_scales, two_i, hidden // BLOCK_SIZE)
    w2_scale = unswizzle_block_scales(tensors.w2_block_scales, hidden, intermediate // BLOCK_SIZE)
    experts = NvFp4Experts(
        w13_weight=swap_gate_up(tensors.w13),
        w13_weight_scale=swap_gate_up(w13_scale),
        w13_weight_scale_2=tensors.w13_global_scales.unsqueeze(1).repeat(1, 2),
        w2_weight=tensors.w2.clone(),
        w2_weight_scale=w2_scale,
        w2_weight_scale_2=tensors.w2_global_scales.clone(),
    )
    scales = None
    if tensors.calibrated:
        scales = A4Scales(tensors.input_scale[:1].clone(), tensors.intermediate_scale.clone())
    return experts, scales


def to_packed_weights(tensors: B12xTensors) -> Any:
    """b12x's ``PackedWeights`` over ``tensors`` (no copy); input scales are declared immutable."""
    from b12x.moe.fused_moe import PackedWeights

    return PackedWeights(
        w13=tensors.w13,
        w2=tensors.w2,
        w13_block_scales=tensors.w13_block_scales,
        w2_block_scales=tensors.w2_block_scales,
        w13_global_scales=tensors.w13_global_scales,
        w2_global_scales=tensors.w2_global_scales,
        input_scale=tensors.input_scale,
        intermediate_scale=tensors.intermediate_scale,
        immutable_input_scales=True,
    )
