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
        ("fc2_kernel", True),
        ("route_prep_kernel", True),
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
