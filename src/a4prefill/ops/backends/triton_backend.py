"""The ``triton`` backend: :mod:`triton_moe`'s fused MoE behind the backend interface, with its
load-time warm-up (:mod:`triton_warmup`). Registration (in ``backends/__init__.py``):
``register_backend("triton", TritonBackend, priority=10)``.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from a4prefill.ops.backends import triton_warmup
from a4prefill.ops.backends.base import MoEBackend, WarmUp
from a4prefill.ops.backends.triton_moe import fused_moe, plan_call, row_flags_for
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.rows import RowTypes
from a4prefill.ops.scales import A4Scales


class TritonBackend(MoEBackend):
    """Grouped NVFP4 MoE in Triton (any CUDA GPU). Capture-safe, no host syncs.

    ``run_split`` runs every row in one set of launches with a per-row precision flag (decode
    and padding rows W4A16, prefill rows A4) into one output, without gathers.
    Out-of-range expert ids: those routes are ignored (:mod:`triton_moe`).
    """

    name = "triton"

    def unsupported_reason(self, device: torch.device) -> str | None:
        if torch.device(device).type != "cuda":
            return f"needs a CUDA device, got {device}"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        try:
            importlib.import_module("a4prefill.ops.backends.triton_kernels")
        except Exception as error:  # pragma: no cover - depends on the triton install
            return f"triton kernels do not import: {error}"
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
        return fused_moe(hidden_states, topk_weights, topk_ids, experts, a4_scales, swiglu_limit)

    def kernel_family(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, experts: NvFp4Experts
    ) -> str:
        """``triton-decode`` where the call's :class:`CallPlan` runs the decode kernels, else
        ``triton-tiled``."""
        num_experts, two_i, hidden = (
            experts.w13_weight.shape[0],
            experts.w13_weight.shape[1],
            hidden_states.shape[1],
        )
        plan = plan_call(
            hidden_states.shape[0],
            topk_ids.shape[1],
            num_experts,
            hidden,
            two_i // 2,
            hidden_states.dtype,
            hidden_states.device,
        )
        return "triton-tiled" if plan.decode is None else "triton-decode"

    def warm_up(
        self,
        experts: NvFp4Experts,
        a4_scales: A4Scales | None,
        swiglu_limit: float | None,
        max_tokens: int,
        dtype: torch.dtype,
        top_k: int,
    ) -> WarmUp:
        """One call per launch plan and precision (:mod:`triton_warmup`)."""
        return triton_warmup.warm_up(experts, a4_scales, swiglu_limit, max_tokens, dtype, top_k)

    def run_split(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: NvFp4Experts,
        a4_scales: A4Scales,
        swiglu_limit: float | None,
        row_types: RowTypes,
    ) -> torch.Tensor:
        flags = row_flags_for(row_types, hidden_states.device)
        return fused_moe(hidden_states, topk_weights, topk_ids, experts, a4_scales, swiglu_limit, flags)
