"""Argument validation for the MoE ops: shapes, dtypes, devices, layout, expert ids.

Every check raises ``ValueError``/``TypeError`` naming the argument and what was expected.
Nothing here reads device memory except :func:`check_expert_ids`, which the callers use only
where a host read is allowed (CPU tensors, the reference backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a4prefill.ops.modelopt import NvFp4MoEWeights
from a4prefill.ops.nvfp4 import BLOCK_SIZE

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
ROUTER_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EXPERT_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MoEGeometry:
    """Sizes of one MoE call: tokens T, hidden H, intermediate I, experts E, top-k."""

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int


def _expect(tensor: torch.Tensor, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {names}, got {str(tensor.dtype).removeprefix('torch.')}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tensor.stride()})")


def check_moe_inputs(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: NvFp4MoEWeights,
    swiglu_limit: float | None,
) -> MoEGeometry:
    """Validate one MoE call against vLLM's ModelOpt parameter set; return its geometry.

    Works on real and fake tensors (no data is read).
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 2:
        shape = list(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
        raise ValueError(f"hidden_states must be 2-D [T, H], got {shape}")
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be 2-D [T, top_k], got shape {list(topk_ids.shape)}")
    w13 = weights.w13_weight
    if w13.ndim != 3:
        raise ValueError(f"w13_weight must be 3-D [E, 2I, H/2], got shape {list(w13.shape)}")
    tokens, hidden = hidden_states.shape
    experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    intermediate = two_i // 2
    if hidden % BLOCK_SIZE or intermediate % BLOCK_SIZE or two_i % 2:
        raise ValueError(
            f"hidden size H={hidden} and intermediate size I={intermediate} must be multiples of "
            f"{BLOCK_SIZE} (w13_weight has 2I={two_i} rows)"
        )
    _expect(hidden_states, "hidden_states", (tokens, hidden), ACTIVATION_DTYPES)
    _expect(topk_weights, "topk_weights", (tokens, top_k), ROUTER_WEIGHT_DTYPES)
    _expect(topk_ids, "topk_ids", (tokens, top_k), EXPERT_ID_DTYPES)
    u8, e4m3, f32 = (torch.uint8,), (torch.float8_e4m3fn,), (torch.float32,)
    _expect(weights.w13_weight, "w13_weight", (experts, two_i, hidden // 2), u8)
    _expect(weights.w13_weight_scale, "w13_weight_scale", (experts, two_i, hidden // BLOCK_SIZE), e4m3)
    _expect(weights.w13_weight_scale_2, "w13_weight_scale_2", (experts, 2), f32)
    _expect(weights.w13_input_scale, "w13_input_scale", (experts, 2), f32)
    _expect(weights.w2_weight, "w2_weight", (experts, hidden, intermediate // 2), u8)
    _expect(weights.w2_weight_scale, "w2_weight_scale", (experts, hidden, intermediate // BLOCK_SIZE), e4m3)
    _expect(weights.w2_weight_scale_2, "w2_weight_scale_2", (experts,), f32)
    _expect(weights.w2_input_scale, "w2_input_scale", (experts,), f32)
    if top_k < 1 or top_k > experts:
        raise ValueError(f"topk_ids: top_k={top_k} must be in [1, E={experts}]")
    device = hidden_states.device
    named = {"topk_weights": topk_weights, "topk_ids": topk_ids, **weights.named_tensors()}
    for name, tensor in named.items():
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, expected hidden_states' device {device}")
    if swiglu_limit is not None and not swiglu_limit > 0:
        raise ValueError(f"swiglu_limit must be None or a number > 0, got {swiglu_limit}")
    return MoEGeometry(tokens, hidden, intermediate, experts, top_k)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise if any id lies outside [0, num_experts). Reads device memory (one host sync)."""
    if topk_ids.numel() == 0:
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= num_experts:
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got values in [{low}, {high}]")
