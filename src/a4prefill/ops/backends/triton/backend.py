"""The ``triton`` backend: :mod:`fused`'s fused MoE behind the backend interface, with its
load-time warm-up (:mod:`warmup`). Registration (in ``backends/__init__.py``):
``register_backend("triton", TritonBackend, priority=10)``.
"""

from __future__ import annotations

import importlib.util

import torch

from a4prefill.ops.backends.base import MoEBackend, WarmUp
from a4prefill.ops.backends.triton import kernel_modules, warmup
from a4prefill.ops.backends.triton.fused import fused_moe, row_flags_for
from a4prefill.ops.backends.triton.fused_a8 import a8_device_refusal, fused_moe_a8
from a4prefill.ops.backends.triton.plan import plan_call
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.precision import A8, PRECISIONS, W4A16, MoECall, RowPlan
from a4prefill.ops.scales import A4Scales


class TritonBackend(MoEBackend):
    """Grouped NVFP4 MoE in Triton (any CUDA GPU; A8 rows on sm_90 only). Capture-safe, no host
    syncs.

    A W4A16, A4 or W4A16/A4 split plan runs every row in one set of launches with a per-row
    precision flag (decode and padding rows W4A16, prefill rows A4) into one output, without
    gathers. A plan with A8 rows runs them through :func:`fused_a8.fused_moe_a8` and, split, its
    W4A16 rows as a W4A16 call of their own (the rows gathered, a slice where contiguous;
    :meth:`MoEBackend.run`). Out-of-range expert ids: those routes are ignored (:mod:`fused`).
    """

    name = "triton"
    precisions = PRECISIONS

    def refuses(self, precision: str, device: torch.device | None = None) -> str | None:
        """A8 only where :func:`fused_a8.a8_device_refusal` finds no reason on ``device`` (an
        sm_90 GPU); with ``device`` None, on the current CUDA device."""
        if precision != A8:
            return super().refuses(precision, device)
        reason = a8_device_refusal(torch.device(device if device is not None else "cuda"))
        return None if reason is None else f"{reason}: a4prefill.prefill_precision 'a8' cannot run here"

    def unsupported_reason(self, device: torch.device) -> str | None:
        if torch.device(device).type != "cuda":
            return f"needs a CUDA device, got {device}"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        try:
            kernel_modules.shared()
            kernel_modules.tiled()
        except Exception as error:  # pragma: no cover - depends on the triton install
            return f"triton kernels do not import: {error}"
        return None

    def run(self, call: MoECall, plan: RowPlan) -> torch.Tensor:
        """One set of launches for a plan without A8 rows (a split plan flags each row's
        precision); a plan with A8 rows as the class docstring says. A plan this device cannot
        run raises (:meth:`~MoEBackend.check_plan`)."""
        self.check_plan(call, plan)
        if A8 in plan.precisions:
            return super().run(call, plan)
        scales = None if plan.kind == W4A16 else call.a4_scales
        flags = None
        if plan.row_types is not None:
            flags = row_flags_for(plan.row_types, call.hidden_states.device)
        routing = (call.topk_weights, call.topk_ids)
        return fused_moe(call.hidden_states, *routing, call.experts, scales, call.swiglu_limit, flags)

    def run_uniform(self, call: MoECall, precision: str) -> torch.Tensor:
        if precision == A8:
            routing = (call.topk_weights, call.topk_ids)
            return fused_moe_a8(call.hidden_states, *routing, call.experts, call.swiglu_limit)
        return self.run(call, RowPlan.uniform(precision, call.num_rows))

    def kernel_family(self, call: MoECall, plan: RowPlan) -> str:
        """``triton-decode`` where the call's :class:`plan.CallPlan` runs the decode kernels,
        ``triton-prefill`` where it runs the Hopper prefill kernels (any precision plan) or the
        plan has A8 rows (their GEMMs are the prefill kernel's), else ``triton-tiled``."""
        if A8 in plan.precisions:
            return "triton-prefill"
        hidden_states, fc1 = call.hidden_states, call.experts.fc1
        call_plan = plan_call(
            hidden_states.shape[0],
            call.topk_ids.shape[1],
            fc1.experts,
            hidden_states.shape[1],
            fc1.rows // 2,
            hidden_states.dtype,
            hidden_states.device,
        )
        if call_plan.decode is not None:
            return "triton-decode"
        if call_plan.prefill is not None:
            return "triton-prefill"
        return "triton-tiled"

    def warm_up(
        self,
        experts: NvFp4Experts,
        a4_scales: A4Scales | None,
        swiglu_limit: float | None,
        max_tokens: int,
        dtype: torch.dtype,
        top_k: int,
        a8: bool = False,
    ) -> WarmUp:
        """One call per launch plan and precision (:mod:`warmup`)."""
        return warmup.warm_up(experts, a4_scales, swiglu_limit, max_tokens, dtype, top_k, a8)
