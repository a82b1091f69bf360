"""One MoE layer's numbers on real inputs: what A4 and A8 cost against W4A16, and W4A16 against
bf16.

Inputs: the layer's parameter set (:class:`~a4prefill.ops.NvFp4MoEWeights`) and what vLLM fed
the layer's experts (hidden states [T, H] bf16, ``topk_weights`` / ``topk_ids`` [T, k]). Outputs
(:class:`LayerNumerics`):

- ``a4_vs_w4a16_rel_error``: ``||A4 - W4A16|| / ||W4A16||`` over all rows (Frobenius norms),
  ``a4_vs_w4a16_cosine``: the mean per-row cosine similarity of the two outputs; both None for a
  layer without A4 scales (it never runs A4);
- ``w4a16_vs_bf16_rel_error``: the package's W4A16 against a plain bf16 MoE on the dequantized
  weights (bf16 GEMMs, what a bf16 engine would compute with these weights);
- ``fc1_saturated`` / ``fc2_saturated``: the share of 16-element activation blocks whose NVFP4
  block scale clamps at 448 under the calibrated encode scale (FC1 input with the shared ``gs1``,
  FC2 input with each expert's ``gs2``); a saturated block loses its largest values;
- ``status``: ``"A4 scales"`` or why the layer has none (:func:`a4prefill.ops.a4_calibration`);
- ``a8_vs_w4a16_rel_error`` / ``a8_vs_w4a16_cosine``: the same two numbers for A8 (every row
  with FP8 activations, docs/numerics.md section 8; needs no calibration); both None for a layer
  whose H or I is not a multiple of 128 (it cannot run A8).

Runs on ``device`` through the package's ops (the reference backend on a CPU, Triton on CUDA);
A8 through its oracle :func:`~a4prefill.ops.reference.moe_reference_a8` on every device (no
backend has an A8 kernel yet: numerics, not speed).
Who may call: the numerics tool, tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from a4prefill import ops
from a4prefill.ops import nvfp4
from a4prefill.ops.fp8 import a8_shape_reason
from a4prefill.ops.modelopt import NvFp4MoEWeights
from a4prefill.ops.reference import moe_reference_a8, swiglu
from a4prefill.ops.scales import A4_READY


@dataclass(frozen=True)
class LayerNumerics:
    """One layer's numbers (see the module docstring); ``tokens``: rows measured."""

    layer: str
    status: str
    tokens: int
    a4_vs_w4a16_rel_error: float | None
    a4_vs_w4a16_cosine: float | None
    w4a16_vs_bf16_rel_error: float
    fc1_saturated: float | None
    fc2_saturated: float | None
    a8_vs_w4a16_rel_error: float | None = None
    a8_vs_w4a16_cosine: float | None = None


def relative_error(result: torch.Tensor, expected: torch.Tensor) -> float:
    """``||result - expected|| / ||expected||`` in fp32 (0 when both are zero)."""
    difference = (result.float() - expected.float()).norm()
    scale = expected.float().norm()
    return 0.0 if float(scale) == 0.0 else float(difference / scale)


def mean_row_cosine(result: torch.Tensor, expected: torch.Tensor) -> float:
    """Mean over rows of the cosine similarity of ``result[t]`` and ``expected[t]``."""
    return float(F.cosine_similarity(result.float(), expected.float(), dim=1, eps=1e-30).mean())


def bf16_moe(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """A plain bf16 MoE: ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` cast to bf16, bf16 GEMMs and
    SwiGLU, router weights applied in fp32; returns bf16 [T, H]."""
    x = hidden.to(torch.bfloat16)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate, up = (x[token] @ w13[expert].to(torch.bfloat16).T).chunk(2, dim=1)
        y = (F.silu(gate) * up) @ w2[expert].to(torch.bfloat16).T
        out.index_add_(0, token, y.float() * topk_weights[token, slot].float().unsqueeze(1))
    return out.to(torch.bfloat16)


def _saturated_share(values: torch.Tensor, encode_scale: torch.Tensor) -> tuple[int, int]:
    """(saturated blocks, blocks) of ``values [N, K]`` quantized with one-element ``encode_scale``."""
    if values.numel() == 0:
        return 0, 0
    blocks = values.float().reshape(values.shape[0], -1, nvfp4.BLOCK_SIZE).abs().amax(dim=-1)
    saturated = encode_scale.float().reshape(()) * blocks / nvfp4.E2M1_MAX > nvfp4.E4M3_MAX
    return int(saturated.sum()), saturated.numel()


def saturation(
    hidden: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, scales: ops.A4Scales
) -> tuple[float, float]:
    """Shares of saturating FC1 and FC2 input blocks (FC2 inputs from the W4A16 path's SwiGLU;
    ``w13 [E, 2I, H]`` fp32, the dequantized FC1 weights)."""
    fc1_hits, fc1_blocks = _saturated_share(hidden, scales.fc1_encode_scale)
    hits = blocks = 0
    for expert in torch.unique(topk_ids).tolist():
        token = torch.nonzero((topk_ids == expert).any(dim=1)).flatten()
        h = swiglu((hidden[token].float() @ w13[expert].T).to(hidden.dtype), None)
        expert_hits, expert_blocks = _saturated_share(h, scales.fc2_encode_scales[expert])
        hits, blocks = hits + expert_hits, blocks + expert_blocks
    return fc1_hits / max(fc1_blocks, 1), hits / max(blocks, 1)


def layer_numerics(
    layer: str,
    weights: NvFp4MoEWeights,
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    device: str | torch.device = "cpu",
) -> LayerNumerics:
    """Measure one layer on captured inputs (see the module docstring)."""
    weights = weights.to(device)
    hidden, topk_weights = hidden.to(device), topk_weights.to(device).float()
    topk_ids = topk_ids.to(device).to(torch.int32)
    experts = weights.experts()
    calibration = ops.a4_calibration(weights.w13_input_scale, weights.w2_input_scale)
    args = (hidden, topk_weights, topk_ids, experts)
    w4a16 = ops.call_moe(ops.moe_w4a16, *args, None, layer)
    w13, w2 = ops.dequantize_experts(experts)
    bf16 = bf16_moe(hidden, topk_weights, topk_ids, w13, w2)
    a4_error = a4_cosine = fc1_saturated = fc2_saturated = None
    if calibration.scales is not None:
        a4 = ops.call_moe(ops.moe_a4, *args, calibration.scales, layer)
        a4_error, a4_cosine = relative_error(a4, w4a16), mean_row_cosine(a4, w4a16)
        fc1_saturated, fc2_saturated = saturation(hidden, topk_ids, w13, calibration.scales)
    a8_error = a8_cosine = None
    if a8_shape_reason(hidden.shape[1], w2.shape[2]) is None:
        a8 = moe_reference_a8(*args)
        a8_error, a8_cosine = relative_error(a8, w4a16), mean_row_cosine(a8, w4a16)
    numbers = LayerNumerics(
        layer,
        calibration.reason or A4_READY,
        hidden.shape[0],
        a4_error,
        a4_cosine,
        relative_error(w4a16, bf16),
        fc1_saturated,
        fc2_saturated,
        a8_error,
        a8_cosine,
    )
    if any(isinstance(v, float) and not math.isfinite(v) for v in vars(numbers).values()):
        raise ValueError(f"{layer}: non-finite numerics {numbers}")
    return numbers
