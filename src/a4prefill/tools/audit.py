"""``python -m a4prefill audit LOG...``: check the rule on audit logs of precision (``row_log``).

Reads the JSON lines that :mod:`a4prefill.vllm_integration.audit_log` wrote (one file per rank;
a path that is not a file is taken as the ``row_log`` setting and every ``<path>.rank*`` is read)
and checks every step record against the rule, with the layer statuses in force at that step:

- a captured step (``mode`` not ``NONE``) runs no row of a prefill precision (A4, A8);
- a layer never runs more A4 (or A8) rows than the step has prefill rows for its call size (so
  decode, verify and padding rows are never A4 nor A8);
- in an uncaptured step whose row types are known, a layer whose status is ``A4 scales`` runs
  every prefill row A4, one whose status is ``A8 (dynamic scales)`` every prefill row A8, and
  any other layer runs none of either.

Nothing here imports vLLM. Who may call: the command line, tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from a4prefill.ops.fp8 import A8_READY
from a4prefill.ops.precision import A4, A8, PREFILL_PRECISIONS
from a4prefill.ops.scales import A4_READY

# load-time status -> the prefill precision it allows (read-only)
_READY = MappingProxyType({A4_READY: A4, A8_READY: A8})


@dataclass
class AuditReport:
    """What the logs show: counts per rank and every violation of the rule (``rank step layer:
    what``). ``write_us``: the log's own cost per record, as measured by the writer."""

    files: list[str] = field(default_factory=list)
    steps: dict[int, int] = field(default_factory=dict)
    captured_steps: int = 0
    mixed_steps: int = 0
    prefill_only_steps: int = 0
    decode_only_steps: int = 0
    a4_rows: int = 0
    w4a16_rows: int = 0
    a4_layers: set[str] = field(default_factory=set)
    a8_rows: int = 0
    a8_layers: set[str] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    write_us: list[float] = field(default_factory=list)

    def summary(self) -> str:
        """A few lines for the terminal."""
        ranks = ", ".join(f"rank {rank}: {count}" for rank, count in sorted(self.steps.items()))
        cost = ""
        if self.write_us:
            ordered = sorted(self.write_us)
            median, most = ordered[len(ordered) // 2], ordered[-1]
            cost = f"; log cost per record median {median:.0f} us, max {most:.0f} us"
        lines = [
            f"audit of {len(self.files)} file(s): steps {ranks or 'none'}",
            f"  steps: {self.captured_steps} captured, {self.mixed_steps} mixed, "
            f"{self.prefill_only_steps} prefill only, {self.decode_only_steps} decode only{cost}",
            f"  rows: {self.a4_rows} A4, {self.a8_rows} A8, {self.w4a16_rows} W4A16; layers that ran A4: "
            f"{len(self.a4_layers)}, A8: {len(self.a8_layers)}",
            f"  rule: {'kept' if not self.violations else f'{len(self.violations)} violation(s)'}",
        ]
        lines += [f"    {violation}" for violation in self.violations[:20]]
        return "\n".join(lines)


def log_files(paths: list[str]) -> list[Path]:
    """The files to read: each path itself, or its ``.rank*`` files."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        found = [path] if path.is_file() else sorted(path.parent.glob(f"{path.name}.rank*"))
        if not found:
            raise FileNotFoundError(f"no audit log at {given} (nor {given}.rank*)")
        files += found
    return files


def _check_step(record: dict[str, Any], status: dict[str, str], report: AuditReport) -> None:
    rows_by_size = {entry[0]: entry for entry in record["rows"]}
    prefill = sum(entry[1] for entry in record["rows"])
    decode = sum(entry[2] for entry in record["rows"])
    captured = record["mode"] != "NONE"
    report.captured_steps += captured
    if not captured and record["rows"]:
        report.mixed_steps += prefill > 0 and decode > 0
        report.prefill_only_steps += prefill > 0 and decode == 0
        report.decode_only_steps += prefill == 0
    for layer, ran in sorted(record["layers"].items()):
        w4a16 = ran["w4a16"]
        prefill_rows = {precision: ran.get(precision, 0) for precision in PREFILL_PRECISIONS}
        report.w4a16_rows += w4a16
        report.a4_rows += prefill_rows[A4]
        report.a8_rows += prefill_rows[A8]
        for precision, layers in ((A4, report.a4_layers), (A8, report.a8_layers)):
            if prefill_rows[precision]:
                layers.add(layer)
        entry = rows_by_size.get(w4a16 + sum(prefill_rows.values()))
        allowed = _READY.get(status.get(layer, ""))
        for precision, rows in prefill_rows.items():
            _check_layer_rows(record, layer, precision, rows, entry, allowed, status, report)


def _check_layer_rows(
    record: dict[str, Any],
    layer: str,
    precision: str,
    rows: int,
    entry: list[int] | None,
    allowed: str | None,
    status: dict[str, str],
    report: AuditReport,
) -> None:
    """One layer's ``rows`` of one prefill ``precision`` in one step against the rule (``entry``:
    the step's row types for the layer's call size; ``allowed``: the prefill precision its
    load-time status allows, or None)."""
    where = f"rank {record['rank']} step {record['step']} {layer}"
    name = precision.upper()
    if record["mode"] != "NONE":
        if rows:
            report.violations.append(f"{where}: {rows} {name} rows in a captured step ({record['mode']})")
        return
    if entry is None:
        if rows:
            report.violations.append(f"{where}: {rows} {name} rows in a step with no row types")
        return
    expected = entry[1] if precision == allowed else 0
    if rows > entry[1]:
        report.violations.append(f"{where}: {rows} {name} rows, only {entry[1]} prefill rows")
    elif rows != expected:
        known = status.get(layer, "unknown")
        report.violations.append(f"{where}: {rows} {name} rows of {entry[1]} prefill rows (status: {known})")


def audit(paths: list[str]) -> AuditReport:
    """Read and check the audit logs at ``paths`` (see the module docstring)."""
    report = AuditReport()
    for path in log_files(paths):
        report.files.append(str(path))
        status: dict[str, str] = {}
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON line ({error})") from None
            if record.get("kind") == "layers":
                status = record["status"]
            elif record.get("kind") == "step":
                report.steps[record["rank"]] = report.steps.get(record["rank"], 0) + 1
                report.write_us.append(float(record["write_us"]))
                _check_step(record, status, report)
            else:
                raise ValueError(f"{path}:{number}: unknown record kind {record.get('kind')!r}")
    return report
