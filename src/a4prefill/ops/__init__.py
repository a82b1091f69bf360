"""NVFP4 MoE ops: format, reference, custom ops, row types, backends.

Importing this package registers ``torch.ops.a4prefill.{moe_w4a16, moe_a4, moe_split}``.
"""

from a4prefill.ops.counters import DEVICE_ROW_COUNTERS, ROW_COUNTERS
from a4prefill.ops.modelopt import NvFp4Experts, NvFp4MoEWeights, dequantize_experts, quantize_moe_weights
from a4prefill.ops.moe import call_moe, moe_a4, moe_split, moe_w4a16
from a4prefill.ops.precision import MoECall, RowPlan
from a4prefill.ops.rows import (
    RowTypes,
    current_row_types,
    row_types_from_query_lens,
    row_types_from_query_start_loc,
    set_row_provider,
    shard_row_types,
    step_row_types,
)
from a4prefill.ops.scales import A4Calibration, A4Scales, a4_calibration, derive_a4_scales
from a4prefill.process_state import reset_process_state

__all__ = [
    "DEVICE_ROW_COUNTERS",
    "ROW_COUNTERS",
    "A4Calibration",
    "A4Scales",
    "MoECall",
    "NvFp4Experts",
    "NvFp4MoEWeights",
    "RowPlan",
    "RowTypes",
    "a4_calibration",
    "call_moe",
    "current_row_types",
    "dequantize_experts",
    "derive_a4_scales",
    "moe_a4",
    "moe_split",
    "moe_w4a16",
    "quantize_moe_weights",
    "reset_process_state",
    "row_types_from_query_lens",
    "row_types_from_query_start_loc",
    "set_row_provider",
    "shard_row_types",
    "step_row_types",
]
