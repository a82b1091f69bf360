"""ModelOpt NVFP4 conventions: global scales, encode scales, expert stacks, MoE parameter sets.

ModelOpt stores *decode* multipliers: ``weight_scale_2 = amax_w / (6 * 448)`` and
``input_scale = amax_x / (6 * 448)``. Encoding uses their reciprocal, ``gs = 1 / scale``.
The parameter names and shapes below are exactly vLLM's ModelOpt NVFP4 MoE parameter set
(docs/numerics.md, section 3).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Self

import torch

from a4prefill.ops import nvfp4

FP4_FP8_RANGE = nvfp4.E2M1_MAX * nvfp4.E4M3_MAX  # 2688: the largest code times the largest scale


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's decode-side global scale ``amax / (6 * 448)`` (fp32, same shape as ``amax``)."""
    return amax.to(torch.float32) / FP4_FP8_RANGE


def encode_scale_from_global_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """The encode scale ``1 / global_scale`` for ``weight_scale_2`` or ``input_scale`` (fp32)."""
    return 1.0 / global_scale.to(torch.float32)


@dataclass(frozen=True)
class QuantizedStack:
    """One quantized expert stack as a ModelOpt checkpoint stores it.

    ``weight``: uint8 [E, N, K/2]; ``weight_scale``: float8_e4m3fn [E, N, K/16];
    ``weight_scale_2``: fp32 [E] (decode multiplier per expert).
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor


def quantize_expert_stack(weights: torch.Tensor, amax: torch.Tensor | None = None) -> QuantizedStack:
    """Quantize ``weights [E, N, K]`` (float, K % 16 == 0) per expert, the ModelOpt way.

    ``amax`` (fp32 [E]) overrides the per-expert absolute maximum, e.g. to give gate and up one
    shared global scale. Experts whose amax is 0 get ``weight_scale_2 = 1`` and zero codes.
    """
    if weights.ndim != 3:
        raise ValueError(f"weights must be 3-D [E, N, K], got shape {tuple(weights.shape)}")
    num_experts = weights.shape[0]
    if amax is None:
        amax = weights.detach().abs().amax(dim=(1, 2)).to(torch.float32)
    if amax.shape != (num_experts,):
        raise ValueError(f"amax must have shape [{num_experts}], got {tuple(amax.shape)}")
    scale_2 = torch.where(amax > 0, global_scale_from_amax(amax), torch.ones_like(amax))
    codes, scales = [], []
    for expert in range(num_experts):
        packed, block_scales = nvfp4.quantize(
            weights[expert], encode_scale_from_global_scale(scale_2[expert])
        )
        codes.append(packed)
        scales.append(block_scales)
    return QuantizedStack(torch.stack(codes), torch.stack(scales), scale_2)


def dequantize_expert_stack(stack: QuantizedStack) -> torch.Tensor:
    """``e2m1 * block_scale * weight_scale_2`` as fp32 ``[E, N, K]``."""
    return nvfp4.dequantize_blocks(stack.weight, stack.weight_scale) * stack.weight_scale_2.reshape(-1, 1, 1)


class _TensorBundle:
    """Named tensors of a frozen dataclass whose fields are all tensors, in field order."""

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Field name -> tensor, in field order (the op argument order)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}  # type: ignore[arg-type]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors in field order."""
        return tuple(self.named_tensors().values())

    def to(self, device: torch.device | str) -> Self:
        """A copy with every tensor moved to ``device``."""
        return type(self)(*(t.to(device) for t in self.tensors()))


@dataclass(frozen=True)
class ExpertGemm:
    """One of a layer's two expert GEMMs (FC1 or FC2) in the package's one weight layout: the
    ModelOpt tensors as vLLM loads them, never re-laid out or copied (views only). Every path reads
    expert weights through it (:attr:`NvFp4Experts.fc1`, :attr:`NvFp4Experts.fc2`): the reference,
    the triton backend's tiled, decode and prefill kernels (A4 and split included) and the b12x
    translation. For E experts, N output rows and K input columns:

    - ``codes`` uint8 [E, N, K/2]: byte ``c`` of a row holds column ``2c`` in its low nibble and
      column ``2c + 1`` in its high nibble (e2m1);
    - ``block_scales`` float8_e4m3fn [E, N, K/16]: one per 16 consecutive columns of a row;
    - ``scale_2`` fp32: the decode multiplier, [E, 2] for FC1 (column 0 the gate rows ``[0, N/2)``,
      column 1 the up rows ``[N/2, N)``), [E] for FC2.

    Weight ``(e, n, k) = e2m1(codes) * block_scales[e, n, k // 16] * scale_2`` (docs/numerics.md,
    section 3)."""

    codes: torch.Tensor
    block_scales: torch.Tensor
    scale_2: torch.Tensor

    @property
    def experts(self) -> int:
        return int(self.codes.shape[0])

    @property
    def rows(self) -> int:
        """N: output rows (FC1: ``2 I``, gate then up; FC2: ``H``)."""
        return int(self.codes.shape[1])

    @property
    def columns(self) -> int:
        """K: input columns (FC1: ``H``; FC2: ``I``)."""
        return 2 * int(self.codes.shape[2])

    def scale_bytes(self) -> torch.Tensor:
        """``block_scales`` as their uint8 e4m3 bit patterns (same storage)."""
        return self.block_scales.view(torch.uint8)

    def code_words(self) -> torch.Tensor:
        """``codes`` as int32 [E, N, K/8]: columns ``8w .. 8w + 7`` of a row in word ``w``, column
        ``8w + i`` in bits ``4i .. 4i + 3`` (little-endian bytes; same storage)."""
        return self.codes.view(torch.int32)

    def scale_pairs(self) -> torch.Tensor:
        """``block_scales`` as uint16 [E, N, K/32]: the scales of two consecutive 16-column blocks
        per value, the first in the low byte (same storage)."""
        return self.block_scales.view(torch.uint16)

    def dequantized_blocks(self, expert: int) -> torch.Tensor:
        """fp32 [N, K] ``e2m1 * block_scale`` of one expert (exact; ``scale_2`` not applied)."""
        return nvfp4.dequantize_blocks(self.codes[expert], self.block_scales[expert])


@dataclass(frozen=True)
class NvFp4Experts(_TensorBundle):
    """The NVFP4 expert weights of one layer as the ops take them (E experts, hidden H, inter. I).

    - ``w13_weight`` uint8 [E, 2I, H/2]; rows [0, I) gate (w1), rows [I, 2I) up (w3)
    - ``w13_weight_scale`` float8_e4m3fn [E, 2I, H/16]
    - ``w13_weight_scale_2`` fp32 [E, 2]: decode multiplier of the gate half (column 0) and of the
      up half (column 1); every backend applies each to its own half
    - ``w2_weight`` uint8 [E, H, I/2]; ``w2_weight_scale`` float8_e4m3fn [E, H, I/16]
    - ``w2_weight_scale_2`` fp32 [E]

    No activation scales: whether a layer may run A4 is load-time data
    (:class:`a4prefill.ops.scales.A4Scales`), passed to the ops separately.
    """

    w13_weight: torch.Tensor
    w13_weight_scale: torch.Tensor
    w13_weight_scale_2: torch.Tensor
    w2_weight: torch.Tensor
    w2_weight_scale: torch.Tensor
    w2_weight_scale_2: torch.Tensor

    @property
    def fc1(self) -> ExpertGemm:
        """FC1 (``w13``: N = 2I gate-then-up rows, K = H) through the layout accessor."""
        return ExpertGemm(self.w13_weight, self.w13_weight_scale, self.w13_weight_scale_2)

    @property
    def fc2(self) -> ExpertGemm:
        """FC2 (``w2``: N = H rows, K = I) through the layout accessor."""
        return ExpertGemm(self.w2_weight, self.w2_weight_scale, self.w2_weight_scale_2)


@dataclass(frozen=True)
class NvFp4MoEWeights(_TensorBundle):
    """vLLM's ModelOpt NVFP4 MoE parameters of one layer: the experts plus the checkpoint's
    activation input scales (docs/numerics.md, section 3).

    Expert fields as in :class:`NvFp4Experts`; ``w13_input_scale`` fp32 [E, 2] and
    ``w2_input_scale`` fp32 [E] are ModelOpt decode-side scales (0 = not calibrated). Turn them
    into A4 encode scales once with :func:`a4prefill.ops.scales.a4_calibration`.
    """

    w13_weight: torch.Tensor
    w13_weight_scale: torch.Tensor
    w13_weight_scale_2: torch.Tensor
    w13_input_scale: torch.Tensor
    w2_weight: torch.Tensor
    w2_weight_scale: torch.Tensor
    w2_weight_scale_2: torch.Tensor
    w2_input_scale: torch.Tensor

    def experts(self) -> NvFp4Experts:
        """The expert weights (no activation scales), as the ops take them."""
        return NvFp4Experts(
            self.w13_weight,
            self.w13_weight_scale,
            self.w13_weight_scale_2,
            self.w2_weight,
            self.w2_weight_scale,
            self.w2_weight_scale_2,
        )


def dequantize_experts(experts: NvFp4Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``: ``e2m1 * block_scale * weight_scale_2``,
    the gate half of ``w13`` with column 0 of ``w13_weight_scale_2``, the up half with column 1."""
    fc1, fc2 = experts.fc1, experts.fc2
    half_scale = fc1.scale_2.reshape(fc1.experts, 2).repeat_interleave(fc1.rows // 2, dim=1)
    w13 = nvfp4.dequantize_blocks(fc1.codes, fc1.block_scales) * half_scale.unsqueeze(2)
    w2 = dequantize_expert_stack(QuantizedStack(fc2.codes, fc2.block_scales, fc2.scale_2))
    return w13, w2


def quantize_moe_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_input_amax: torch.Tensor | None = None,
    w2_input_amax: torch.Tensor | None = None,
) -> NvFp4MoEWeights:
    """Quantize float expert weights into vLLM's ModelOpt NVFP4 MoE parameter set.

    ``w13`` [E, 2I, H] (gate rows first), ``w2`` [E, H, I]. Gate and up share one global scale
    per expert (the larger amax), as ModelOpt exports them. Input amaxes (fp32 [E]) become
    calibrated ``input_scale``s; ``None`` leaves the scales at 0 ("not calibrated").
    """
    if w13.ndim != 3 or w2.ndim != 3:
        raise ValueError(f"w13 and w2 must be 3-D, got {tuple(w13.shape)} and {tuple(w2.shape)}")
    num_experts, two_i, hidden = w13.shape
    if two_i % 2 or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"w2 must have shape [E, H, I] = {[num_experts, hidden, two_i // 2]} for w13 "
            f"{list(w13.shape)}, got {list(w2.shape)}"
        )
    fc1 = quantize_expert_stack(w13)
    fc2 = quantize_expert_stack(w2)

    def input_scale(amax: torch.Tensor | None) -> torch.Tensor:
        if amax is None:
            return torch.zeros(num_experts, dtype=torch.float32)
        return global_scale_from_amax(amax.reshape(num_experts))

    return NvFp4MoEWeights(
        w13_weight=fc1.weight,
        w13_weight_scale=fc1.weight_scale,
        w13_weight_scale_2=fc1.weight_scale_2.unsqueeze(1).repeat(1, 2),
        w13_input_scale=input_scale(w13_input_amax).unsqueeze(1).repeat(1, 2),
        w2_weight=fc2.weight,
        w2_weight_scale=fc2.weight_scale,
        w2_weight_scale_2=fc2.weight_scale_2,
        w2_input_scale=input_scale(w2_input_amax),
    )
