"""End to end on the real vLLM CUDA engine: row evidence that survives CUDA graphs, a warm
restart from vLLM's compile cache, speculative decoding, no kernel compiled while serving.

Needs a CUDA GPU and a CUDA build of vLLM (``scripts/test_gpu.sh``; verified with vLLM 0.26 on an
H200). Every engine run is one subprocess of ``python -m a4prefill e2e --json`` with the Triton
backend, CUDA graphs FULL_AND_PIECEWISE, ``count_rows: true`` (device counters, which count
replays of captured graphs too, and the kernel family of each call), the long prompt set (mixed
steps below and above the capture size M, one step above 256 tokens) and vLLM's JIT monitor in
``error`` mode (a Triton compile after the engine's warm-up fails the step; the speculative run
uses ``warn``, since vLLM's rejection sampler compiles there, and no compile may be the package's).
Every test runs on two built-in models (``--shape``): ``tiny`` (hidden 128, 8 experts: the tiled
kernels only) and ``real`` (hidden 2048, intermediate 768, 64 experts, top-8: captured decode steps
take the decode kernels, the longest prefill step the Hopper prefill GEMMs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of vLLM"),
]

from a4prefill.tools.e2e import E2EResult, StepRecord, first_token_agreement  # noqa: E402

M = 32
CALIBRATED = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
UNCALIBRATED = "model.layers.2.mlp.experts"
SPLIT_RANGES = {
    "cudagraph_mode": "FULL_AND_PIECEWISE",
    "compile_ranges_endpoints": [M],
    "max_cudagraph_capture_size": M,
}
DEFAULT_RANGES = {"cudagraph_mode": "FULL_AND_PIECEWISE", "max_cudagraph_capture_size": M}
# prompt_lookup_min 1: a draft wherever the last token occurred before (in the H200 run with 2,
# the real-shape model's random outputs repeated no two-token n-gram: no draft, nothing verified)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
FIRST_TOKEN_AGREEMENT_FLOOR = 0.6


@pytest.fixture(scope="module", params=["tiny", "real"])
def tiny_model(request, tmp_path_factory) -> Path:
    """The built-in model of each shape (``--shape``)."""
    if "vllm" not in sys.modules:
        pytest.importorskip("vllm", reason="needs a CUDA build of vLLM")
    from a4prefill.tools.e2e import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp(request.param) / "model", shape=request.param)


def run_engine(
    model: Path,
    out: Path,
    *args: str,
    cache_root: Path | None = None,
    jit_monitor_mode: str = "error",
    settings: dict[str, str] | None = None,
) -> E2EResult:
    """One engine run (``settings``: more ``a4prefill`` settings beside ``count_rows``); with
    ``jit_monitor_mode="error"`` any Triton compile while serving fails it, with ``"warn"`` the
    compiles are recorded and none may be one of the package's kernels."""
    env = dict(os.environ)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", A4PREFILL_BACKEND="triton")
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = str(cache_root)
    command = [sys.executable, "-m", "a4prefill", "e2e", "--model", str(model), "--json", str(out)]
    command += [
        "--prompts",
        "long",
        "--steps",
        "--jit-monitor-mode",
        jit_monitor_mode,
        "--additional-config",
        json.dumps({"count_rows": True, **(settings or {})}),
        *args,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    print(done.stdout)
    result = E2EResult.from_json(out.read_text())
    assert result.jit_monitor_mode == jit_monitor_mode
    assert [name for name in result.served_compiles if not name.startswith("vllm.")] == []
    if jit_monitor_mode == "error":
        assert result.served_compiles == []
    return result


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-cache")


@pytest.fixture(scope="module")
def split_run(tiny_model, tmp_path_factory, cache_root) -> E2EResult:
    out = tmp_path_factory.mktemp("split") / "run.json"
    ranges = json.dumps(SPLIT_RANGES)
    return run_engine(
        tiny_model, out, "--compilation-config", ranges, "--compile-cache", cache_root=cache_root
    )


@pytest.fixture(scope="module")
def warm_run(split_run, tiny_model, tmp_path_factory, cache_root) -> E2EResult:
    out = tmp_path_factory.mktemp("warm") / "run.json"
    ranges = json.dumps(SPLIT_RANGES)
    return run_engine(
        tiny_model, out, "--compilation-config", ranges, "--compile-cache", cache_root=cache_root
    )


@pytest.fixture(scope="module")
def plain_run(tiny_model, tmp_path_factory) -> E2EResult:
    out = tmp_path_factory.mktemp("plain") / "run.json"
    return run_engine(tiny_model, out, "--compilation-config", json.dumps(SPLIT_RANGES), "--no-pass")


@pytest.fixture(scope="module")
def default_ranges_run(tiny_model, tmp_path_factory) -> E2EResult:
    out = tmp_path_factory.mktemp("default") / "run.json"
    return run_engine(tiny_model, out, "--compilation-config", json.dumps(DEFAULT_RANGES))


@pytest.fixture(scope="module")
def speculative_run(tiny_model, tmp_path_factory) -> E2EResult:
    """JIT monitor in ``warn`` mode: vLLM 0.26 does not warm up its own rejection sampler
    (``rejection_greedy_sample_kernel`` compiles at the first verified draft, H200 run); the
    package's kernels must still not compile while serving (checked in ``run_engine``)."""
    out = tmp_path_factory.mktemp("ngram") / "run.json"
    ranges = json.dumps(SPLIT_RANGES)
    speculative = json.dumps(NGRAM)
    return run_engine(
        tiny_model,
        out,
        *("--compilation-config", ranges, "--speculative-config", speculative),
        jit_monitor_mode="warn",
    )


def step_rows(step: StepRecord) -> int:
    """Rows of the step's forward pass (padded), from the device counters of one layer."""
    counts = step.evidence[CALIBRATED[0]]
    return counts["w4a16"] + counts["a4"] + counts.get("a8", 0)


def assert_row_rule(result: E2EResult) -> None:
    """Captured steps ran no A4 row; uncaptured steps ran exactly their prefill rows A4 and all
    others (decode, verify, padding) W4A16; the uncalibrated layer never ran A4."""
    assert all(step.device_rows is not None for step in result.steps)
    for step in result.steps:
        for layer in CALIBRATED:
            counts = step.evidence[layer]
            if step.captured:
                assert counts["a4"] == 0, (step.index, layer, step.modes, counts)
            else:
                assert counts["a4"] == step.prefill_rows, (step.index, layer, counts)
                assert counts["w4a16"] == step_rows(step) - step.prefill_rows >= step.decode_rows, step.index
        assert step.evidence[UNCALIBRATED]["a4"] == 0, step.index
        assert step_rows(step) >= step.decode_rows + step.prefill_rows, step.index


def kinds(result: E2EResult) -> set[tuple[str, bool]]:
    return {(step.kind, step.captured) for step in result.steps}


def test_split_ranges_keep_the_captured_graph_w4a16_and_rewrite_the_rest(split_run):
    """vLLM compiles one piecewise submodule per distinct graph piece and range: every MoE node
    of the captured range [.., M] is kept, every one beyond M rewritten."""
    records = split_run.pass_records
    captured = [r for r in records if r["token_range"].endswith(f", {M}]")]
    beyond = [r for r in records if r["token_range"].startswith(f"[{M + 1},")]
    assert captured and all(not r["rewritten"] and r["kept"] for r in captured), records
    assert beyond and all(r["rewritten"] and not r["kept"] for r in beyond), records
    assert len(captured) + len(beyond) == len(records), records


def test_split_ranges_follow_the_row_rule_in_captured_and_uncaptured_steps(split_run):
    assert {("decode-only", True), ("mixed", True), ("mixed", False)} <= kinds(split_run), kinds(split_run)
    assert_row_rule(split_run)
    assert any(s.prefill_rows and not s.captured for s in split_run.steps)


def test_default_compile_ranges_follow_the_row_rule(default_ranges_run):
    records = default_ranges_run.pass_records
    assert records and all(r["rewritten"] and not r["kept"] for r in records), records  # one range
    assert {("decode-only", True), ("mixed", True), ("mixed", False)} <= kinds(default_ranges_run)
    assert_row_rule(default_ranges_run)


def test_greedy_first_tokens_agree_with_w4a16_for_most_prompts(split_run, plain_run):
    agree, prompts = first_token_agreement(split_run, plain_run)
    print(f"first-token agreement A4 prefill vs W4A16 (CUDA): {agree}/{prompts} = {agree / prompts:.0%}")
    assert agree / prompts >= FIRST_TOKEN_AGREEMENT_FLOOR
    for step in plain_run.steps:
        assert all(counts["a4"] == 0 for counts in step.evidence.values()), step.index


def test_warm_restart_loads_the_compiled_graphs_and_runs_the_same_rows(split_run, warm_run):
    assert split_run.pass_records and not warm_run.pass_records  # the pass ran once, cold
    assert warm_run.compiled_artifacts_loaded > 0
    assert [s.scheduled for s in warm_run.steps] == [s.scheduled for s in split_run.steps]
    assert [s.modes for s in warm_run.steps] == [s.modes for s in split_run.steps]
    assert [s.device_rows for s in warm_run.steps] == [s.device_rows for s in split_run.steps]
    assert warm_run.outputs == split_run.outputs
    assert_row_rule(warm_run)


def test_kernels_were_compiled_at_load_and_each_step_names_its_kernel_family(split_run, tiny_model):
    """The warm-up ran in every layer (it compiles in the first only: later layers hit Triton's
    caches); every step names the kernels that ran its calls. On the real shape (64 experts,
    top-8) the captured decode steps replayed the decode kernels and the step above 256 tokens
    (over 32 routes per expert, past every decode kernels' size) ran the Hopper prefill GEMMs
    (the tiled kernels off sm_90), with its prefill rows A4."""
    warmups = split_run.warmups
    assert set(warmups) == {*CALIBRATED, UNCALIBRATED} and all(w["calls"] > 0 for w in warmups.values())
    # served by the package whatever vLLM's own NVFP4 MoE choice on this GPU (Marlin, Humming)
    served = "A4PrefillModelOptNvFp4MoEMethod, a4prefill backend triton"
    assert split_run.moe_backends == dict.fromkeys(warmups, served)
    print("warm-up seconds per layer:", {layer: round(w["seconds"], 2) for layer, w in warmups.items()})
    assert all(step.kernel_families for step in split_run.steps)
    decode_steps = [s for s in split_run.steps if s.kind == "decode-only" and s.captured]
    large = [s for s in split_run.steps if max(s.forward_tokens) > 256]
    assert decode_steps and large and not any(s.captured for s in large)
    # the prefill GEMMs are sm_90 kernels (wgmma); other GPUs run the tiled kernels there
    large_family = "triton-prefill" if torch.cuda.get_device_capability() == (9, 0) else "triton-tiled"
    if tiny_model.parent.name.startswith("real"):
        for step in decode_steps:
            assert all(step.kernel_calls[layer] == {"triton-decode": 1} for layer in CALIBRATED), step.index
        for step in large:
            assert all(large_family in step.kernel_calls[layer] for layer in CALIBRATED), step.index
            assert step.evidence[CALIBRATED[0]]["a4"] == step.prefill_rows > 256
    else:
        assert {f for s in split_run.steps for f in s.kernel_families} == {"triton-tiled"}


@pytest.fixture(scope="module")
def a8_run(tiny_model, tmp_path_factory) -> E2EResult:
    """The split with ``prefill_precision: "a8"`` (the triton backend's A8 kernel: sm_90 only)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the triton backend's A8 kernel runs on sm_90 (Hopper) only")
    out = tmp_path_factory.mktemp("a8") / "run.json"
    ranges = json.dumps(SPLIT_RANGES)
    return run_engine(tiny_model, out, "--compilation-config", ranges, settings={"prefill_precision": "a8"})


def test_a8_prefill_rows_of_uncaptured_steps_run_a8_and_every_other_row_w4a16(a8_run, tiny_model):
    """Under ``"a8"`` (issue 28), by the device counters: captured steps ran no A8 row,
    uncaptured steps ran exactly their prefill rows A8 and the others W4A16, no row ran A4, in
    every layer (A8 needs no calibration: the uncalibrated layer runs it too). The ``tiny``
    model's intermediate size (64) is not a multiple of 128, so there every row runs W4A16; the
    ``real`` one's (768) runs A8. No kernel compiled while serving (``run_engine``)."""
    config = json.loads((tiny_model / "config.json").read_text())
    a8_shapes = config["hidden_size"] % 128 == 0 and config["moe_intermediate_size"] % 128 == 0
    assert any(not step.captured and step.prefill_rows for step in a8_run.steps)
    for step in a8_run.steps:
        for layer in (*CALIBRATED, UNCALIBRATED):
            counts = step.evidence[layer]
            assert counts["a4"] == 0, (step.index, layer, counts)
            a8_rows = step.prefill_rows if a8_shapes and not step.captured else 0
            assert counts.get("a8", 0) == a8_rows, (step.index, layer, step.modes, counts)
            assert counts["w4a16"] == step_rows(step) - a8_rows >= step.decode_rows, (step.index, layer)


def test_speculative_verify_rows_run_w4a16(speculative_run):
    assert speculative_run.max_decode_len == 4
    verify = [s for s in speculative_run.steps if any(1 < n <= 4 for n in s.scheduled.values())]
    assert verify, "n-gram speculation proposed no draft tokens: nothing was verified"
    assert_row_rule(speculative_run)
