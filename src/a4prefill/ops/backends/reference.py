"""The ``reference`` backend: :mod:`a4prefill.ops.reference` on any device (host reads ids)."""

from __future__ import annotations

import torch

from a4prefill.ops.backends.base import MoEBackend
from a4prefill.ops.checks import check_expert_ids
from a4prefill.ops.precision import A4, MoECall
from a4prefill.ops.reference import moe_reference


class ReferenceBackend(MoEBackend):
    """The numerics oracle as a backend. Not capture-safe (reads ``topk_ids`` on the host)."""

    name = "reference"

    def unsupported_reason(self, device: torch.device) -> str | None:
        return None

    def run_uniform(self, call: MoECall, precision: str) -> torch.Tensor:
        check_expert_ids(call.topk_ids, call.experts.w13_weight.shape[0])
        scales = call.a4_scales if precision == A4 else None
        return moe_reference(
            call.hidden_states, call.topk_weights, call.topk_ids, call.experts, scales, call.swiglu_limit
        )
