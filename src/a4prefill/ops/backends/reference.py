"""The ``reference`` backend: :mod:`a4prefill.ops.reference` on any device (host reads ids)."""

from __future__ import annotations

import torch

from a4prefill.ops.backends.base import MoEBackend
from a4prefill.ops.checks import check_expert_ids
from a4prefill.ops.precision import A4, A8, PRECISIONS, MoECall, RowPlan
from a4prefill.ops.reference import moe_reference, moe_reference_a8


class ReferenceBackend(MoEBackend):
    """The numerics oracle as a backend, every precision (A8 with :func:`moe_reference_a8`). Not
    capture-safe (reads ``topk_ids`` on the host)."""

    name = "reference"
    precisions = PRECISIONS

    def unsupported_reason(self, device: torch.device) -> str | None:
        return None

    def run_uniform(self, call: MoECall, precision: str) -> torch.Tensor:
        self.check_plan(call, RowPlan.uniform(precision, call.num_rows))
        check_expert_ids(call.topk_ids, call.experts.w13_weight.shape[0])
        routing = (call.hidden_states, call.topk_weights, call.topk_ids, call.experts)
        if precision == A8:
            return moe_reference_a8(*routing, call.swiglu_limit)
        scales = call.a4_scales if precision == A4 else None
        return moe_reference(*routing, scales, call.swiglu_limit)
