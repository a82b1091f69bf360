"""The custom ops ``torch.ops.a4prefill.{moe_w4a16, moe_a4, moe_split}`` and their fake impls.

All three share one schema: hidden states, router outputs, vLLM's ModelOpt NVFP4 MoE
parameter set (see :class:`~a4prefill.ops.modelopt.NvFp4MoEWeights`), the layer name (for
counters, warnings and the per-layer scale cache) and the optional swiglu clamp limit. They are
functional: each returns a new ``[T, H]`` tensor in the dtype of ``hidden_states``.

- ``moe_w4a16``: every row W4A16 (input scales are ignored);
- ``moe_a4``: every row A4; an invalid calibration is an error;
- ``moe_split``: decode and padding rows W4A16, prefill rows A4, rows typed at run time by
  :func:`a4prefill.ops.rows.current_row_types`; every row W4A16 while a CUDA stream is
  capturing and for a layer without a valid calibration (one warning per layer).
"""

from __future__ import annotations

from typing import Any

import torch

from a4prefill.ops.backends import backend_for
from a4prefill.ops.checks import check_expert_ids, check_moe_inputs
from a4prefill.ops.counters import A4, ROW_COUNTERS, W4A16
from a4prefill.ops.modelopt import NvFp4MoEWeights
from a4prefill.ops.rows import current_row_types
from a4prefill.ops.scales import LAYER_SCALES

NAMESPACE = "a4prefill"
SCHEMA = (
    "(Tensor hidden_states, Tensor topk_weights, Tensor topk_ids, Tensor w13_weight, "
    "Tensor w13_weight_scale, Tensor w13_weight_scale_2, Tensor w13_input_scale, "
    "Tensor w2_weight, Tensor w2_weight_scale, Tensor w2_weight_scale_2, Tensor w2_input_scale, "
    "str layer_name, float? swiglu_limit=None) -> Tensor"
)
OP_NAMES = ("moe_w4a16", "moe_a4", "moe_split")

_library = torch.library.Library(NAMESPACE, "DEF")
for _name in OP_NAMES:
    _library.define(_name + SCHEMA)


_Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor, NvFp4MoEWeights, str, "float | None"]


def _unpack(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_weight_scale: torch.Tensor,
    w13_weight_scale_2: torch.Tensor,
    w13_input_scale: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_weight_scale: torch.Tensor,
    w2_weight_scale_2: torch.Tensor,
    w2_input_scale: torch.Tensor,
    layer_name: str,
    swiglu_limit: float | None = None,
) -> _Unpacked:
    """The schema's arguments with the parameter set bundled (the dispatcher may drop the
    trailing default)."""
    weights = NvFp4MoEWeights(
        w13_weight,
        w13_weight_scale,
        w13_weight_scale_2,
        w13_input_scale,
        w2_weight,
        w2_weight_scale,
        w2_weight_scale_2,
        w2_input_scale,
    )
    return hidden_states, topk_weights, topk_ids, weights, layer_name, swiglu_limit


def _validated(*args: Any, **kwargs: Any) -> _Unpacked:
    unpacked = _unpack(*args, **kwargs)
    hidden_states, topk_weights, topk_ids, weights, _, swiglu_limit = unpacked
    geometry = check_moe_inputs(hidden_states, topk_weights, topk_ids, weights, swiglu_limit)
    if topk_ids.device.type == "cpu":
        check_expert_ids(topk_ids, geometry.experts)
    return unpacked


def is_capturing(tensor: torch.Tensor) -> bool:
    """True while ``tensor``'s CUDA stream is being captured into a CUDA graph."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _moe_w4a16(*args: Any, **kwargs: Any) -> torch.Tensor:
    hidden_states, topk_weights, topk_ids, weights, layer_name, limit = _validated(*args, **kwargs)
    ROW_COUNTERS.record(layer_name, W4A16, hidden_states.shape[0])
    backend = backend_for(hidden_states.device)
    return backend.run(hidden_states, topk_weights, topk_ids, weights, None, limit)


def _moe_a4(*args: Any, **kwargs: Any) -> torch.Tensor:
    hidden_states, topk_weights, topk_ids, weights, layer_name, limit = _validated(*args, **kwargs)
    scales = LAYER_SCALES.lookup(layer_name, weights.w13_input_scale, weights.w2_input_scale)
    if scales is None:
        reason = LAYER_SCALES.uncalibrated_layers().get(layer_name, "invalid input scales")
        raise ValueError(f"moe_a4 on layer {layer_name!r} needs calibrated input scales: {reason}")
    ROW_COUNTERS.record(layer_name, A4, hidden_states.shape[0])
    backend = backend_for(hidden_states.device)
    return backend.run(hidden_states, topk_weights, topk_ids, weights, scales, limit)


def _moe_split(*args: Any, **kwargs: Any) -> torch.Tensor:
    hidden_states, topk_weights, topk_ids, weights, layer_name, limit = _validated(*args, **kwargs)
    num_rows = hidden_states.shape[0]
    backend = backend_for(hidden_states.device)
    if is_capturing(hidden_states):
        ROW_COUNTERS.record(layer_name, W4A16, num_rows)
        return backend.run(hidden_states, topk_weights, topk_ids, weights, None, limit)
    row_types = current_row_types(num_rows)
    prefill_rows = row_types.num_prefill_rows
    scales = None
    if prefill_rows:
        scales = LAYER_SCALES.lookup(layer_name, weights.w13_input_scale, weights.w2_input_scale)
    if scales is None or prefill_rows == 0:
        ROW_COUNTERS.record(layer_name, W4A16, num_rows)
        return backend.run(hidden_states, topk_weights, topk_ids, weights, None, limit)
    ROW_COUNTERS.record(layer_name, W4A16, num_rows - prefill_rows)
    ROW_COUNTERS.record(layer_name, A4, prefill_rows)
    if prefill_rows == num_rows:
        return backend.run(hidden_states, topk_weights, topk_ids, weights, scales, limit)
    return backend.run_split(hidden_states, topk_weights, topk_ids, weights, scales, limit, row_types)


def _moe_fake(*args: Any, **kwargs: Any) -> torch.Tensor:
    hidden_states, topk_weights, topk_ids, weights, _, swiglu_limit = _unpack(*args, **kwargs)
    check_moe_inputs(hidden_states, topk_weights, topk_ids, weights, swiglu_limit)
    return torch.empty_like(hidden_states)


for _name, _impl in zip(OP_NAMES, (_moe_w4a16, _moe_a4, _moe_split), strict=True):
    torch.library.impl(f"{NAMESPACE}::{_name}", "CompositeExplicitAutograd", lib=_library)(_impl)
    torch.library.register_fake(f"{NAMESPACE}::{_name}", lib=_library)(_moe_fake)

moe_w4a16 = torch.ops.a4prefill.moe_w4a16.default
moe_a4 = torch.ops.a4prefill.moe_a4.default
moe_split = torch.ops.a4prefill.moe_split.default


def call_moe(
    op: torch._ops.OpOverload,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: NvFp4MoEWeights,
    layer_name: str,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Call one of the ops above with the parameters bundled in ``weights``."""
    return op(hidden_states, topk_weights, topk_ids, *weights.tensors(), layer_name, swiglu_limit)
