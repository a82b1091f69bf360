"""Argument validation for the MoE ops: shapes, dtypes, devices, layout, expert ids.

Every check raises ``ValueError``/``TypeError`` naming the argument and what was expected.
Nothing here reads device memory except :func:`check_expert_ids`, which the callers use only
where a host read is allowed (CPU tensors, the reference backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a4prefill.ops.fp8 import a8_shape_reason
from a4prefill.ops.nvfp4 import BLOCK_SIZE
from a4prefill.ops.precision import A8, MoECall, check_prefill_precision
from a4prefill.ops.scales import ENCODE_SCALE_LIMIT, A4Scales

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


def check_moe_call(call: MoECall) -> MoEGeometry:
    """Validate one MoE call against vLLM's ModelOpt expert tensors; return its geometry.

    Works on real and fake tensors (no data is read).
    """
    hidden_states, topk_weights, topk_ids = call.hidden_states, call.topk_weights, call.topk_ids
    experts, a4_scales, swiglu_limit = call.experts, call.a4_scales, call.swiglu_limit
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 2:
        shape = list(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
        raise ValueError(f"hidden_states must be 2-D [T, H], got {shape}")
    for name, routing in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if routing.ndim != 2:
            raise ValueError(f"{name} must be 2-D [T, top_k], got shape {list(routing.shape)}")
    if topk_weights.shape[1] != topk_ids.shape[1]:
        raise ValueError(
            f"topk_weights has top_k={topk_weights.shape[1]} columns but topk_ids has "
            f"top_k={topk_ids.shape[1]}; both must be [T, top_k] with the same top_k"
        )
    w13 = experts.w13_weight
    if w13.ndim != 3:
        raise ValueError(f"w13_weight must be 3-D [E, 2I, H/2], got shape {list(w13.shape)}")
    tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
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
    _expect(experts.w13_weight, "w13_weight", (num_experts, two_i, hidden // 2), u8)
    _expect(experts.w13_weight_scale, "w13_weight_scale", (num_experts, two_i, hidden // BLOCK_SIZE), e4m3)
    _expect(experts.w13_weight_scale_2, "w13_weight_scale_2", (num_experts, 2), f32)
    _expect(experts.w2_weight, "w2_weight", (num_experts, hidden, intermediate // 2), u8)
    _expect(
        experts.w2_weight_scale, "w2_weight_scale", (num_experts, hidden, intermediate // BLOCK_SIZE), e4m3
    )
    _expect(experts.w2_weight_scale_2, "w2_weight_scale_2", (num_experts,), f32)
    named = {"topk_weights": topk_weights, "topk_ids": topk_ids, **experts.named_tensors()}
    if a4_scales is not None:
        _expect(a4_scales.fc1_encode_scale, "a4_fc1_encode_scale", (1,), f32)
        _expect(a4_scales.fc2_encode_scales, "a4_fc2_encode_scales", (num_experts,), f32)
        named["a4_fc1_encode_scale"] = a4_scales.fc1_encode_scale
        named["a4_fc2_encode_scales"] = a4_scales.fc2_encode_scales
    if top_k < 1 or top_k > num_experts:
        raise ValueError(f"topk_ids: top_k={top_k} must be in [1, E={num_experts}]")
    device = hidden_states.device
    for name, tensor in named.items():
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, expected hidden_states' device {device}")
    if swiglu_limit is not None and not swiglu_limit > 0:
        raise ValueError(f"swiglu_limit must be None or a number > 0, got {swiglu_limit}")
    _check_prefill_precision(call, hidden, intermediate)
    return MoEGeometry(tokens, hidden, intermediate, num_experts, top_k)


def _check_prefill_precision(call: MoECall, hidden: int, intermediate: int) -> None:
    """``prefill_precision`` is A4 or A8; an A8 call carries no A4 scales and has H and I
    multiples of :data:`~a4prefill.ops.fp8.A8_BLOCK` (its operands' blocks)."""
    check_prefill_precision(call.prefill_precision)
    if call.prefill_precision != A8:
        return
    if call.a4_scales is not None:
        raise ValueError(
            "prefill_precision 'a8' takes no A4 scales (A8 activation scales are dynamic): pass "
            "a4_fc1_encode_scale and a4_fc2_encode_scales only with prefill_precision 'a4'"
        )
    reason = a8_shape_reason(hidden, intermediate)
    if reason is not None:
        raise ValueError(f"prefill_precision 'a8': {reason}")


def a4_scales_argument(
    fc1_encode_scale: torch.Tensor | None, fc2_encode_scales: torch.Tensor | None
) -> A4Scales | None:
    """The ops' two optional scale arguments as :class:`A4Scales` (both) or None (neither)."""
    if fc1_encode_scale is None and fc2_encode_scales is None:
        return None
    if fc1_encode_scale is None or fc2_encode_scales is None:
        given = "a4_fc1_encode_scale" if fc1_encode_scale is not None else "a4_fc2_encode_scales"
        raise ValueError(
            f"a4_fc1_encode_scale and a4_fc2_encode_scales are given together or not at all; got only {given}"
        )
    return A4Scales(fc1_encode_scale, fc2_encode_scales)


def check_encode_scale_values(scales: A4Scales) -> None:
    """Raise if an A4 encode scale lies outside ``[2**-100, 2**100]`` (``scales.ENCODE_SCALE_LIMIT``:
    so it is finite and > 0, and the kernels' per-block multipliers stay finite), naming the
    argument. Reads the values (one host sync on a GPU)."""
    for name, values in (
        ("a4_fc1_encode_scale", scales.fc1_encode_scale),
        ("a4_fc2_encode_scales", scales.fc2_encode_scales),
    ):
        if not bool(((values >= 1.0 / ENCODE_SCALE_LIMIT) & (values <= ENCODE_SCALE_LIMIT)).all()):
            raise ValueError(
                f"{name} must lie within [2**-100, 2**100] everywhere (finite, > 0, and small enough "
                f"for the kernels' per-block multipliers), got {values.tolist()[:8]}"
            )


NOT_LOCAL = -1
"""The expert id of a route whose expert another expert-parallel rank holds: it contributes
nothing to this rank's output (vLLM's expert map gives -1 to experts of other ranks)."""


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise if any id lies outside [-1, num_experts) (-1: :data:`NOT_LOCAL`). Reads device
    memory (one host sync)."""
    if topk_ids.numel() == 0:
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < NOT_LOCAL or high >= num_experts:
        raise ValueError(
            f"topk_ids must lie in [0, {num_experts}), or be -1 for a route whose expert another "
            f"expert-parallel rank holds; got values in [{low}, {high}]"
        )
