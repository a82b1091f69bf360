"""The GPU's SM clock, power, temperature and clock-event reasons while a benchmark times a size
(a helper of ``bench_moe.py``, CUDA machine with ``nvidia-smi``).

Why: on the H200 the prefill sizes run at the 700 W power cap, where the SM clock drops from
1980 MHz to 1770-1950 MHz (``benchmarks/results/clock_power_round15.json``), and two one-run
tables of the same kernels differed by 5-7% at 8192 and 16384 tokens (nineteenth round). A
table row that carries the clocks it ran at says whether a difference is the kernel's or the
GPU's.

Usage::

    with ClockSampler() as clocks:
        ...  # the timings of one size
    row["gpu_clocks"] = clocks.summary()

The sampler runs ``nvidia-smi --query-gpu=... --loop-ms=50`` for the block's duration (one line every
50 ms for the GPU of ``CUDA_VISIBLE_DEVICES``' first index, or GPU 0) and summarizes the lines
(:func:`summarize`). Without ``nvidia-smi`` the summary is ``None``: the benchmark's numbers do
not depend on it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from types import TracebackType
from typing import Any

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
INTERVAL_MS = 50
# nvidia-smi's clock event reason bits (nvmlClocksEventReasons) that the H200 runs show
REASONS = {
    0x1: "GPU idle",
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
    rank = max(1, -(-len(ordered) * q // 1))  # ceil(n * q), at least 1
    return ordered[int(rank) - 1]


def reason_names(mask: int) -> str:
    """``mask`` (clock event reason bits) as ``"0x4 (SW power cap)"``; ``"0x0"`` for none."""
    if mask == 0:
        return "0x0"
    names = [name for bit, name in REASONS.items() if mask & bit]
    return f"{mask:#x}" + (f" ({', '.join(names)})" if names else "")


def summarize(lines: list[str]) -> dict[str, Any] | None:
    """The summary of ``nvidia-smi --query-gpu=`` :data:`QUERY` ``--format=csv,noheader,nounits``
    lines (``"1965, 690.99, 61, 0x0000000000000004"``): ``samples``, ``sm_mhz_p10_p50_p90``,
    ``power_w_p50_max``, ``temperature_c_max`` and ``clock_event_reasons`` (name -> samples).
    Lines that do not parse (a header, ``[N/A]``) are skipped; ``None`` when none parse."""
    clocks, powers, temperatures = [], [], []
    reasons: dict[str, int] = {}
    for line in lines:
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            clock, power, temperature = float(fields[0]), float(fields[1]), float(fields[2])
            mask = int(fields[3], 16)
        except ValueError:
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
    }


class ClockSampler:
    """Samples the GPU with ``nvidia-smi`` while its ``with`` block runs (see the module
    docstring); :meth:`summary` after the block. ``command`` overrides the ``nvidia-smi``
    executable (tests)."""

    def __init__(self, command: str | None = None) -> None:
        self.command = command or shutil.which("nvidia-smi")
        self.lines: list[str] = []
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        if self.command is None:
            return self
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        arguments = [f"--id={gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
        self._process = subprocess.Popen(
            [self.command, *arguments, f"--loop-ms={INTERVAL_MS}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self.lines.append(line)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def summary(self) -> dict[str, Any] | None:
        """:func:`summarize` of the lines sampled so far; ``None`` without ``nvidia-smi``."""
        return summarize(list(self.lines))
