"""The numerics report: per-layer rows, the end-to-end figure, suggested exclusions, its files.

- Suggested ``excluded_layers``: the calibrated layers whose A4-vs-W4A16 relative error exceeds
  ``factor`` (default 2) times the lower median of all calibrated layers' errors (the lower median
  so that one bad layer among few cannot lift the bar over itself); given as ``re.escape``d
  layer names, ready for ``--additional-config '{"a4prefill": {"excluded_layers": [...]}}'``.
- End to end: for every prompt token after the first, the absolute difference of its logprob
  between the engine with the split pass (prompt rows A4) and without (W4A16): median, p90, max.
- Files: ``numerics.json`` (everything), ``numerics.csv`` (one row per layer), ``numerics.png``
  (A4-vs-W4A16 error per layer with the threshold; needs matplotlib, ``pip install -e
  '.[numerics]'``: without it the report says so and writes the other files).

Who may call: the numerics tool, tests.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from a4prefill.tools.numerics.layer_metrics import LayerNumerics

DEFAULT_EXCLUDE_FACTOR = 2.0


@dataclass
class NumericsReport:
    """Everything one ``numerics`` run measured."""

    checkpoint: str
    capture: str
    prompts: int
    layers: list[LayerNumerics]
    logprob_difference: dict[str, float] = field(default_factory=dict)
    exclude_factor: float = DEFAULT_EXCLUDE_FACTOR
    threshold: float | None = None
    suggested_excluded_layers: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def suggest_exclusions(layers: list[LayerNumerics], factor: float) -> tuple[float | None, list[str]]:
    """``(threshold, patterns)``: the layers whose A4 error is above ``factor`` x the lower median."""
    errors = [row.a4_vs_w4a16_rel_error for row in layers if row.a4_vs_w4a16_rel_error is not None]
    if not errors:
        return None, []
    threshold = factor * statistics.median_low(errors)
    patterns = [
        re.escape(row.layer)
        for row in layers
        if row.a4_vs_w4a16_rel_error is not None and row.a4_vs_w4a16_rel_error > threshold
    ]
    return threshold, patterns


def logprob_difference(reference: list[list[float]], other: list[list[float]]) -> dict[str, float]:
    """Median, p90 and max absolute logprob difference per prompt token, and the token count
    (per prompt, the logprob of each prompt token; both runs saw the same prompts)."""
    differences = sorted(
        abs(x - y)
        for ours, theirs in zip(other, reference, strict=True)
        for x, y in zip(ours, theirs, strict=True)
    )
    if not differences:
        return {}
    p90 = differences[min(len(differences) - 1, int(0.9 * len(differences)))]
    return {
        "tokens": float(len(differences)),
        "median": statistics.median(differences),
        "p90": p90,
        "max": differences[-1],
    }


def _number(value: float | None, fmt: str) -> str:
    width = int(re.match(r"\d+", fmt).group())  # type: ignore[union-attr]
    return "-".rjust(width) if value is None else format(value, fmt)


def format_table(report: NumericsReport) -> str:
    """The terminal table, the end-to-end figure and the suggestion."""
    width = max([len(row.layer) for row in report.layers] + [5])
    lines = [
        f"a4prefill numerics: {report.checkpoint} ({report.prompts} prompts; inputs: {report.capture})",
        f"{'layer':<{width}} {'tokens':>6} {'A4 vs W4A16':>11} {'cosine':>8} {'A8 vs W4A16':>11} "
        f"{'cosine':>8} {'W4A16 vs bf16':>13} {'FC1 sat.':>8} {'FC2 sat.':>8}  status",
    ]
    for row in report.layers:
        lines.append(
            f"{row.layer:<{width}} {row.tokens:>6} {_number(row.a4_vs_w4a16_rel_error, '11.3%')} "
            f"{_number(row.a4_vs_w4a16_cosine, '8.5f')} {_number(row.a8_vs_w4a16_rel_error, '11.3%')} "
            f"{_number(row.a8_vs_w4a16_cosine, '8.5f')} {_number(row.w4a16_vs_bf16_rel_error, '13.3%')} "
            f"{_number(row.fc1_saturated, '8.2%')} {_number(row.fc2_saturated, '8.2%')}  {row.status}"
        )
    figure = report.logprob_difference
    if figure:
        lines.append(
            f"end to end, |logprob(A4 prefill) - logprob(W4A16)| over {int(figure['tokens'])} prompt tokens: "
            f"median {figure['median']:.4f}, p90 {figure['p90']:.4f}, max {figure['max']:.4f}"
        )
    if report.threshold is None:
        lines.append("no calibrated layer: nothing runs A4, nothing to exclude")
    else:
        lines.append(
            f"suggested excluded_layers (A4 error above {report.exclude_factor:g} x the lower median = "
            f"{report.threshold:.3%}): {json.dumps(report.suggested_excluded_layers)}"
        )
    return "\n".join(lines)


def _plot(report: NumericsReport, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in report.layers if row.a4_vs_w4a16_rel_error is not None]
    figure, axis = plt.subplots(figsize=(max(6.0, 0.35 * len(report.layers)), 4.0))
    axis.bar(range(len(rows)), [100 * row.a4_vs_w4a16_rel_error for row in rows], label="A4 vs W4A16")  # type: ignore[operator]
    axis.plot(
        range(len(rows)), [100 * row.w4a16_vs_bf16_rel_error for row in rows], "k.", label="W4A16 vs bf16"
    )
    a8 = [
        (i, row.a8_vs_w4a16_rel_error) for i, row in enumerate(rows) if row.a8_vs_w4a16_rel_error is not None
    ]
    if a8:
        axis.plot([i for i, _ in a8], [100 * error for _, error in a8], "g^", label="A8 vs W4A16")
    if report.threshold is not None:
        axis.axhline(100 * report.threshold, color="r", linestyle="--", label="exclusion threshold")
    axis.set_xticks(range(len(rows)), [row.layer for row in rows], rotation=90, fontsize=7)
    axis.set_ylabel("relative error (%)")
    axis.set_title(f"a4prefill numerics: {Path(report.checkpoint).name}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def write_outputs(report: NumericsReport, out_dir: Path) -> dict[str, Path]:
    """Write the JSON, CSV and (where matplotlib is installed) PNG files; returns kind -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {"json": out_dir / "numerics.json", "csv": out_dir / "numerics.csv"}
    written["json"].write_text(report.to_json())
    with written["csv"].open("w", newline="") as handle:
        rows: list[dict[str, Any]] = [asdict(row) for row in report.layers]
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["layer"])
        writer.writeheader()
        writer.writerows(rows)
    if _plot(report, out_dir / "numerics.png"):
        written["png"] = out_dir / "numerics.png"
    return written
