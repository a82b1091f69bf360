"""What each vLLM worker (rank) ran, read inside the worker through vLLM's worker RPC.

The functions here are passed to ``LLM.collective_rpc``: vLLM calls each with the worker as its
only argument, in the worker's process (the caller's own process with one rank and the
in-process executor; separate processes under tensor or expert parallelism with
``distributed_executor_backend="mp"``). They must stay module-level so that the multiprocessing
executor can pickle them by reference. Their results are plain lists and dicts (picklable,
JSON-ready).

State: :data:`_FORWARD_LOG` is the worker process's log of forward passes between two
:func:`snapshot` calls (diagnostics only; it carries no precision decision). It exists from
:func:`start_forward_log` to :func:`stop_forward_log`.

Who may call: :mod:`a4prefill.tools.e2e` (through ``collective_rpc``); tests.
"""

from __future__ import annotations

from typing import Any

# (cudagraph_runtime_mode name, tokens) of every forward pass since the last snapshot, while on
_FORWARD_LOG: list[tuple[str, int]] | None = None
_ORIGINAL_CREATE: Any = None


def worker_rank(worker: Any) -> int:
    """The worker's global rank (0 for vLLM's in-process single worker)."""
    rank = getattr(worker, "rank", None)
    if rank is None:
        rank = getattr(getattr(worker, "worker", None), "rank", 0)
    return int(rank or 0)


def _vllm_config(worker: Any) -> Any:
    config = getattr(worker, "vllm_config", None)
    return config if config is not None else worker.worker.vllm_config


def start_forward_log(worker: Any) -> int:
    """Start recording ``(cudagraph_runtime_mode, tokens)`` of every model forward pass in this
    worker process (vLLM's forward context creation, wrapped); returns the worker's rank.
    Calling it again while recording keeps the one log."""
    global _FORWARD_LOG, _ORIGINAL_CREATE
    import vllm.forward_context as forward_context

    if _FORWARD_LOG is None:
        _FORWARD_LOG = []
        _ORIGINAL_CREATE = create = forward_context.create_forward_context

        def recording(attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            context = create(attn_metadata, *args, **kwargs)
            if attn_metadata is not None and _FORWARD_LOG is not None:
                descriptor = context.batch_descriptor
                tokens = int(descriptor.num_tokens) if descriptor is not None else -1
                _FORWARD_LOG.append((context.cudagraph_runtime_mode.name, tokens))
            return context

        forward_context.create_forward_context = recording
    return worker_rank(worker)


def stop_forward_log(worker: Any) -> None:
    """Restore vLLM's forward context creation and drop the log (no-op when not recording)."""
    global _FORWARD_LOG, _ORIGINAL_CREATE
    import vllm.forward_context as forward_context

    if _ORIGINAL_CREATE is not None:
        forward_context.create_forward_context = _ORIGINAL_CREATE
    _FORWARD_LOG, _ORIGINAL_CREATE = None, None


def _entries(snapshot: dict[tuple[str, str], int]) -> list[list[Any]]:
    return [[layer, key, count] for (layer, key), count in sorted(snapshot.items())]


def snapshot(worker: Any) -> dict[str, Any]:
    """This worker's cumulative row counters and the forward passes since the last snapshot
    (which it drains): ``rank``; ``rows`` ``[[layer, "w4a16" | "a4", rows], ...]`` from the host
    counters; ``device_rows`` and ``kernel_calls`` (``[[layer, kernel family, calls], ...]``) from
    the device counters, ``None`` when none are attached (``count_rows`` off); ``forward``
    ``[[mode, tokens], ...]``."""
    from a4prefill.ops import DEVICE_ROW_COUNTERS, ROW_COUNTERS

    counting = DEVICE_ROW_COUNTERS.attached()
    forward = list(_FORWARD_LOG or [])
    if _FORWARD_LOG is not None:
        _FORWARD_LOG.clear()
    return {
        "rank": worker_rank(worker),
        "rows": _entries(ROW_COUNTERS.snapshot()),
        "device_rows": _entries(DEVICE_ROW_COUNTERS.snapshot()) if counting else None,
        "kernel_calls": _entries(DEVICE_ROW_COUNTERS.kernel_calls()) if counting else None,
        "forward": [list(entry) for entry in forward],
    }


def pass_records(worker: Any) -> list[dict[str, Any]]:
    """What this worker's split pass did per compiled graph: token range, captured limit, the
    nodes it rewrote and the nodes it kept with the reason (empty without the pass)."""
    from a4prefill.passes.split_prefill import PASS_KEY

    split_pass = _vllm_config(worker).compilation_config.inductor_compile_config.get(PASS_KEY)
    records = getattr(split_pass, "records", None) or []
    return [
        {
            "token_range": str(record.token_range),
            "captured_limit": record.captured_limit,
            "rewritten": [str(n) for n in record.rewritten],
            "kept": [[str(n), str(r)] for n, r in record.kept],
        }
        for record in records
    ]


def parallel_layout(worker: Any) -> dict[str, Any]:
    """The worker's parallel configuration: tensor, pipeline and data parallel sizes, whether
    experts are parallel, and its rank."""
    parallel = _vllm_config(worker).parallel_config
    return {
        "rank": worker_rank(worker),
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "pipeline_parallel_size": int(parallel.pipeline_parallel_size),
        "data_parallel_size": int(parallel.data_parallel_size),
        "enable_expert_parallel": bool(parallel.enable_expert_parallel),
    }
