"""End-to-end run on the real vLLM engine: tiny NVFP4 MoE, greedy generation, per-step rows.

``run_e2e`` builds the tiny model (:mod:`a4prefill.tiny_model`) if needed, starts an offline
``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the package's counters
and the pass records are visible here) with ``quantization="a4prefill_nvfp4"`` and the split
pass as ``post_grad_custom_post_pass``, and drives the engine step by step: a first group of
prompts is prefilled and decoded alone (decode-only steps), a second group arrives while the
first decodes (mixed steps). For every step it records the scheduled tokens per request (from
the scheduler) and the rows each MoE layer ran in W4A16 and A4 (from ``ROW_COUNTERS``).

Who may call: the CLI (``python -m a4prefill e2e``), tests (in a subprocess, reading
``--json``). Must run under ``if __name__ == "__main__":`` (vLLM may spawn processes).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from a4prefill.ops.scales import A4_READY

DEFAULT_PASS = "a4prefill.split_prefill_pass"
FIRST_PROMPTS = (
    "once upon a time there lived a little cat who loved the sea",
    "one two three four five six",
    "the red bird and the blue fish",
    "what is the name of the river",
)
SECOND_PROMPTS = (
    "tell me a story about a dog and a big house in the city",
    "the sun and the moon and the stars in the sky at night",
    "a b c d e f g h",
    "good morning people of the world",
    "how do you make a fire",
    "list the colors red green blue black white",
)


@dataclass
class StepRecord:
    """One engine step: scheduled tokens per request and rows per layer and precision."""

    index: int
    scheduled: dict[str, int]
    decode_rows: int
    prefill_rows: int
    rows: dict[str, dict[str, int]]  # layer -> {"w4a16": n, "a4": n}

    @property
    def kind(self) -> str:
        if self.prefill_rows == 0:
            return "decode-only"
        return "prefill-only" if self.decode_rows == 0 else "mixed"


@dataclass
class E2EResult:
    """Everything the run observed (JSON-serialisable through :meth:`to_json`)."""

    model: str
    split_pass: str | None
    max_decode_len: int
    steps: list[StepRecord]
    outputs: dict[str, list[int]]
    layer_status: dict[str, str]  # layer -> "A4 scales" or why it runs W4A16 only
    additional_config: dict[str, Any] = field(default_factory=dict)
    pass_records: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        data = asdict(self)
        for step, record in zip(data["steps"], self.steps, strict=True):
            step["kind"] = record.kind
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> E2EResult:
        data = json.loads(text)
        steps = [StepRecord(**{k: v for k, v in s.items() if k != "kind"}) for s in data.pop("steps")]
        return cls(steps=steps, **data)


def default_model_dir() -> Path:
    """Where the built-in tiny model lives (built on first use)."""
    return Path(tempfile.gettempdir()) / "a4prefill-tiny-qwen3-moe"


def ensure_tiny_model(directory: Path | None = None) -> Path:
    """The tiny model directory, built if it has no weights yet."""
    from a4prefill.tiny_model import make_tiny_model

    directory = directory or default_model_dir()
    if not (directory / "model.safetensors").exists():
        make_tiny_model(directory)
    return directory


def _layer_rows(snapshot: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    rows: dict[str, dict[str, int]] = defaultdict(lambda: {"w4a16": 0, "a4": 0})
    for (layer, precision), count in snapshot.items():
        rows[layer][precision] += count
    return dict(rows)


def _delta(after: dict[tuple[str, str], int], before: dict[tuple[str, str], int]) -> dict:
    return {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}


def _records_of(split_pass: Any) -> list[dict[str, Any]]:
    records = getattr(split_pass, "records", None) or []
    out = []
    for record in records:
        out.append(
            {
                "token_range": str(getattr(record, "token_range", "")),
                "captured_limit": getattr(record, "captured_limit", None),
                "rewritten": [str(n) for n in getattr(record, "rewritten", [])],
                "kept": [[str(n), str(r)] for n, r in getattr(record, "kept", [])],
            }
        )
    return out


def run_e2e(
    model_dir: str | Path | None = None,
    split_pass: str | None = DEFAULT_PASS,
    max_tokens: int = 6,
    decode_steps_alone: int = 2,
    additional_config: dict[str, Any] | None = None,
    first_prompts: Sequence[str] = FIRST_PROMPTS,
    second_prompts: Sequence[str] = SECOND_PROMPTS,
) -> E2EResult:
    """Run the tiny model on the real engine; ``split_pass=None`` runs without the pass."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # A warm compile cache skips the passes (no records): compile afresh unless told otherwise.
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    # vllm-cpu compiles with stock Inductor; its caches and vLLM's saved compiled artifacts
    # would also skip the passes: compile in a fresh cache folder.
    if os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1") == "1":
        # Inductor reads the variable when it is first imported, which importing this package
        # already did: set its config too.
        import torch._inductor.config

        torch._inductor.config.force_disable_caches = True
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="a4prefill-vllm-cache-"))
    from vllm import LLM, SamplingParams

    from a4prefill.ops import ROW_COUNTERS
    from a4prefill.vllm_integration import QUANTIZATION_NAME, register
    from a4prefill.vllm_integration.engine import max_decode_len
    from a4prefill.vllm_integration.moe_method import layer_statuses

    register()
    model = ensure_tiny_model(Path(model_dir) if model_dir else None)
    compilation: dict[str, Any] = {}
    if split_pass is not None:
        # vLLM resolves "top_level_module.attribute" itself (the CLI form).
        compilation["inductor_passes"] = {"post_grad_custom_post_pass": split_pass}
    llm = LLM(
        model=str(model),
        quantization=QUANTIZATION_NAME,  # type: ignore[arg-type]
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        seed=0,
        compilation_config=compilation,
        additional_config={"a4prefill": additional_config or {}},
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # type: ignore[attr-defined]  # in-process client
    decode_len = max_decode_len(engine.vllm_config)
    scheduled_log: list[dict[str, int]] = []
    original_schedule = core.scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        output = original_schedule(*args, **kwargs)
        scheduled_log.append(dict(output.num_scheduled_tokens))
        return output

    core.scheduler.schedule = schedule
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    steps: list[StepRecord] = []

    def step() -> None:
        before = ROW_COUNTERS.snapshot()
        scheduled_log.clear()
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)  # type: ignore[index]
        scheduled: dict[str, int] = {}
        for entry in scheduled_log:
            for request, tokens in entry.items():
                scheduled[request] = scheduled.get(request, 0) + tokens
        if not scheduled:
            return
        decode = sum(n for n in scheduled.values() if n <= decode_len)
        rows = _layer_rows(_delta(ROW_COUNTERS.snapshot(), before))
        steps.append(StepRecord(len(steps), scheduled, decode, sum(scheduled.values()) - decode, rows))

    prompts = {f"a{i}": p for i, p in enumerate(first_prompts)}
    prompts.update({f"b{i}": p for i, p in enumerate(second_prompts)})
    for request_id in (f"a{i}" for i in range(len(first_prompts))):
        engine.add_request(request_id, prompts[request_id], params)
    for _ in range(1 + decode_steps_alone):
        step()
    for index in range(len(second_prompts)):  # arrive one by one: several mixed steps
        engine.add_request(f"b{index}", prompts[f"b{index}"], params)
        if index % 2:
            step()
    while engine.has_unfinished_requests():
        step()
    return E2EResult(
        model=str(model),
        split_pass=split_pass,
        max_decode_len=decode_len,
        steps=steps,
        outputs=outputs,
        layer_status=llm.apply_model(layer_statuses)[0],
        additional_config=additional_config or {},
        pass_records=_records_of(_pass_instance(engine.vllm_config)) if split_pass else [],
    )


def _pass_instance(vllm_config: Any) -> Any:
    """The pass object the engine compiled with (vLLM copies the config, so not the module's)."""
    return vllm_config.compilation_config.inductor_compile_config.get("post_grad_custom_post_pass")


def summarize(result: E2EResult) -> list[dict[str, Any]]:
    """Per step kind: steps, decode/prefill rows scheduled, rows run W4A16 and A4 (all layers)."""
    table: dict[str, dict[str, Any]] = {}
    for step in result.steps:
        entry = table.setdefault(
            step.kind, {"kind": step.kind, "steps": 0, "decode": 0, "prefill": 0, "w4a16": 0, "a4": 0}
        )
        entry["steps"] += 1
        entry["decode"] += step.decode_rows
        entry["prefill"] += step.prefill_rows
        for counts in step.rows.values():
            entry["w4a16"] += counts.get("w4a16", 0)
            entry["a4"] += counts.get("a4", 0)
    order = ("decode-only", "mixed", "prefill-only")
    return [table[k] for k in order if k in table]


def format_report(result: E2EResult) -> str:
    """The printed report: per-step-kind table, skipped layers, pass records."""
    layers = sorted({layer for step in result.steps for layer in step.rows})
    lines = [
        f"a4prefill e2e: {result.model}, pass={result.split_pass}, {len(layers)} MoE layers, "
        f"decode rows: query_len <= {result.max_decode_len}",
        f"{'step kind':<13}{'steps':>6}{'decode rows':>12}{'prefill rows':>13}"
        f"{'W4A16 rows':>12}{'A4 rows':>9}   (rows summed over layers)",
    ]
    for row in summarize(result):
        lines.append(
            f"{row['kind']:<13}{row['steps']:>6}{row['decode']:>12}{row['prefill']:>13}"
            f"{row['w4a16']:>12}{row['a4']:>9}"
        )
    for layer, status in sorted(result.layer_status.items()):
        if status != A4_READY:
            lines.append(f"W4A16 only: {layer}: {status}")
    for record in result.pass_records:
        lines.append(
            f"pass graph {record['token_range']} (captured limit {record['captured_limit']}): rewrote "
            f"{len(record['rewritten'])} node(s), kept {len(record['kept'])}"
        )
        for node, reason in record["kept"]:
            lines.append(f"  kept {node}: {reason}")
    if result.split_pass and not result.pass_records:
        lines.append("pass records: none (pass did not run or keeps no records)")
    return "\n".join(lines)


def run_e2e_cli(args: Any) -> int:
    """``python -m a4prefill e2e``: run, print :func:`format_report`, optionally write JSON."""
    settings = json.loads(args.additional_config) if args.additional_config else None
    result = run_e2e(
        args.model, split_pass=None if args.no_pass else args.split_pass, additional_config=settings
    )
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(result.to_json())
    return 0
