"""The ``reference`` backend: :mod:`a4prefill.ops.reference` on any device (host reads ids)."""

from __future__ import annotations

import torch

from a4prefill.ops.backends.base import MoEBackend
from a4prefill.ops.checks import check_expert_ids
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.reference import moe_reference
from a4prefill.ops.scales import A4Scales


class ReferenceBackend(MoEBackend):
    """The numerics oracle as a backend. Not capture-safe (reads ``topk_ids`` on the host)."""

    name = "reference"

    def unsupported_reason(self, device: torch.device) -> str | None:
        return None

    def run(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: NvFp4Experts,
        a4_scales: A4Scales | None,
        swiglu_limit: float | None,
    ) -> torch.Tensor:
        check_expert_ids(topk_ids, experts.w13_weight.shape[0])
        return moe_reference(hidden_states, topk_weights, topk_ids, experts, a4_scales, swiglu_limit)
