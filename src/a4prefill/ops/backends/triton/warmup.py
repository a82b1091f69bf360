"""Load-time warm-up of the ``triton`` backend: every kernel a layer's calls may launch is compiled
before the engine serves, none while it serves.

Triton compiles a kernel the first time it is launched with a new specialization (constexprs,
argument dtypes, 16-byte alignment of pointers, sizes divisible by 16). A compile while serving
is a latency spike of seconds, and vLLM's JIT monitor (``jit_monitor_mode``, on after the
engine's warm-up) warns about it or, in ``error`` mode, fails the request. What a
:func:`~a4prefill.ops.backends.triton.fused.fused_moe` call launches is fixed by its
:class:`~a4prefill.ops.backends.triton.plan.CallPlan` (a function of the token count, given the
layer's shapes, io dtype and device) and its precision mode: the kernels take the token and
route counts unspecialized, the router outputs as fp32 weights and int32 ids, and every input
aligned. So running the layer once per distinct plan among ``1 .. max_tokens`` tokens, in each
precision the layer can run, compiles everything it can launch later. What Triton and vLLM do
that this relies on: docs/vllm-internals.md, section 9.

Who may call: :meth:`TritonBackend.warm_up <a4prefill.ops.backends.triton.backend.TritonBackend>`
(weight processing, before any CUDA graph is captured), tests.
"""

from __future__ import annotations

import time

import torch

from a4prefill.ops.backends.base import WarmUp
from a4prefill.ops.backends.triton.fused import fused_moe
from a4prefill.ops.backends.triton.fused_a8 import fused_moe_a8
from a4prefill.ops.backends.triton.plan import CallPlan, plan_call
from a4prefill.ops.backends.triton.routing import RoutingLaunch, routing_launch
from a4prefill.ops.backends.triton.schedules import PrefillGemm, choose_a8_schedule
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.scales import A4Scales


def plan_representatives(
    max_tokens: int,
    top_k: int,
    experts: int,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[CallPlan, int]:
    """The smallest token count of each distinct :class:`CallPlan` among calls of ``1 ..
    max_tokens`` tokens (in increasing token counts). Host arithmetic only."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    representatives: dict[CallPlan, int] = {}
    for tokens in range(1, max_tokens + 1):
        plan = plan_call(tokens, top_k, experts, hidden, intermediate, dtype, device)
        representatives.setdefault(plan, tokens)
    return representatives


def a8_representatives(
    max_tokens: int, top_k: int, experts: int, hidden: int
) -> dict[tuple[PrefillGemm, RoutingLaunch], int]:
    """The smallest token count of each distinct schedule and routing launch of A8 calls
    (:func:`fused_a8.fused_moe_a8`, :func:`schedules.choose_a8_schedule`) of ``1 .. max_tokens``
    tokens on a layer of ``experts`` experts and ``hidden`` activation columns: the rest of such a
    call launches the same kernels at every size (its GEMMs take the route count unspecialized).
    Host arithmetic only."""
    representatives: dict[tuple[PrefillGemm, RoutingLaunch], int] = {}
    for tokens in range(1, max_tokens + 1):
        schedule = choose_a8_schedule(tokens * top_k, experts, hidden)
        representatives.setdefault((schedule, routing_launch(tokens * top_k, schedule.routes)), tokens)
    return representatives


def warm_up(
    experts: NvFp4Experts,
    a4_scales: A4Scales | None,
    swiglu_limit: float | None,
    max_tokens: int,
    dtype: torch.dtype,
    top_k: int,
    a8: bool = False,
) -> WarmUp:
    """Run the layer ``experts`` (on its device) once per plan of :func:`plan_representatives`
    with ``dtype`` activations and top-``top_k`` routing, W4A16 and, with ``a4_scales``, also A4
    and split (half the rows A4), and with ``a8`` once A8 per schedule and routing launch of
    :func:`a8_representatives` (a split plan's A8 rows are an A8 call of their own): zero
    activations, routes spread over the experts, outputs discarded. ``swiglu_limit`` as the
    layer's calls pass it. Synchronizes once at the end. Allocates: call at load time, never while
    a stream captures."""
    started = time.perf_counter()
    fc1 = experts.fc1
    num_experts, hidden, intermediate = fc1.experts, fc1.columns, fc1.rows // 2
    device = fc1.codes.device
    plans = plan_representatives(max_tokens, top_k, num_experts, hidden, intermediate, dtype, device)

    def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.zeros(tokens, hidden, dtype=dtype, device=device)
        ids = (
            (torch.arange(tokens * top_k, device=device) % num_experts).to(torch.int32).reshape(tokens, top_k)
        )
        return x, torch.full((tokens, top_k), 1.0 / top_k, device=device), ids

    calls = 0
    for tokens in plans.values():
        x, weights, ids = inputs(tokens)
        fused_moe(x, weights, ids, experts, None, swiglu_limit)
        calls += 1
        if a4_scales is not None:
            flags = (torch.arange(tokens, device=device) % 2).to(torch.uint8)
            fused_moe(x, weights, ids, experts, a4_scales, swiglu_limit)
            fused_moe(x, weights, ids, experts, a4_scales, swiglu_limit, flags)
            calls += 2
    a8_launches = a8_representatives(max_tokens, top_k, num_experts, hidden) if a8 else {}
    for tokens in a8_launches.values():
        fused_moe_a8(*inputs(tokens), experts, swiglu_limit)
        calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return WarmUp(len(plans) + len(a8_launches), calls, time.perf_counter() - started)
