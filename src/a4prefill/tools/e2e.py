"""End-to-end run on the real vLLM engine: tiny NVFP4 MoE, greedy generation, per-step rows.

``run_e2e`` builds the tiny model (:mod:`a4prefill.tools.tiny_model`) if needed, starts an offline
``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the package's counters
and the pass records are visible here) with ``quantization="a4prefill_nvfp4"`` and the split
pass as ``post_grad_custom_post_pass``, and drives the engine step by step: a first group of
prompts is prefilled and decoded alone (decode-only steps), a second group arrives while the
first decodes (mixed steps). For every step it records

- the scheduled tokens per request (from the scheduler);
- the CUDA-graph runtime mode and token count of each forward pass (from vLLM's forward context:
  ``FULL`` / ``PIECEWISE`` = replayed from a captured graph, ``NONE`` = run uncaptured);
- the rows each MoE layer ran in W4A16 and A4: from the host counters, and under
  ``count_rows: true`` from the device counters, which also count replays of captured graphs,
  together with the calls of each kernel family (``triton-decode``, ``triton-tiled``, ...).

It also reports each layer's load-time kernel warm-up and every Triton compile that happened
after vLLM's warm-up, while the engine served (a post-compile hook, removed at the end; with
``jit_monitor_mode="error"`` vLLM itself fails such a step).

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
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from a4prefill.ops.scales import A4_READY
from a4prefill.passes.split_prefill import DEFAULT_PASS, PASS_KEY
from a4prefill.tools.environment import in_process_engine, scoped_settings

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
class StepRecord:
    """One engine step: scheduled tokens per request, its forward passes, rows per layer."""

    index: int
    scheduled: dict[str, int]
    decode_rows: int
    prefill_rows: int
    rows: dict[str, dict[str, int]]  # layer -> {"w4a16": n, "a4": n}, host counters
    device_rows: dict[str, dict[str, int]] | None = None  # the same from device counters
    modes: list[str] = field(default_factory=list)  # CUDA-graph runtime mode per forward pass
    forward_tokens: list[int] = field(default_factory=list)  # rows per forward pass (padded)
    kernel_calls: dict[str, dict[str, int]] | None = None  # layer -> {kernel family: calls}, device

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
        """True when the step's forward pass was replayed from a captured CUDA graph."""
        return any(mode != "NONE" for mode in self.modes)

    @property
    def evidence(self) -> dict[str, dict[str, int]]:
        """Rows per layer as the best counters saw them (device counters where present)."""
        return self.device_rows if self.device_rows is not None else self.rows


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
    compiled_artifacts_loaded: int = 0  # from vLLM's compile cache (compile_cache=True)
    warmups: dict[str, dict[str, float]] = field(default_factory=dict)  # layer -> plans, calls, seconds
    moe_backends: dict[str, str] = field(default_factory=dict)  # layer -> what serves its experts
    served_compiles: list[str] = field(default_factory=list)  # Triton compiles after vLLM's warm-up
    jit_monitor_mode: str = "warn"

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
        steps = [StepRecord(**{k: v for k, v in s.items() if k not in derived}) for s in data.pop("steps")]
        return cls(steps=steps, **data)


def default_model_dir(shape: str = "tiny") -> Path:
    """Where the built-in model of ``shape`` lives (built on first use)."""
    name = "a4prefill-tiny-qwen3-moe" if shape == "tiny" else f"a4prefill-{shape}-shape-qwen3-moe"
    return Path(tempfile.gettempdir()) / name


def ensure_tiny_model(directory: Path | None = None, shape: str = "tiny") -> Path:
    """The built-in model directory of ``shape`` (``MODEL_SHAPES``), (re)built unless it holds
    this package version's recipe. Never called on a user's checkpoint (a directory given with
    ``--model`` is used as it is)."""
    from a4prefill.tools.tiny_model import MODEL_SHAPES, STAMP_FILE, make_tiny_model, recipe_stamp

    if shape not in MODEL_SHAPES:
        raise ValueError(f"shape must be one of {sorted(MODEL_SHAPES)}, got {shape!r}")
    directory = directory or default_model_dir(shape)
    stamp = directory / STAMP_FILE
    current = recipe_stamp(MODEL_SHAPES[shape])
    if (
        not (directory / "model.safetensors").exists()
        or not stamp.exists()
        or json.loads(stamp.read_text()) != current
    ):
        make_tiny_model(directory, MODEL_SHAPES[shape])
    return directory


def _layer_calls(snapshot: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    calls: dict[str, dict[str, int]] = defaultdict(dict)
    for (layer, family), count in snapshot.items():
        calls[layer][family] = count
    return dict(calls)


def _layer_rows(snapshot: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    rows: dict[str, dict[str, int]] = defaultdict(lambda: {"w4a16": 0, "a4": 0})
    for (layer, precision), count in snapshot.items():
        rows[layer][precision] += count
    return dict(rows)


def _delta(after: dict[tuple[str, str], int], before: dict[tuple[str, str], int]) -> dict:
    return {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}


def pass_records(vllm_config: Any) -> list[dict[str, Any]]:
    """What the engine's split pass did per compiled graph: token range, captured limit, the
    nodes it rewrote and the nodes it kept with the reason (empty without the pass)."""
    split_pass = vllm_config.compilation_config.inductor_compile_config.get(PASS_KEY)
    records = getattr(split_pass, "records", None) or []
    return [
        {
            "token_range": str(record.token_range),
            "captured_limit": record.captured_limit,
            "rewritten": [str(n) for n in record.rewritten],
            "kept": [[str(n), str(r)] for n, r in record.kept],
        }
        for record in records
    ]


@contextmanager
def _forward_passes(log: list[tuple[str, int]]) -> Iterator[None]:
    """Record ``(cudagraph_runtime_mode, tokens)`` of every model forward pass while active."""
    import vllm.forward_context as forward_context

    create = forward_context.create_forward_context

    def recording(attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        context = create(attn_metadata, *args, **kwargs)
        if attn_metadata is not None:
            descriptor = context.batch_descriptor
            tokens = int(descriptor.num_tokens) if descriptor is not None else -1
            log.append((context.cudagraph_runtime_mode.name, tokens))
        return context

    forward_context.create_forward_context = recording
    try:
        yield
    finally:
        forward_context.create_forward_context = create


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
) -> E2EResult:
    """Run the built-in model of ``shape`` (or ``model_dir``) on the real engine;
    ``split_pass=None`` runs without the pass. Environment and Inductor settings are restored
    at the end (:func:`a4prefill.tools.environment.in_process_engine`)."""
    with scoped_settings(**in_process_engine(compile_cache)):
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

    from a4prefill.ops import DEVICE_ROW_COUNTERS, ROW_COUNTERS
    from a4prefill.vllm_integration.engine import max_decode_len
    from a4prefill.vllm_integration.moe_method import layer_backends, layer_statuses, layer_warmups

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
    passes: list[tuple[str, int]] = []
    counting = DEVICE_ROW_COUNTERS.attached()

    def step() -> None:
        before = ROW_COUNTERS.snapshot()
        device_before = DEVICE_ROW_COUNTERS.snapshot() if counting else {}
        calls_before = DEVICE_ROW_COUNTERS.kernel_calls() if counting else {}
        scheduled_log.clear()
        passes.clear()
        with _forward_passes(passes):
            finished = engine.step()
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
        device = _layer_rows(_delta(DEVICE_ROW_COUNTERS.snapshot(), device_before)) if counting else None
        calls = _layer_calls(_delta(DEVICE_ROW_COUNTERS.kernel_calls(), calls_before)) if counting else None
        steps.append(
            StepRecord(
                len(steps),
                scheduled,
                decode,
                sum(scheduled.values()) - decode,
                _layer_rows(_delta(ROW_COUNTERS.snapshot(), before)),
                device,
                [mode for mode, _ in passes],
                [tokens for _, tokens in passes],
                calls,
            )
        )

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
        split_pass=None,
        max_decode_len=decode_len,
        steps=steps,
        outputs=outputs,
        layer_status=llm.apply_model(layer_statuses)[0],
        pass_records=pass_records(engine.vllm_config),
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


def summarize(result: E2EResult) -> list[dict[str, Any]]:
    """Per step kind and capture: steps, decode/prefill rows scheduled, rows run W4A16 and A4
    (all layers; device counters where present)."""
    table: dict[tuple[str, bool], dict[str, Any]] = {}
    for step in result.steps:
        key = (step.kind, step.captured)
        entry = table.setdefault(
            key,
            {
                "kind": step.kind,
                "captured": step.captured,
                "steps": 0,
                "decode": 0,
                "prefill": 0,
                "w4a16": 0,
                "a4": 0,
            },
        )
        entry["steps"] += 1
        entry["decode"] += step.decode_rows
        entry["prefill"] += step.prefill_rows
        for counts in step.evidence.values():
            entry["w4a16"] += counts.get("w4a16", 0)
            entry["a4"] += counts.get("a4", 0)
    order = ("decode-only", "mixed", "prefill-only")
    return [table[k] for k in sorted(table, key=lambda k: (order.index(k[0]), k[1]))]


def format_steps(result: E2EResult) -> list[str]:
    """One line per step: mode, scheduled decode/prefill rows, rows per precision (all layers)."""
    lines = [
        f"{'step':>4} {'kind':<13}{'mode':<10}{'rows':>6}{'decode':>8}{'prefill':>8}{'W4A16':>8}{'A4':>6}"
        "  kernels (device counters)"
    ]
    for step in result.steps:
        w4a16 = sum(c.get("w4a16", 0) for c in step.evidence.values())
        a4 = sum(c.get("a4", 0) for c in step.evidence.values())
        mode = ",".join(step.modes) or "-"
        rows = ",".join(str(t) for t in step.forward_tokens if t >= 0) or "-"
        lines.append(
            f"{step.index:>4} {step.kind:<13}{mode:<10}{rows:>6}{step.decode_rows:>8}{step.prefill_rows:>8}"
            f"{w4a16:>8}{a4:>6}  {','.join(step.kernel_families) or '-'}"
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
        f"{'W4A16 rows':>12}{'A4 rows':>9}   (rows summed over layers, {counters})",
    ]
    for row in summarize(result):
        lines.append(
            f"{row['kind']:<13}{'yes' if row['captured'] else 'no':>9}{row['steps']:>6}{row['decode']:>12}"
            f"{row['prefill']:>13}{row['w4a16']:>12}{row['a4']:>9}"
        )
    if per_step:
        lines += format_steps(result)
    for served_by in sorted(set(result.moe_backends.values())):
        count = sum(value == served_by for value in result.moe_backends.values())
        lines.append(f"MoE layers served by {served_by}: {count}")
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
    """``python -m a4prefill e2e``: run, print :func:`format_report`, optionally write JSON."""

    def parsed(text: str | None) -> Any:
        return json.loads(text) if text else None

    result = run_e2e(
        args.model,
        split_pass=None if args.no_pass else args.split_pass,
        additional_config=parsed(args.additional_config),
        second_prompts=PROMPT_SETS[args.prompts],
        compilation=parsed(args.compilation_config),
        speculative=parsed(args.speculative_config),
        compile_cache=args.compile_cache,
        shape=args.shape,
        jit_monitor_mode=args.jit_monitor_mode,
    )
    print(format_report(result, per_step=args.steps))
    if args.json:
        Path(args.json).write_text(result.to_json())
    return 0
