"""``python -m a4prefill numerics [CHECKPOINT] [--prompts FILE] [--out DIR]``: the whole run.

1. vLLM runs the checkpoint on the prompts twice (:mod:`a4prefill.tools.capture`):
   eagerly with every row W4A16, capturing each MoE layer's inputs and the prompt logprobs, then
   with the split pass for the A4 prompt logprobs;
2. the checkpoint is read one MoE layer at a time (:class:`.checkpoint.ModelOptCheckpoint`) and
   each layer is measured on its captured inputs (:func:`.layer_metrics.layer_numerics`), with a
   progress bar on stderr;
3. the report (:mod:`.report`) is printed and written to JSON, CSV and PNG.

Default checkpoint: the built-in tiny model. Default prompts: the e2e prompt set.
Who may call: the CLI, tests. Must run under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from a4prefill.tools.numerics.checkpoint import ModelOptCheckpoint
from a4prefill.tools.numerics.layer_metrics import LayerNumerics, layer_numerics
from a4prefill.tools.numerics.report import (
    DEFAULT_EXCLUDE_FACTOR,
    NumericsReport,
    logprob_difference,
    suggest_exclusions,
)
from a4prefill.tools.parallelism import Parallelism

CAPTURE = "vLLM offline, eager, every row W4A16, a4prefill MoE method inputs"
Item = TypeVar("Item")


def read_prompts(path: Path | None) -> list[str]:
    """One prompt per non-empty line of ``path``; the e2e prompts by default."""
    if path is None:
        from a4prefill.tools.e2e import FIRST_PROMPTS, LONG_SECOND_PROMPTS

        return [*FIRST_PROMPTS, *LONG_SECOND_PROMPTS]
    prompts = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt (one per line)")
    return prompts


def progress(items: Sequence[Item], label: str) -> Iterable[Item]:
    """A progress bar on stderr (tqdm where installed, else one line per item)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _plain_progress(items, label)
    return tqdm(items, desc=label, file=sys.stderr, unit="layer")


def _plain_progress(items: Sequence[Item], label: str) -> Iterator[Item]:
    for index, item in enumerate(items):
        print(f"{label}: {index + 1}/{len(items)}", file=sys.stderr, flush=True)
        yield item


def run_numerics(
    checkpoint: Path | None = None,
    prompts_file: Path | None = None,
    device: str = "cpu",
    max_tokens_per_layer: int = 4096,
    max_model_len: int = 1024,
    gpu_memory_utilization: float = 0.3,
    exclude_factor: float = DEFAULT_EXCLUDE_FACTOR,
    parallelism: Parallelism | None = None,
) -> NumericsReport:
    """Capture, measure every MoE layer, suggest exclusions (see the module docstring);
    ``parallelism``: vLLM's tensor/expert parallel arguments for both engine runs (the layers
    are then measured in this process on rank 0's captured inputs, against all experts)."""
    from a4prefill.tools.capture import capture_moe_inputs, split_prompt_logprobs
    from a4prefill.tools.e2e import ensure_tiny_model

    model = Path(checkpoint) if checkpoint else ensure_tiny_model()
    reader = ModelOptCheckpoint(model)  # fails early on a checkpoint that is not one
    prompts = read_prompts(prompts_file)
    captured, w4a16_logprobs = capture_moe_inputs(
        model, prompts, max_tokens_per_layer, max_model_len, gpu_memory_utilization, parallelism
    )
    a4_logprobs = split_prompt_logprobs(model, prompts, max_model_len, gpu_memory_utilization, parallelism)
    missing = [layer for layer in reader.layer_names() if layer not in captured]
    if missing:
        raise ValueError(
            f"no captured inputs for {missing}: vLLM names these layers differently "
            f"(captured: {sorted(captured)})"
        )
    rows: list[LayerNumerics] = []
    for layer in progress(reader.layer_names(), "a4prefill numerics"):
        rows.append(layer_numerics(layer, reader.read_layer(layer), *captured[layer], device=device))
    threshold, suggested = suggest_exclusions(rows, exclude_factor)
    return NumericsReport(
        checkpoint=str(model),
        capture=CAPTURE,
        prompts=len(prompts),
        layers=rows,
        logprob_difference=logprob_difference(w4a16_logprobs, a4_logprobs),
        exclude_factor=exclude_factor,
        threshold=threshold,
        suggested_excluded_layers=suggested,
    )
