"""The backend interface: run the MoE on rows in one precision, or split by row types."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.rows import RowTypes, Span
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
    """One implementation of the NVFP4 MoE. Arguments are validated before they reach it.

    Shapes: ``hidden_states [T, H]`` bf16/fp16, ``topk_weights [T, k]``, ``topk_ids [T, k]``,
    ``experts`` as :class:`NvFp4Experts`. Returns a new ``[T, H]`` tensor in the input dtype.
    """

    name: str

    @abc.abstractmethod
    def unsupported_reason(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device``, or None if it can."""

    def kernel_family(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, experts: NvFp4Experts
    ) -> str:
        """What runs a call on ``hidden_states [T, H]`` with ``topk_ids [T, k]``: one of
        :data:`a4prefill.ops.counters.KERNEL_FAMILIES` (the device row counters count calls per
        family). Host arithmetic on shapes only. This default is the backend's name."""
        return self.name

    @abc.abstractmethod
    def run(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: NvFp4Experts,
        a4_scales: A4Scales | None,
        swiglu_limit: float | None,
    ) -> torch.Tensor:
        """Every row W4A16 when ``a4_scales`` is None, else every row A4."""

    def warm_up(
        self,
        experts: NvFp4Experts,
        a4_scales: A4Scales | None,
        swiglu_limit: float | None,
        max_tokens: int,
        dtype: torch.dtype,
        top_k: int,
    ) -> WarmUp:
        """Compile now everything that later calls on this layer (``experts``, ``a4_scales``,
        ``swiglu_limit`` as its calls pass them; ``1 .. max_tokens`` tokens of ``dtype``,
        top-``top_k``; every precision the layer can run) would compile. Called at load time,
        before any CUDA graph is captured. This default compiles nothing (for backends without
        just-in-time kernels)."""
        return WarmUp(0, 0, 0.0)

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
        """Prefill rows A4, all other rows W4A16. This default gathers each precision's rows
        (a slice when they are contiguous) and runs them as two calls."""
        output = torch.empty_like(hidden_states)
        w4a16_spans = tuple(sorted(row_types.decode + row_types.padding))
        for spans, scales in ((w4a16_spans, None), (row_types.prefill, a4_scales)):
            if not spans:
                continue
            rows = _row_selector(spans, hidden_states.device)
            output[rows] = self.run(
                hidden_states[rows], topk_weights[rows], topk_ids[rows], experts, scales, swiglu_limit
            )
        return output
