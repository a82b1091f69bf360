"""Translate vLLM's ModelOpt NVFP4 MoE parameters into b12x 1.5.1's ``PackedWeights`` tensors.

Pure torch, any device; no b12x import except in :func:`to_packed_weights`. The caller's tensors
are never modified: every tensor of :class:`B12xTensors` is a fresh allocation.

b12x conventions (read in ``b12x/moe/fused_moe`` 1.5.1; FACTS.md section 5):

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
- Activation scales are *encode* scales ``1 / input_scale``: FC1 uses one shared scale for all
  experts, ``gs1 = 1 / max_e(w13_input_scale)`` (given as a uniform [E] vector so b12x can
  quantize each token once), FC2 the per-expert ``gs2[e] = 1 / w2_input_scale[e]``.
  b12x derives ``alpha = weight_scale_2 / gs`` itself (FACTS.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from a4prefill.ops.modelopt import NvFp4MoEWeights
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


def translate_weights(weights: NvFp4MoEWeights, a4_scales: A4Scales | None) -> B12xTensors:
    """Build :class:`B12xTensors` from validated ModelOpt tensors (see ``checks``) on their device.

    ``a4_scales`` None (no valid calibration) gives unit activation scales. Raises ``ValueError``
    if gate and up of an expert have different ``weight_scale_2`` (one alpha per expert in b12x).
    Reads ``w13_weight_scale_2`` on the host: call at preparation time.
    """
    experts = weights.w13_weight.shape[0]
    device = weights.w13_weight.device
    scale_2 = weights.w13_weight_scale_2.detach().to(torch.float32)
    if not bool(torch.equal(scale_2[:, 0], scale_2[:, 1])):
        raise ValueError(
            "w13_weight_scale_2: gate and up global scales must agree per expert (column 0 == 1)"
        )
    if a4_scales is None:
        fc1 = torch.ones(experts, dtype=torch.float32, device=device)
        fc2 = torch.ones(experts, dtype=torch.float32, device=device)
    else:
        fc1 = a4_scales.fc1_encode_scale.to(device, torch.float32).reshape(1).repeat(experts).contiguous()
        fc2 = a4_scales.fc2_encode_scales.to(device, torch.float32).reshape(experts).clone()
    return B12xTensors(
        w13=swap_gate_up(weights.w13_weight),
        w2=weights.w2_weight.detach().clone().contiguous(),
        w13_block_scales=swizzle_block_scales(swap_gate_up(weights.w13_weight_scale)),
        w2_block_scales=swizzle_block_scales(weights.w2_weight_scale),
        w13_global_scales=scale_2[:, 0].clone().contiguous(),
        w2_global_scales=weights.w2_weight_scale_2.detach().to(torch.float32).clone().contiguous(),
        input_scale=fc1,
        intermediate_scale=fc2,
        calibrated=a4_scales is not None,
    )


def untranslate_weights(tensors: B12xTensors) -> NvFp4MoEWeights:
    """Back to vLLM's layout (gate first, unswizzled scales); input scales from the encode scales.

    For tests: ``untranslate_weights(translate_weights(w, s))`` reproduces ``w``'s weights and
    scales bit-exactly (input scales as ``1 / gs``: the FC1 one becomes ``max_e`` for every expert).
    """
    experts, two_i, hidden_half = tensors.w13.shape
    hidden = hidden_half * 2
    intermediate = two_i // 2
    w13_scale = unswizzle_block_scales(tensors.w13_block_scales, two_i, hidden // BLOCK_SIZE)
    w2_scale = unswizzle_block_scales(tensors.w2_block_scales, hidden, intermediate // BLOCK_SIZE)
    zeros = torch.zeros(experts, dtype=torch.float32, device=tensors.w13.device)
    fc1_input = 1.0 / tensors.input_scale if tensors.calibrated else zeros
    fc2_input = 1.0 / tensors.intermediate_scale if tensors.calibrated else zeros
    return NvFp4MoEWeights(
        w13_weight=swap_gate_up(tensors.w13),
        w13_weight_scale=swap_gate_up(w13_scale),
        w13_weight_scale_2=tensors.w13_global_scales.unsqueeze(1).repeat(1, 2),
        w13_input_scale=fc1_input.unsqueeze(1).repeat(1, 2),
        w2_weight=tensors.w2.clone(),
        w2_weight_scale=w2_scale,
        w2_weight_scale_2=tensors.w2_global_scales.clone(),
        w2_input_scale=fc2_input,
    )


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
