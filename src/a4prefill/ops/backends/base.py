"""The backend interface: run one MoE call under its row plan (:mod:`a4prefill.ops.precision`)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.precision import A4, PRECISIONS, SPLIT, W4A16, MoECall, RowPlan
from a4prefill.ops.rows import Span
from a4prefill.ops.scales import A4Scales


def _row_selector(spans: tuple[Span, ...], device: torch.device) -> slice | torch.Tensor:
    """A slice for one span, else an index tensor (copied from pinned memory without a sync)."""
    if len(spans) == 1:
        return slice(*spans[0])
    index = torch.tensor([row for start, end in spans for row in range(start, end)], dtype=torch.long)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


@dataclass(frozen=True)
class WarmUp:
    """What :meth:`MoEBackend.warm_up` did for one layer: distinct launch plans over the token
    counts it covered, MoE calls it ran, wall seconds."""

    plans: int
    calls: int
    seconds: float


class MoEBackend(abc.ABC):
    """One implementation of the NVFP4 MoE. Calls are validated before they reach it.

    A backend executes a :class:`~a4prefill.ops.precision.MoECall` under a
    :class:`~a4prefill.ops.precision.RowPlan` (which rows run W4A16 and which the prefill
    precision) and returns a new ``[T, H]`` tensor in the activations' dtype. It decides nothing
    about precision: rows the plan gives W4A16 run W4A16 even where the call carries the layer's
    A4 scales. ``precisions``: those it has kernels for; the ops never hand it a plan with rows
    of another (:meth:`refuses`).
    """

    name: str
    precisions: tuple[str, ...] = (W4A16, A4)

    def refuses(self, precision: str, device: torch.device | None = None) -> str | None:
        """Why this backend cannot run rows in ``precision`` (one of
        :data:`~a4prefill.ops.precision.PRECISIONS`) on ``device`` (None: on any device it runs
        on), or None if it can. Host arithmetic only; the ops ask before every call, the vLLM
        integration at load time."""
        if precision in self.precisions:
            return None
        return (
            f"the {self.name} backend has no {precision.upper()} kernel, so a4prefill.prefill_precision "
            f"{precision!r} cannot run on it: use prefill_precision 'a4', or A4PREFILL_BACKEND=reference "
            f"to check {precision.upper()} numerics (not speed)"
        )

    def check_plan(self, call: MoECall, plan: RowPlan) -> None:
        """Raise ``ValueError`` (naming the layer) if ``plan`` gives rows a precision this backend
        :meth:`refuses`, or A4 rows to a call without ``a4_scales``: a wrong precision is a wrong
        result, so nothing falls back."""
        for precision in plan.precisions:
            reason = self.refuses(precision, call.hidden_states.device)
            if reason is not None:
                raise ValueError(f"layer {call.layer_name!r}: {reason}")
        if A4 in plan.precisions and call.a4_scales is None:
            raise ValueError(f"layer {call.layer_name!r}: the plan has A4 rows but the call no a4_scales")

    @abc.abstractmethod
    def unsupported_reason(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device``, or None if it can."""

    def kernel_family(self, call: MoECall, plan: RowPlan) -> str:
        """What runs ``call`` under ``plan``: one of :data:`a4prefill.ops.counters.KERNEL_FAMILIES`
        (the device row counters count calls per family). Host arithmetic on shapes only. This
        default is the backend's name."""
        return self.name

    @abc.abstractmethod
    def run_uniform(self, call: MoECall, precision: str) -> torch.Tensor:
        """Every row of ``call`` in ``precision`` (``W4A16``; ``A4`` with ``call.a4_scales``; ``A8``
        where :attr:`precisions` has it)."""

    def run(self, call: MoECall, plan: RowPlan) -> torch.Tensor:
        """``call`` under ``plan``. This default runs a uniform plan as one call and a split plan
        as one call per precision on that precision's rows (gathered: a slice where contiguous),
        into one output."""
        if plan.kind != SPLIT:
            return self.run_uniform(call, plan.kind)
        output = torch.empty_like(call.hidden_states)
        for precision in PRECISIONS:
            spans = plan.spans(precision)
            if spans:
                rows = _row_selector(spans, call.hidden_states.device)
                output[rows] = self.run_uniform(call.select(rows), precision)
        return output

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
        """Compile now everything that later calls on this layer (``experts``, ``a4_scales``,
        ``swiglu_limit`` as its calls pass them; ``1 .. max_tokens`` tokens of ``dtype``,
        top-``top_k``; every precision the layer can run: W4A16, A4 with ``a4_scales``, A8 with
        ``a8``) would compile. Called at load time, before any CUDA graph is captured. This
        default compiles nothing (for backends without just-in-time kernels)."""
        return WarmUp(0, 0, 0.0)
