"""The GPU's SM clock, power, temperature and clock-event reasons while a benchmark times a
variant (a helper of ``bench_moe.py``, CUDA machine with ``nvidia-smi``).

Why: on the H200 the prefill sizes run at the 700 W power cap, where the SM clock drops from
1980 MHz to 1770-1950 MHz (``benchmarks/results/clock_power_round15.json``), and two one-run
tables of the same kernels differed by 5-7% in W4A16 at 8192 and 16384 tokens (nineteenth
round). A result that carries the clocks it ran at says whether a difference is the kernel's or
the GPU's.

Usage: one sampler for the whole run, a window per timing::

    with ClockSampler() as clocks:
        start = time.monotonic()
        ...  # replays being timed
        row["w4a16_clocks"] = clocks.summary(start, time.monotonic())

The sampler runs ``nvidia-smi --query-gpu=`` :data:`QUERY` ``--loop-ms=`` :data:`INTERVAL_MS`
(line-buffered through ``stdbuf`` where it exists; stopped with SIGINT, nvidia-smi's own way to
end a loop) on the GPU of ``CUDA_VISIBLE_DEVICES``' first entry (GPU 0 without it) and stamps
each line with ``time.monotonic()`` when it arrives. Without ``nvidia-smi``, or when it cannot
start, every summary is ``None``: the benchmark's numbers do not depend on it.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import threading
import time
from types import TracebackType
from typing import Any

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
INTERVAL_MS = 20
IDLE = 0x1  # the clock-event reason "GPU idle": such samples say nothing of a timed kernel
# nvidia-smi's clock event reason bits (nvmlClocksEventReasons) that the H200 runs show
REASONS = {
    IDLE: "GPU idle",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake slowdown",
}


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values`` (not empty), the nearest-rank definition: the
    smallest value with at least ``q`` of the values at or below it."""
    ordered = sorted(values)
    rank = max(1, math.ceil(len(ordered) * q))
    return ordered[rank - 1]


def reason_names(mask: int) -> str:
    """``mask`` (clock event reason bits) as ``"0x4 (SW power cap)"``; ``"0x0"`` for none."""
    if mask == 0:
        return "0x0"
    names = [name for bit, name in REASONS.items() if mask & bit]
    return f"{mask:#x}" + (f" ({', '.join(names)})" if names else "")


def summarize(lines: list[str]) -> dict[str, Any] | None:
    """The summary of ``nvidia-smi --query-gpu=`` :data:`QUERY` ``--format=csv,noheader,nounits``
    lines (``"1965, 690.99, 61, 0x0000000000000004"``) of a busy GPU: ``samples``,
    ``sm_mhz_p10_p50_p90``, ``power_w_p50_max``, ``temperature_c_max``, ``clock_event_reasons``
    (name -> samples) and ``idle_samples`` (lines flagged GPU idle, left out of the rest). Lines
    that do not parse (a header, ``[N/A]``) are skipped; ``None`` when no busy line is left."""
    clocks, powers, temperatures = [], [], []
    reasons: dict[str, int] = {}
    idle = 0
    for line in lines:
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            clock, power, temperature = float(fields[0]), float(fields[1]), float(fields[2])
            mask = int(fields[3], 16)
        except ValueError:
            continue
        if mask & IDLE:
            idle += 1
            continue
        clocks.append(clock)
        powers.append(power)
        temperatures.append(temperature)
        name = reason_names(mask)
        reasons[name] = reasons.get(name, 0) + 1
    if not clocks:
        return None
    return {
        "samples": len(clocks),
        "sm_mhz_p10_p50_p90": [quantile(clocks, q) for q in (0.1, 0.5, 0.9)],
        "power_w_p50_max": [quantile(powers, 0.5), max(powers)],
        "temperature_c_max": max(temperatures),
        "clock_event_reasons": reasons,
        "idle_samples": idle,
    }


class ClockSampler:
    """Samples the GPU with ``nvidia-smi`` while its ``with`` block runs (module docstring);
    :meth:`summary` of a time window, during the block or after it. ``command`` overrides the
    ``nvidia-smi`` executable (tests)."""

    def __init__(self, command: str | None = None) -> None:
        self.command = command or shutil.which("nvidia-smi")
        self.samples: list[tuple[float, str]] = []  # (time.monotonic() on arrival, line)
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        if self.command is None:
            return self
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        arguments = [f"--id={gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
        line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
        try:
            self._process = subprocess.Popen(
                [*line_buffered, self.command, *arguments, f"--loop-ms={INTERVAL_MS}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:  # found but not runnable: no clocks, the benchmark goes on
            self._process = None
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self.samples.append((time.monotonic(), line))

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._process is None:
            return
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def summary(self, start: float = -math.inf, end: float = math.inf) -> dict[str, Any] | None:
        """:func:`summarize` of the lines that arrived from ``start`` to ``end``
        (``time.monotonic()`` seconds; default: all so far); ``None`` without ``nvidia-smi``."""
        return summarize([line for stamp, line in list(self.samples) if start <= stamp <= end])
