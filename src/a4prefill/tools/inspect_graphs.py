"""``python -m a4prefill inspect``: compile the built-in model under depyf, show the rewrites.

For each requested size (static compile) or range (``mark_dynamic`` with bounds), the built-in
two-block NVFP4 MoE model is compiled with the split pass under ``depyf.prepare_debug`` with
Inductor's caches off (a cached compile would skip the passes). Each compile gets its own dump
folder holding depyf's decompiled code, the post-grad graphs and the graphs the pass logged
before and after rewriting (``*before_a4prefill_split_pass*``, ``*after_a4prefill_split_pass*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from a4prefill import ops
from a4prefill.passes.split_prefill import SplitPrefillPass, inductor_options
from a4prefill.settings import A4PrefillSettings
from a4prefill.tools.tiny_layer import TinyMoEModel, make_tiny_layer


@dataclass(frozen=True)
class InspectRow:
    graph: str
    token_range: str
    moe_nodes: int
    rewritten: int
    kept: int
    dump_dir: Path
    files_with_split_ops: list[str]


def parse_spec(spec: str) -> tuple[int, int]:
    """``"N"`` -> (N, N) static; ``"LO:HI"`` -> a dynamic range; raise ValueError otherwise."""
    try:
        parts = [int(p) for p in spec.split(":")]
    except ValueError:
        raise ValueError(f"size/range {spec!r} must be N or LO:HI with integers") from None
    if len(parts) not in (1, 2):
        raise ValueError(f"size/range {spec!r} must be N or LO:HI")
    low, high = parts[0], parts[-1]
    if low < 1 or high < low or (low != high and low < 2):
        raise ValueError(f"size/range {spec!r}: need N >= 1 or 2 <= LO <= HI")
    return low, high


def inspect_model(out_dir: Path, specs: list[str], captured_limit: int) -> list[InspectRow]:
    """Compile the built-in model once per spec; return one table row per compiled graph."""
    import depyf

    layers = [make_tiny_layer(seed=0).quantized, make_tiny_layer(seed=1).quantized]
    model = TinyMoEModel(layers, ops.moe_w4a16)
    split_pass = SplitPrefillPass(A4PrefillSettings(captured_limit=captured_limit))
    rows = []
    for spec in specs:
        low, high = parse_spec(spec)
        tokens = high if low == high else max(low, min(high, 2 * low + 1))
        hidden = torch.randn(tokens, 256, dtype=torch.bfloat16)
        if low != high:
            torch._dynamo.mark_dynamic(hidden, 0, min=low, max=high)
        dump_dir = out_dir / f"graph_{spec.replace(':', '-')}"
        torch._dynamo.reset()
        before = len(split_pass.records)
        with (
            torch.no_grad(),
            torch._inductor.config.patch(force_disable_caches=True),
            depyf.prepare_debug(str(dump_dir)),
        ):
            compiled = torch.compile(
                model,
                fullgraph=True,
                dynamic=False if low == high else None,
                options=inductor_options(split_pass),
            )
            with ops.step_row_types(ops.row_types_from_query_lens([1, tokens - 1], 1)):
                compiled(hidden)
        for record in split_pass.records[before:]:
            hits = sorted(
                str(path.relative_to(out_dir))
                for path in dump_dir.rglob("*.py")
                if "a4prefill.moe_split" in path.read_text(errors="replace")
            )
            rows.append(
                InspectRow(
                    spec,
                    record.token_range,
                    record.moe_nodes,
                    len(record.rewritten),
                    len(record.kept),
                    dump_dir,
                    hits,
                )
            )
    return rows


def format_rows(rows: list[InspectRow]) -> str:
    """The inspect table, then the dump files in which the split op appears."""
    lines = [f"{'graph':<14} {'token range':<14} {'MoE nodes':>9} {'rewritten':>9} {'kept':>5}  dump folder"]
    for row in rows:
        lines.append(
            f"{row.graph:<14} {row.token_range:<14} {row.moe_nodes:>9} {row.rewritten:>9} "
            f"{row.kept:>5}  {row.dump_dir}"
        )
    lines.append("")
    lines.append("dump files containing a4prefill.moe_split:")
    lines += [f"  {name}" for row in rows for name in row.files_with_split_ops] or ["  (none)"]
    return "\n".join(lines)
