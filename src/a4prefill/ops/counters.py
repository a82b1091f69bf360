"""Row counters: how many rows each layer ran in each precision (host ints, no device reads).

The split and single-precision ops record into :data:`ROW_COUNTERS`. Under CUDA-graph capture
an op body runs once at capture and not on replay, so a captured graph counts once.
"""

from __future__ import annotations

import threading
from collections import Counter

W4A16 = "w4a16"
A4 = "a4"


class RowCounters:
    """Thread-safe ``(layer_name, precision) -> rows`` counter."""

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


ROW_COUNTERS = RowCounters()
