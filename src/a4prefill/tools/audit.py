"""``python -m a4prefill audit LOG...``: check the rule on audit logs of precision (``row_log``).

Reads the JSON lines that :mod:`a4prefill.vllm_integration.audit_log` wrote (one file per rank;
a path that is not a file is taken as the ``row_log`` setting and every ``<path>.rank*`` is read)
and checks every step record against the rule, with the layer statuses in force at that step:

- a captured step (``mode`` not ``NONE``) runs no A4 row;
- a layer never runs more A4 rows than the step has prefill rows for its call size (so decode,
  verify and padding rows are never A4);
- in an uncaptured step whose row types are known, a layer whose status is ``A4 scales`` runs
  every prefill row A4, and any other layer runs none.

Nothing here imports vLLM. Who may call: the command line, tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from a4prefill.ops.scales import A4_READY


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
            f"  rows: {self.a4_rows} A4, {self.w4a16_rows} W4A16; layers that ran A4: {len(self.a4_layers)}",
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
    where = f"rank {record['rank']} step {record['step']}"
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
        a4, w4a16 = ran["a4"], ran["w4a16"]
        report.a4_rows += a4
        report.w4a16_rows += w4a16
        if a4:
            report.a4_layers.add(layer)
        if captured:
            if a4:
                mode = record["mode"]
                report.violations.append(f"{where} {layer}: {a4} A4 rows in a captured step ({mode})")
            continue
        entry = rows_by_size.get(a4 + w4a16)
        if entry is None:
            if a4:
                report.violations.append(f"{where} {layer}: {a4} A4 rows in a step with no row types")
            continue
        expected = entry[1] if status.get(layer) == A4_READY else 0
        if a4 > entry[1]:
            report.violations.append(f"{where} {layer}: {a4} A4 rows, only {entry[1]} prefill rows")
        elif a4 != expected:
            known = status.get(layer, "unknown")
            what = f"{a4} A4 rows of {entry[1]} prefill rows (status: {known})"
            report.violations.append(f"{where} {layer}: {what}")


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
