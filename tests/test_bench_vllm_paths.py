"""The served benchmark's report (``benchmarks/bench_vllm_paths.py``) without running vLLM: which
GPU kernels count as the MoE's, and a run whose configurations failed is reported, not a crash."""

from __future__ import annotations

import pytest

from helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_vllm_paths")


@pytest.mark.parametrize(
    ("kernel", "moe"),
    [
        ("fc1_decode_kernel", True),
        # the Hopper prefill GEMMs: not counted before (an 8K prefill's MoE time read 0.3 ms)
        ("grouped_w4_gemm_rs_kernel", True),
        ("grouped_w4_gemm_kernel", True),
        ("fc2_kernel", True),
        ("route_prep_kernel", True),
        # the chunked routing (above 2048 routes since 2026-12-04): not counted before
        ("route_count_kernel", True),
        ("route_offsets_kernel", True),
        ("route_place_kernel", True),
        ("void marlin_moe_wna16::Marlin<...>(...)", True),
        ("fused_moe_kernel", True),
        ("void vllm::moe::moe_align_block_size_kernel<int>(...)", True),
        ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", False),
        ("triton_poi_fused_add_rms_norm_0", False),
        ("flash_fwd_kernel", False),
    ],
)
def test_the_moe_share_counts_the_expert_kernels_only(bench, kernel, moe):
    assert bench.is_moe_kernel(kernel) is moe


def test_failed_configurations_are_rows_of_the_table_and_nothing_is_plotted(bench, tmp_path):
    """Before: every configuration failing ended the run in ZeroDivisionError (the plot's bar
    width); the table did not say which configuration failed or why."""
    data = {
        "summary": {},
        "prefill_tokens": 8192,
        "failed": {"a4prefill_w4a16": {"reason": "exit 1: TypeError: not JSON serializable"}},
    }
    table = bench.markdown_table(data).splitlines()
    assert table[-1].startswith("| a4prefill_w4a16 | failed: exit 1: TypeError")
    assert table[-1].count("|") == table[0].count("|")
    with pytest.raises(ValueError, match="no configuration completed"):
        bench.plot(data, tmp_path / "plot.png")


def test_the_a8_splits_differ_from_the_split_only_where_they_say_and_the_others_run_a4(bench, tmp_path):
    """``a4prefill_split_a8``: the split's engine arguments plus ``prefill_precision: "a8"`` (the
    default backend, CUDA graphs as the split); ``a4prefill_split_a8_reference``: the same on the
    reference backend without CUDA graphs (not capture-safe); every other configuration keeps
    its engine arguments (no a4prefill settings, FULL_AND_PIECEWISE graphs, the default backend)."""
    split = bench.engine_arguments("a4prefill_split", tmp_path, 8192)
    a8 = bench.engine_arguments("a4prefill_split_a8", tmp_path, 8192)
    assert a8 == {**split, "additional_config": {"a4prefill": {"prefill_precision": "a8"}}}
    assert "environment" not in bench.CONFIGS["a4prefill_split_a8"]
    oracle = bench.engine_arguments("a4prefill_split_a8_reference", tmp_path, 8192)
    assert oracle["additional_config"] == {"a4prefill": {"prefill_precision": "a8"}}
    assert oracle["compilation_config"]["cudagraph_mode"] == "NONE"
    assert oracle["compilation_config"]["inductor_passes"] == split["compilation_config"]["inductor_passes"]
    assert bench.CONFIGS["a4prefill_split_a8_reference"]["environment"] == {"A4PREFILL_BACKEND": "reference"}
    differing = {key for key in oracle if oracle[key] != split.get(key)}
    assert differing == {"additional_config", "compilation_config"}
    for name in set(bench.CONFIGS) - {"a4prefill_split_a8", "a4prefill_split_a8_reference"}:
        arguments = bench.engine_arguments(name, tmp_path, 8192)
        assert "additional_config" not in arguments and "environment" not in bench.CONFIGS[name]
        assert arguments["compilation_config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"


def test_a_configuration_list_with_an_unknown_name_is_refused_before_anything_runs(
    bench, monkeypatch, capsys
):
    def built(*args):
        raise AssertionError("checkpoints were built before --configs was checked")

    monkeypatch.setattr(bench, "build_checkpoints", built)
    monkeypatch.setattr("sys.argv", ["bench_vllm_paths.py", "--configs", "bf16,a4prefil_split"])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2 and "--configs: expected a comma list of" in capsys.readouterr().err


def test_kept_results_are_reused_only_for_the_same_prefill_length_and_checkpoints(bench, tmp_path):
    """``--work`` keeps each configuration's result per model and prefill length, and a
    checkpoint rebuilt for a new recipe says so (its caller drops the results measured before)."""
    assert bench.result_path(tmp_path, "tiny", "bf16", 8192) != bench.result_path(
        tmp_path, "tiny", "bf16", 4096
    )
    paths, rebuilt = bench.build_checkpoints("tiny", tmp_path)
    assert rebuilt and (paths["bf16"] / "config.json").exists()
    assert bench.build_checkpoints("tiny", tmp_path) == (paths, False)
    stamp = paths["nvfp4"] / "a4prefill_tiny_model.json"
    stamp.write_text(stamp.read_text().replace('"recipe": "', '"recipe": "0'))  # an older recipe
    assert bench.build_checkpoints("tiny", tmp_path) == (paths, True)
