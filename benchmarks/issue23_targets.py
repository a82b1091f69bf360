"""Issue 23's targets read off ``bench_moe.py`` results: per size, what each run reached (a script).

Usage: ``python benchmarks/issue23_targets.py RESULT.json [RESULT.json ...]`` (no torch, no GPU;
for example the ``anchors`` mode's two runs, columns as built and reversed). Prints one markdown
table over every result's rows of the GLM-5.3-Flash TP2 shape and, per target, whether it holds in
**every** run given: a target met in one column order but not the other is not met.

The targets (issue 23, "Targets"), each a ratio or rate from one run's row:

- milestone: W4A16 at least 1.0x Marlin at 512 and 1024 tokens, at least 1.5x at 4096, 8192, 16384;
- goal: at least 2.0x Marlin at every size of the table from 512 tokens, and at least 500 TFLOP/s
  at 8192 tokens (routing and combine included, as ``bench_moe.py`` times them);
- Humming: W4A16 no slower than Humming at every size from 512 tokens;
- A4 and split within 10% of W4A16 (``a4_us``, ``split_us`` over ``w4a16_us``);
- relative L2 error of W4A16 against the fp32 reference at most 1e-3 with bf16 io (the kernel's
  own error: fed fp32 activations, the error also holds the bf16 rounding of the input every bf16
  kernel makes, about 4e-3 for Marlin and Humming alike).

A row without a column a target needs (no Humming installed, errors past 4096 tokens) leaves that
target unjudged for the row: ``-`` in the table, and the summary says which sizes had no data.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SHAPE = "glm53flash_tp2"
PREFILL_FROM = 512  # the smallest size issue 23's targets name


@dataclass(frozen=True)
class Target:
    """One of issue 23's targets: ``value(row)`` (``None`` where the row lacks the data) must be
    ``>= bound`` (``at_least``) or ``<= bound`` at every size ``applies(tokens)`` accepts."""

    name: str
    value: Callable[[dict[str, Any]], float | None]
    bound: float
    at_least: bool
    applies: Callable[[int], bool]

    def met(self, value: float) -> bool:
        """Whether ``value`` (this target's ``value(row)`` of a row that has it) meets the bound."""
        return value >= self.bound if self.at_least else value <= self.bound


def _ratio(numerator: str, denominator: str) -> Callable[[dict[str, Any]], float | None]:
    def value(row: dict[str, Any]) -> float | None:
        top, bottom = row.get(numerator), row.get(denominator)
        return top / bottom if top and bottom else None

    return value


def _key(name: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda row: row.get(name)


TARGETS = (
    Target(
        "milestone: Marlin/W4A16 >= 1.0",
        _ratio("marlin_us", "w4a16_us"),
        1.0,
        True,
        lambda t: t in (512, 1024),
    ),
    Target("milestone: Marlin/W4A16 >= 1.5", _ratio("marlin_us", "w4a16_us"), 1.5, True, lambda t: t >= 4096),
    Target(
        "goal: Marlin/W4A16 >= 2.0", _ratio("marlin_us", "w4a16_us"), 2.0, True, lambda t: t >= PREFILL_FROM
    ),
    Target("goal: W4A16 TFLOP/s >= 500", _key("w4a16_TFLOPs"), 500.0, True, lambda t: t == 8192),
    Target("Humming/W4A16 >= 1.0", _ratio("humming_us", "w4a16_us"), 1.0, True, lambda t: t >= PREFILL_FROM),
    Target("A4/W4A16 <= 1.10", _ratio("a4_us", "w4a16_us"), 1.10, False, lambda t: t >= PREFILL_FROM),
    Target("split/W4A16 <= 1.10", _ratio("split_us", "w4a16_us"), 1.10, False, lambda t: t >= PREFILL_FROM),
    Target("rel err W4A16 (bf16 io) <= 1e-3", _key("w4a16_rel_err_bf16_io"), 1e-3, False, lambda t: True),
)


def shape_rows(result: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The GLM TP2 rows of one ``bench_moe.py`` result; ``source`` names the file in the error
    raised when it has none."""
    shapes = result.get("shapes")
    if not isinstance(shapes, dict) or SHAPE not in shapes:
        raise ValueError(f"{source}: expected a bench_moe.py result with shape {SHAPE!r} under 'shapes'")
    return list(shapes[SHAPE]["rows"])


def _cell(value: float, met: bool) -> str:
    text = f"{value:.2e}" if value < 0.01 else f"{value:.2f}"
    return text if met else f"**{text}** (missed)"


def report(runs: dict[str, list[dict[str, Any]]]) -> tuple[str, dict[str, str]]:
    """The table (one line per run and size) and, per target, its verdict over every run:
    ``met``, ``missed at <sizes>`` or ``no data`` (sizes where no run had its columns are named)."""
    header = "| run | tokens | " + " | ".join(target.name for target in TARGETS) + " |"
    lines = [header, "|" + "---|" * (2 + len(TARGETS))]
    missed: dict[str, set[int]] = {target.name: set() for target in TARGETS}
    judged: dict[str, set[int]] = {target.name: set() for target in TARGETS}
    applicable: dict[str, set[int]] = {target.name: set() for target in TARGETS}
    for run, rows in runs.items():
        for row in sorted(rows, key=lambda row: row["tokens"]):
            tokens = row["tokens"]
            cells = []
            for target in TARGETS:
                if not target.applies(tokens):
                    cells.append("")
                    continue
                applicable[target.name].add(tokens)
                value = target.value(row)
                if value is None:
                    cells.append("-")
                    continue
                met = target.met(value)
                judged[target.name].add(tokens)
                if not met:
                    missed[target.name].add(tokens)
                cells.append(_cell(value, met))
            lines.append(f"| {run} | {tokens} | " + " | ".join(cells) + " |")
    verdicts = {}
    for name in missed:
        unjudged = sorted(applicable[name] - judged[name])
        if not judged[name]:
            verdicts[name] = "no data"
        else:
            verdict = f"missed at {sorted(missed[name])}" if missed[name] else "met"
            verdicts[name] = verdict + (f" (no data at {unjudged})" if unjudged else "")
    return "\n".join(lines), verdicts


def load_runs(paths: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each result's GLM TP2 rows under its label: the path as given (the ``anchors`` mode writes
    ``anchors/bench_moe.json`` and ``anchors_reversed/bench_moe.json``, one file name for both
    orders) and the device the result records. A path given twice is refused by name: it would
    count one run twice."""
    runs = {}
    for path in paths:
        with open(path) as file:
            result = json.load(file)
        label = f"{path} ({result.get('device', 'device not recorded')})"
        if label in runs:
            raise ValueError(f"results: {path!r} given twice; expected each run once")
        runs[label] = shape_rows(result, path)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench_moe.py JSON results (bench_moe.json)")
    args = parser.parse_args()
    table, verdicts = report(load_runs(args.results))
    print(table)
    print()
    for name, verdict in verdicts.items():
        print(f"- {name}: {verdict}")


if __name__ == "__main__":
    main()
