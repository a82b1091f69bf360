"""The audit log of precision (setting ``row_log``): one JSON line per forward pass, per process.

Installed by :func:`install` (called by :func:`~a4prefill.vllm_integration.engine.engine_setup`
in every engine process when ``row_log`` is set; nothing is installed otherwise). It wraps vLLM's
``create_forward_context``: when a forward pass with attention metadata begins, the previous one's
record is written to ``<row_log>.rank<R>`` (``R``: the process's global rank, 0 without
``torch.distributed``), and the last one at exit. A record (``"kind": "step"``) holds:

- ``rank``, ``step`` (forward passes with metadata, counted from 0), ``mode`` (the pass's
  ``cudagraph_runtime_mode`` name: ``NONE`` uncaptured), ``tokens`` (its batch descriptor's
  token count, -1 without one);
- ``rows``: ``[[num_rows, prefill, decode, padding], ...]``, the row types the row provider gave
  this pass (one entry per call size; empty when no split op asked, e.g. a captured pass);
- ``layers``: ``{layer: {"w4a16": rows, "a4": rows, "a8": rows}}`` that ran in this pass, from the device
  counters where ``count_rows`` attached them (replays of captured graphs count), else the host
  counters (a captured replay counts nothing there); ``counters``: ``"device"`` or ``"host"``;
- ``write_us``: how long writing the previous record took (the log's own cost).

Before a step record, a ``"kind": "layers"`` record gives ``{layer: load-time status}`` whenever
the engine's statuses changed (after loading, after a reload). :mod:`a4prefill.tools.audit`
reads the files and checks the rule.

State: one :class:`_AuditLog` per process (:data:`_installed`), registered with its reset
(restores vLLM's function, writes the pending record, closes the file). It records what ran and
decides nothing. Who may call: :func:`~a4prefill.vllm_integration.engine.engine_setup`; tests.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from a4prefill.ops import DEVICE_ROW_COUNTERS, ROW_COUNTERS
from a4prefill.process_state import register_state
from a4prefill.vllm_integration.row_provider import CACHE_ATTRIBUTE


def rank_path(row_log: str, rank: int) -> Path:
    """The file of global rank ``rank`` for the setting ``row_log``."""
    path = Path(row_log)
    return path.with_name(f"{path.name}.rank{rank}")


class _AuditLog:
    """The open log of one process and the forward pass whose record is pending."""

    def __init__(self, handle: TextIO, rank: int, layer_status: dict[str, str]) -> None:
        self.handle = handle
        self.rank = rank
        self.layer_status = layer_status  # the engine's, updated by weight processing
        self.written_status: dict[str, str] = {}
        self.pending: Any = None  # the forward context of the pass being recorded
        self.baseline: dict[tuple[str, str], int] = {}
        self.device = False
        self.step = 0
        self.write_us = 0.0
        self.lock = threading.Lock()

    def begin(self, context: Any) -> None:
        """A forward pass with attention metadata begins: write the previous one's record."""
        with self.lock:
            self._write_pending()
            self.device = DEVICE_ROW_COUNTERS.attached()
            self.baseline = self._counts()
            self.pending = context

    def _counts(self) -> dict[tuple[str, str], int]:
        return DEVICE_ROW_COUNTERS.snapshot() if self.device else ROW_COUNTERS.snapshot()

    def _write_pending(self) -> None:
        context = self.pending
        if context is None:
            return
        started = time.perf_counter()
        if self.layer_status != self.written_status:
            self.written_status = dict(self.layer_status)
            self._line({"kind": "layers", "rank": self.rank, "status": self.written_status})
        counts = self._counts()
        layers: dict[str, dict[str, int]] = {}
        for (layer, precision), count in counts.items():
            ran = count - self.baseline.get((layer, precision), 0)
            if ran:
                layers.setdefault(layer, {"w4a16": 0, "a4": 0})[precision] = ran
        cached = getattr(context, CACHE_ATTRIBUTE, {})
        rows = [
            [num_rows, types.num_prefill_rows, types.num_decode_rows, types.num_padding_rows]
            for (num_rows, _), types in sorted(cached.items(), key=lambda item: item[0][0])
            if types is not None
        ]
        descriptor = context.batch_descriptor
        record = {
            "kind": "step",
            "rank": self.rank,
            "step": self.step,
            "mode": context.cudagraph_runtime_mode.name,
            "tokens": int(descriptor.num_tokens) if descriptor is not None else -1,
            "rows": rows,
            "layers": layers,
            "counters": "device" if self.device else "host",
            "write_us": round(self.write_us, 1),
        }
        self._line(record)
        self.step += 1
        self.pending = None
        self.write_us = (time.perf_counter() - started) * 1e6

    def _line(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def close(self) -> None:
        with self.lock:
            self._write_pending()
            self.handle.close()


_installed: list[tuple[_AuditLog, Any]] = []  # (log, vLLM's create_forward_context), at most one


def install(row_log: str, rank: int, layer_status: dict[str, str]) -> Path:
    """Start this process's audit log (see the module docstring); returns its file. A second
    engine in the process takes the log over (its statuses are recorded from then on)."""
    import vllm.forward_context as forward_context

    if _installed:
        _installed[0][0].layer_status = layer_status
        return Path(_installed[0][0].handle.name)
    path = rank_path(row_log, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = _AuditLog(path.open("a", encoding="utf-8"), rank, layer_status)
    create = forward_context.create_forward_context

    def recording(attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        context = create(attn_metadata, *args, **kwargs)
        if attn_metadata is not None:
            log.begin(context)
        return context

    forward_context.create_forward_context = recording
    _installed.append((log, create))
    return path


def uninstall() -> None:
    """Write the pending record, close the file, restore vLLM's function (no-op when off)."""
    if not _installed:
        return
    import vllm.forward_context as forward_context

    log, create = _installed.pop()
    forward_context.create_forward_context = create
    log.close()


atexit.register(uninstall)
register_state(__name__, uninstall, _installed)
