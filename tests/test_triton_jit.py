"""What the ``triton`` backend compiles, through Triton's own launch path (``triton_launches``):
on the CPU compiled offline for sm_90a, on a CUDA GPU launched for real. Every kernel it launches
can be reported to a Triton post-compile hook (vLLM's JIT monitor serializes nothing itself,
Triton serializes each kernel's specialization before it calls any hook), and after a layer's
load-time warm-up no call of 1 .. max_tokens tokens compiles anything.

The first test failed on the code before the fix: the Gluon decode kernels took their layouts as
constexprs, and Triton's ``serialize_specialization_data`` raised ``TypeError: Object of type
DistributedLinearLayout is not JSON serializable``, the traceback vLLM showed at the first request
of a model whose shapes take the decode kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a4prefill.ops.backends.base import WarmUp
from a4prefill.ops.backends.triton import fused_a8, plan
from a4prefill.ops.backends.triton.fused import fused_moe
from a4prefill.ops.backends.triton.routing import SMALL_ROUTING_MAX
from a4prefill.ops.backends.triton.schedules import (
    A8_PREFILL_RS_TOK,
    A8_PREFILL_WIDE_TOK,
    DECODE_SCHEDULES,
    PREFILL_SCHEDULES,
    DecodeGemm,
    DecodeTiles,
    GemmConfig,
    PrefillTiles,
)
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.precision import MODE_A4, MODE_SPLIT, MODE_W4A16
from a4prefill.ops.scales import A4Scales
from helpers.markers import needs_gluon
from helpers.triton_launches import Compile, fresh_launches, package_kernels

pytestmark = [
    pytest.mark.slow,
    needs_gluon,
]

# The real-shape layer of the engine tests and the served benchmark (tiny_model.REAL_SHAPE): the
# decode and tiled kernels both serve it. Weights and inputs are zeros: only what compiles matters.
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 64, 2048, 768, 8
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]
MAX_TOKENS = 1024  # past the one-program routing (512 tokens) and the last tiled tier (769)
A8_MAX_TOKENS = 1400  # past the A8 256-route tiles' first size (1280 tokens: 160 routes per expert)

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
def layer_tensors(a4: bool, device: str) -> tuple[NvFp4Experts, A4Scales | None]:
    experts = NvFp4Experts(
        torch.zeros(EXPERTS, 2 * INTERMEDIATE, HIDDEN // 2, dtype=torch.uint8, device=device),
        torch.zeros(EXPERTS, 2 * INTERMEDIATE, HIDDEN // 16, dtype=torch.float8_e4m3fn, device=device),
        torch.ones(EXPERTS, 2, device=device),
        torch.zeros(EXPERTS, HIDDEN, INTERMEDIATE // 2, dtype=torch.uint8, device=device),
        torch.zeros(EXPERTS, HIDDEN, INTERMEDIATE // 16, dtype=torch.float8_e4m3fn, device=device),
        torch.ones(EXPERTS, device=device),
    )
    scales = A4Scales(torch.ones(1, device=device), torch.ones(EXPERTS, device=device)) if a4 else None
    return experts, scales


def call(
    device: str, tokens: int, mode: int, config: GemmConfig | None = None, ids_dtype=torch.int32, **io
) -> None:
    """One ``fused_moe`` call of ``tokens`` tokens in precision ``mode`` (``MODE_*``) on ``device``."""
    experts, scales = layer_tensors(mode != MODE_W4A16, device)
    dtype = io.get("dtype", torch.bfloat16)
    x = torch.zeros(tokens, HIDDEN, dtype=dtype, device=device)
    if io.get("unaligned"):
        x = torch.zeros(tokens * HIDDEN + 1, dtype=dtype, device=device)[1:].view(tokens, HIDDEN)
    ids = (torch.arange(tokens * TOP_K, device=device) % EXPERTS).reshape(tokens, TOP_K).to(ids_dtype)
    weights = torch.full((tokens, TOP_K), 0.125, dtype=io.get("weights_dtype", torch.float32), device=device)
    flags = (torch.arange(tokens, device=device) % 3 == 0).to(torch.uint8) if mode == MODE_SPLIT else None
    fused_moe(x, weights, ids, experts, scales, None, flags, config=config)


@contextlib.contextmanager
def on(device: str) -> Iterator[None]:
    """On the CPU, the backend's device checks answer as on an H200 (decode kernels, overlapping
    launches, prefill kernels, the A8 kernel); on a GPU they answer for it."""
    with pytest.MonkeyPatch.context() as patch:
        if device == "cpu":
            patch.setattr(plan, "decode_kernels_run", lambda _: True)
            patch.setattr(plan, "grid_dependencies_run", lambda _: True)
            patch.setattr(plan, "prefill_kernels_run", lambda _: True)
            patch.setattr(fused_a8, "a8_device_refusal", lambda _: None)
        yield


MODES = {"w4a16": MODE_W4A16, "a4": MODE_A4, "split": MODE_SPLIT}
CASES = [(rule.tiles, mode) for rule in DECODE_SCHEDULES for mode in MODES] + [
    (schedule, "w4a16") for schedule in OPTION_SCHEDULES
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("schedule", "mode"), CASES, ids=str)
def test_every_decode_schedule_reaches_a_post_compile_hook_serialized(device, schedule, mode):
    """Every kernel of a decode-kernel call (routing, permutation, A4 quantization, the two Gluon
    GEMMs, the combine) compiles, and Triton serializes its specialization for the hook."""
    config = dataclasses.replace(TILED_CONFIGS[0], decode=schedule)
    with on(device), fresh_launches(device) as compiles:
        call(device, 5, MODES[mode], config)
    compiled = {event.kernel for event in compiles}
    assert {"fc1_decode_kernel", "fc2_decode_kernel", "permute_k_kernel", "combine_kernel"} <= compiled
    assert ("quantize_rows_kernel" in compiled) is (mode != "w4a16")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", TILED_CONFIGS, ids=str)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_tiled_kernel_reaches_a_post_compile_hook_serialized(device, config, mode):
    dtype = torch.bfloat16 if config.ptx_dequant else torch.float16
    with on(device), fresh_launches(device) as compiles:
        call(device, 40, MODES[mode], config, dtype=dtype)
    compiled = {event.kernel for event in compiles}
    assert {"route_prep_kernel", "fc1_kernel", "fc2_kernel", "combine_kernel"} <= compiled
    assert ("fc1_finalize_kernel" in compiled) is (config.split_k > 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("tokens", "tiles", "kernel"),
    [
        (384, None, "grouped_w4_gemm_ws_kernel"),  # 48 routes per expert: two CTAs per SM
        (512, None, "grouped_w4_gemm_ws_kernel"),  # 64 (4096 routes: the chunked routing)
        (256, "rs_w128_t64_d4_r80", "grouped_w4_gemm_rs_kernel"),  # 2048 routes: the one-program routing
        (1280, None, "grouped_w4_gemm_ws_kernel"),  # 160: 256-route tiles, the chunked routing
        (1280, "rs_w128_t256_d4_ws_x2_h2", "grouped_w4_gemm_ws_kernel"),  # FC1's rows gathered first
        (512, "w128_t256_d4", "grouped_w4_gemm_kernel"),  # weights in shared memory: explicit only
    ],
)
def test_every_prefill_kernel_reaches_a_post_compile_hook_serialized(device, tokens, tiles, kernel):
    """A W4A16 call of prefill size (on sm_90) runs the routing (one program up to
    ``SMALL_ROUTING_MAX`` routes, the chunked kernels above), the two prefill GEMMs (the size's
    default tiles, whose FC1 copies its rows by token from ``x`` with its columns permuted, or
    ``tiles`` for both GEMMs by an explicit config; a warp-specialized FC1 without
    ``rows_by_token`` after its row gather) and the combine; each compiles and Triton serializes
    its specialization for the hook."""
    if device == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the prefill kernels run on sm_90 (Hopper) only")
    config = None
    if tiles is not None:
        both = PrefillTiles(PREFILL_SCHEDULES[tiles], PREFILL_SCHEDULES[tiles])
        config = dataclasses.replace(TILED_CONFIGS[0], prefill=both)
    with on(device), fresh_launches(device) as compiles:
        call(device, tokens, MODE_W4A16, config)
    compiled = {event.kernel for event in compiles}
    assert {kernel, "combine_kernel"} <= compiled
    # a warp-specialized FC1 reads its bf16 rows in MMA column order from one gather_rows_kernel
    # copy: its routes' rows in sorted order, or (rows_by_token, the defaults) x's own rows
    assert ("gather_rows_kernel" in compiled) is (kernel == "grouped_w4_gemm_ws_kernel")
    chunked = {"route_count_kernel", "route_offsets_kernel", "route_place_kernel"}
    if tokens * TOP_K > SMALL_ROUTING_MAX:
        assert chunked <= compiled and "route_prep_kernel" not in compiled
    else:
        assert "route_prep_kernel" in compiled and not chunked & compiled


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_call_compiles_nothing_new_for_another_route_count(device):
    """The prefill kernels take the route count unspecialized: after a call of 4112 routes (a
    multiple of 16), one of 4120 launches the same compiled kernels. (Specialized, the second
    compiled both again: a compile while serving, which the warm-up's one call per plan cannot
    prevent.)"""
    if device == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the prefill kernels run on sm_90 (Hopper) only")
    with on(device), fresh_launches(device) as compiles:
        call(device, 514, MODE_W4A16)
        first = len(compiles)
        call(device, 515, MODE_W4A16)
    assert first > 0 and compiles[first:] == []


def test_the_hook_tests_cover_every_kernel_the_package_launches():
    """A new ``*_kernel`` must be added to the cases above (the two tests' kernel sets)."""
    covered = {
        "route_prep_kernel",
        "route_count_kernel",
        "route_offsets_kernel",
        "route_place_kernel",
        "quantize_rows_kernel",
        "permute_k_kernel",
        "fc1_decode_kernel",
        "fc2_decode_kernel",
        "fc1_kernel",
        "fc1_finalize_kernel",
        "fc2_kernel",
        "combine_kernel",
        "grouped_w4_gemm_rs_kernel",
        "grouped_w4_gemm_kernel",
        "grouped_w4_gemm_ws_kernel",
        "fp8_block_amax_kernel",
        "quantize_fp8_rows_kernel",
        "gather_rows_kernel",
    }
    assert {name.rsplit(".", 1)[-1] for name in package_kernels()} == covered


class CompiledWhileServing(AssertionError):
    """A compile after the warm-up: vLLM's JIT monitor in ``error`` mode fails the request."""


def _refuse(event: Compile) -> None:
    raise CompiledWhileServing(f"{event.kernel} compiled after the warm-up")


@contextlib.contextmanager
def warmed_up(device: str) -> Iterator[tuple[WarmUp, list[Compile]]]:
    """A real-shape layer's load-time warm-up on ``device``; yields its report and the list of
    compiles, which records every compile until the end (the warm-up's come first)."""
    from a4prefill.ops.backends.triton.warmup import warm_up

    experts, scales = layer_tensors(True, device)
    with on(device), fresh_launches(device) as compiles:
        yield warm_up(experts, scales, None, MAX_TOKENS, torch.bfloat16, TOP_K), compiles


@pytest.mark.parametrize("device", DEVICES)
def test_without_the_warm_up_a_first_call_compiles(device):
    """The check below can fail: a cold layer's first call compiles."""
    with on(device), fresh_launches(device, _refuse), pytest.raises(CompiledWhileServing):
        call(device, 3, MODE_W4A16)


@pytest.mark.parametrize("device", DEVICES)
def test_after_the_warm_up_no_call_of_any_size_or_precision_compiles(device):
    """Every token count up to the warm-up's bound, in W4A16, A4 and split."""
    with warmed_up(device) as (report, compiles):
        warm = len(compiles)
        assert report.calls == 3 * report.plans and warm > 0
        for tokens in range(1, MAX_TOKENS + 1):
            for name, mode in MODES.items():
                call(device, tokens, mode)
                assert len(compiles) == warm, (tokens, name, compiles[warm:])


@pytest.mark.parametrize("device", DEVICES)
def test_after_an_a8_warm_up_no_a8_call_of_any_size_compiles(device):
    """A layer warmed up with ``a8``: A8 calls of 1 .. ``A8_MAX_TOKENS`` tokens (every routing
    launch, the one-program routing's sizes and the torch routing, both A8 schedules: 256-route
    tiles from 1280 tokens) compile nothing more. (The check can fail: the A8 kernel's first call
    compiles it, as the W4A16 test above shows; a warm-up of the 128-route schedule alone leaves
    the 256-route kernels and routing to the first call of 1280 tokens.)"""
    if device == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the A8 kernel runs on sm_90 (Hopper) only")
    from a4prefill.ops.backends.triton.warmup import a8_representatives, plan_representatives, warm_up

    experts, _ = layer_tensors(False, device)
    with on(device), fresh_launches(device) as compiles:
        report = warm_up(experts, None, None, A8_MAX_TOKENS, torch.bfloat16, TOP_K, a8=True)
        warm = len(compiles)
        compiled = {event.kernel for event in compiles}
        a8_kernels = {"grouped_w4_gemm_ws_kernel", "fp8_block_amax_kernel", "quantize_fp8_rows_kernel"}
        assert a8_kernels | {"route_prep_kernel"} <= compiled
        shapes = (TOP_K, EXPERTS, HIDDEN, INTERMEDIATE, torch.bfloat16, torch.device(device))
        w4a16_plans = len(plan_representatives(A8_MAX_TOKENS, *shapes))
        a8_launches = a8_representatives(A8_MAX_TOKENS, TOP_K, EXPERTS, HIDDEN)
        assert {schedule for schedule, _ in a8_launches} == {A8_PREFILL_RS_TOK, A8_PREFILL_WIDE_TOK}
        assert report.calls == report.plans == w4a16_plans + len(a8_launches)
        for tokens in [*range(1, 70), *range(70, A8_MAX_TOKENS + 1, 53), 1279, 1280, A8_MAX_TOKENS]:
            x = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
            ids = (torch.arange(tokens * TOP_K, device=device) % EXPERTS).reshape(tokens, TOP_K).int()
            weights = torch.full((tokens, TOP_K), 0.125, device=device)
            fused_a8.fused_moe_a8(x, weights, ids, experts, None)
            assert len(compiles) == warm, (tokens, compiles[warm:])


@pytest.mark.parametrize("device", DEVICES)
def test_router_dtypes_and_unaligned_activations_compile_nothing_new(device):
    """int64 ids, bf16 router weights and activations at an odd address reach the kernels as the
    warm-up's int32, fp32 and aligned copies."""

    @settings(max_examples=20, deadline=None)
    @given(
        tokens=st.integers(1, MAX_TOKENS),
        mode=st.sampled_from(sorted(MODES)),
        ids_dtype=st.sampled_from([torch.int32, torch.int64]),
        weights_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
        unaligned=st.booleans(),
    )
    def no_compile(tokens, mode, ids_dtype, weights_dtype, unaligned):
        call(
            device, tokens, MODES[mode], ids_dtype=ids_dtype, weights_dtype=weights_dtype, unaligned=unaligned
        )
        assert len(compiles) == warm, compiles[warm:]

    with warmed_up(device) as (_, compiles):
        warm = len(compiles)
        no_compile()
