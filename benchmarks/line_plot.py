"""What the small timing scripts (``bench_routing.py``, ``bench_gather.py``) save: their result as
JSON and one line plot of it, side by side in ``--out``."""

from __future__ import annotations

import json
import os
from typing import Any


def save_result_and_plot(
    out: str, name: str, result: dict[str, Any], x: str, series: list[str], xlabel: str, ylabel: str
) -> None:
    """Write ``result`` to ``out/name.json`` and plot ``out/name.png``: one line per key of
    ``series`` over ``result["rows"]`` (each row a dict; rows without the key are left out of its
    line), the rows' ``x`` on a log axis, a key's ``_us``/``_GBps`` suffix dropped from its label,
    titled with ``result["device"]``."""
    with open(os.path.join(out, f"{name}.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for key in series:
        present = [row for row in result["rows"] if key in row]
        label = key.removesuffix("_us").removesuffix("_GBps")
        axis.plot([row[x] for row in present], [row[key] for row in present], marker="o", label=label)
    axis.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title=result["device"])
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(out, f"{name}.png"), dpi=120)
