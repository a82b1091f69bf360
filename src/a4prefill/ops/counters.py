"""Row counters: how many rows each layer ran in each precision. What ran, never what may run.

Two kinds, both recorded by the ops (``moe_w4a16``, ``moe_a4``, ``moe_split``) for every call:

- :data:`ROW_COUNTERS`: host ints, always on. Under CUDA-graph capture an op body runs once at
  capture and not on replay, so a captured graph counts once (its capture), never its replays.
- :data:`DEVICE_ROW_COUNTERS`: opt-in, per layer, an int64 tensor on the layer's device: the
  rows of each precision (:data:`PRECISIONS`: W4A16, A4, A8), then the calls each kernel family
  ran (:data:`KERNEL_FAMILIES`, as the backend that ran the call names it), incremented inside
  the op by small kernels that are captured with it: every replay of a captured graph counts
  too. Attached at load time
  (:meth:`DeviceRowCounters.attach`; the vLLM plugin does it under ``count_rows: true``) and read
  on the host only when a report asks (:meth:`DeviceRowCounters.snapshot`,
  :meth:`DeviceRowCounters.kernel_calls`, one sync each).

Neither decides anything: they are the evidence of what the three deciders made the ops run.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping

import torch

from a4prefill.ops.precision import A4, A8, PRECISIONS, W4A16
from a4prefill.process_state import register_state

__all__ = [
    "A4",
    "A8",
    "DEVICE_ROW_COUNTERS",
    "KERNEL_FAMILIES",
    "PRECISIONS",
    "ROW_COUNTERS",
    "W4A16",
    "record_rows",
]
# What can run a MoE call (``MoEBackend.kernel_family``): the reference backend, the triton
# backend's tiled, decode or Hopper prefill kernels, b12x.
KERNEL_FAMILIES = ("reference", "triton-tiled", "triton-decode", "b12x", "triton-prefill")


class RowCounters:
    """Thread-safe ``(layer_name, precision) -> rows`` counter (host ints)."""

    def __init__(self) -> None:
        self._rows: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def record(self, layer_name: str, precision: str, rows: int) -> None:
        if rows:
            with self._lock:
                self._rows[(layer_name, precision)] += rows

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._rows)

    def total(self, precision: str) -> int:
        """Rows run in ``precision`` over all layers."""
        with self._lock:
            return sum(rows for (_, p), rows in self._rows.items() if p == precision)

    def reset(self) -> None:
        with self._lock:
            self._rows.clear()


class DeviceRowCounters:
    """Per-layer device counters keyed by the storage of the layer's ``w13_weight``.

    The key is the weight's device and data pointer, which the ops see whether they are called
    eagerly, from a compiled graph or from a captured CUDA graph; two engines in one process have
    different weights and so different counters.
    """

    def __init__(self) -> None:
        self._counters: dict[tuple[str, int], tuple[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(w13_weight: torch.Tensor) -> tuple[str, int]:
        return str(w13_weight.device), w13_weight.data_ptr()

    def attach(self, w13_weight: torch.Tensor, layer_name: str) -> torch.Tensor:
        """Count the rows and kernel families of every later op call on this layer; returns its
        int64 ``[len(PRECISIONS) + len(KERNEL_FAMILIES)]`` counter.

        Allocates: call at load time, never while a stream captures. Re-attaching (weights
        processed again) keeps the existing counter.
        """
        key = self._key(w13_weight)
        with self._lock:
            entry = self._counters.get(key)
            if entry is None or entry[0] != layer_name:
                size = len(PRECISIONS) + len(KERNEL_FAMILIES)
                entry = (layer_name, torch.zeros(size, dtype=torch.int64, device=w13_weight.device))
                self._counters[key] = entry
            return entry[1]

    def record(
        self, w13_weight: torch.Tensor, rows: Mapping[str, int], kernel_family: Callable[[], str]
    ) -> None:
        """Add one call's rows (precision -> rows) and its kernel family on the device (no host
        sync; captured with the call). ``kernel_family`` is asked only for attached layers."""
        entry = self._counters.get(self._key(w13_weight))
        if entry is None:
            return
        counter = entry[1]
        for slot, precision in enumerate(PRECISIONS):
            if rows.get(precision, 0):
                counter[slot].add_(rows[precision])
        counter[len(PRECISIONS) + KERNEL_FAMILIES.index(kernel_family())].add_(1)

    def _read(self) -> list[tuple[str, list[int]]]:
        with self._lock:
            entries = list(self._counters.values())
        return [(layer_name, counter.tolist()) for layer_name, counter in entries]

    def snapshot(self) -> dict[tuple[str, str], int]:
        """``(layer_name, precision) -> rows`` summed over the attached layers (host read)."""
        rows: Counter[tuple[str, str]] = Counter()
        for layer_name, values in self._read():
            for precision, value in zip(PRECISIONS, values, strict=False):
                rows[(layer_name, precision)] += value
        return dict(rows)

    def kernel_calls(self) -> dict[tuple[str, str], int]:
        """``(layer_name, kernel family) -> calls`` summed over the attached layers (host read)."""
        calls: Counter[tuple[str, str]] = Counter()
        for layer_name, values in self._read():
            for family, value in zip(KERNEL_FAMILIES, values[len(PRECISIONS) :], strict=True):
                if value:
                    calls[(layer_name, family)] += value
        return dict(calls)

    def attached(self) -> bool:
        """True when at least one layer counts on its device."""
        return bool(self._counters)

    def reset(self) -> None:
        """Forget every counter (layers must be attached again to count)."""
        with self._lock:
            self._counters.clear()


ROW_COUNTERS = RowCounters()
DEVICE_ROW_COUNTERS = DeviceRowCounters()
register_state(__name__, ROW_COUNTERS.reset, ROW_COUNTERS)
register_state(__name__, DEVICE_ROW_COUNTERS.reset, DEVICE_ROW_COUNTERS)


def record_rows(
    layer_name: str, w13_weight: torch.Tensor, rows: Mapping[str, int], kernel_family: Callable[[], str]
) -> None:
    """What the ops call once per call: both kinds of counters, ``rows`` precision (of
    :data:`PRECISIONS`) -> rows (``kernel_family`` names what runs the call; asked only where the
    layer counts on its device)."""
    unknown = sorted(set(rows) - set(PRECISIONS))
    if unknown:
        raise ValueError(f"rows: unknown precision(s) {unknown}; known: {list(PRECISIONS)}")
    for precision, count in rows.items():
        ROW_COUNTERS.record(layer_name, precision, count)
    DEVICE_ROW_COUNTERS.record(w13_weight, rows, kernel_family)
