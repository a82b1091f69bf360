"""The ``triton`` backend's decode kernels (``triton.decode_kernels``) on a CUDA GPU: every code and
scale byte dequantized exactly through the relabelled K, numerics against the reference, per-half
global scales, CUDA-graph capture without host syncs, and the default choice at decode sizes.
No speed assertions (``benchmarks/bench_moe.py`` measures them).

Tolerance as in ``test_triton_backend.py``: ``helpers.layers.assert_close_to_reference`` (fp32
accumulation in another order than the reference, then bf16 rounding).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from a4prefill.ops.backends.triton import fused
from a4prefill.ops.backends.triton.fused import fused_moe
from a4prefill.ops.backends.triton.plan import decode_kernels_run
from a4prefill.ops.backends.triton.schedules import DecodeGemm, DecodeTiles, GemmConfig, choose_config
from a4prefill.ops.reference import moe_reference
from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing
from helpers.layers import (
    SCALE_BYTE_SETS,
    assert_close_to_reference,
    halves_case,
    one_hot_case,
    one_hot_expected,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    # elsewhere plan_call gives these calls to the tiled kernels, which would be compared with themselves
    pytest.mark.skipif(
        torch.cuda.is_available() and not decode_kernels_run(torch.device("cuda")),
        reason="needs an sm_80+ GPU and a Triton whose Gluon has what the decode kernels use",
    ),
]

# The smallest shape every schedule divides: H % 512 == 0, I % 256 == 0.
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 16, 1024, 512, 4
SCHEDULES = [
    DecodeTiles(DecodeGemm(4, 128), DecodeGemm(2, 128)),
    DecodeTiles(DecodeGemm(2, 256, "rows"), DecodeGemm(2, 128, "rows")),
    DecodeTiles(DecodeGemm(4, 256), DecodeGemm(2, 128, "k", 32)),
    DecodeTiles(DecodeGemm(4, 128, "rows", 32), DecodeGemm(2, 256)),
    DecodeTiles(DecodeGemm(2, 256, "k", 32), DecodeGemm(4, 128, "rows", 32)),
    DecodeTiles(DecodeGemm(4, 128, "rows"), DecodeGemm(2, 128), routes=16),
    DecodeTiles(DecodeGemm(2, 128), DecodeGemm(4, 128, "rows", 32), routes=32),
    DecodeTiles(DecodeGemm(4, 256, "rows", prefetch=True), DecodeGemm(4, 128, "rows", prefetch=True)),
    DecodeTiles(DecodeGemm(4, 128, prefetch=True), DecodeGemm(2, 128, "k", 32, True), routes=16),
    DecodeTiles(DecodeGemm(4, 128, "rows", 32, True), DecodeGemm(4, 128, "rows", 32, True), routes=32),
    DecodeTiles(DecodeGemm(4, 256, "rows", stages=3), DecodeGemm(4, 128, "rows", prefetch=True)),
    DecodeTiles(DecodeGemm(4, 128, stages=4), DecodeGemm(2, 128, "rows", stages=6), routes=16),
    DecodeTiles(DecodeGemm(4, 128, prefetch=True), DecodeGemm(2, 128, prefetch=True), overlap=True),
    DecodeTiles(
        DecodeGemm(4, 256, "rows", stages=3, max_registers=128),
        DecodeGemm(4, 128, "rows", prefetch=True),
        routes=16,
        overlap=True,
    ),
]
TILED = GemmConfig(16, 32, 128, 64, 128, 2, 4)  # the tiled kernels' decode tiles


def decode_config(schedule: DecodeTiles) -> GemmConfig:
    return dataclasses.replace(TILED, decode=schedule)


@pytest.fixture(scope="module")
def layer():
    tiny = make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=21, calibration_tokens=256)
    return tiny, tiny.experts.to("cuda")


def inputs(tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(tokens, HIDDEN, generator=generator)).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(tokens, EXPERTS, TOP_K, generator)
    return hidden, topk_weights, topk_ids


@pytest.mark.parametrize("scale_set", sorted(SCALE_BYTE_SETS))
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_every_code_and_scale_byte_dequantizes_exactly(scale_set, schedule):
    """One product per output element, so any wrong code, scale, sign, K slot, warp slice or
    stored FC1 column shows as a different bit pattern than the tiled kernels' exact output, and
    as a different value than the literal e2m1/e4m3 tables give."""
    columns = torch.arange(HIDDEN)
    weights, x, ids = one_hot_case(SCALE_BYTE_SETS[scale_set], len(scale_set), HIDDEN, INTERMEDIATE, columns)
    gpu_weights = weights.to("cuda")
    x, ids = x.cuda(), ids.cuda()
    ones = torch.ones(ids.shape, device="cuda")
    decoded = fused_moe(x, ones, ids, gpu_weights, None, None, config=decode_config(schedule))
    tiled = fused_moe(x, ones, ids, gpu_weights, None, None, config=TILED)
    assert torch.equal(decoded, tiled)
    assert_close_to_reference(decoded, one_hot_expected(weights, columns), "w4a16")


@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("tokens", [1, 3, 8, 17, 64])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_matches_the_reference(layer, schedule, tokens, limit):
    tiny, weights = layer
    hidden, topk_weights, topk_ids = inputs(tokens, seed=tokens)
    config = decode_config(schedule)
    gpu = [t.cuda() for t in (hidden, topk_weights, topk_ids)]
    result = fused_moe(*gpu, weights, None, limit, config=config)
    expected = moe_reference(hidden, topk_weights, topk_ids, tiny.experts, None, limit)
    assert result.dtype == torch.bfloat16 and result.shape == hidden.shape
    assert_close_to_reference(result, expected, "w4a16")


@pytest.mark.parametrize("tokens", [3, 17, 64])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_a4_and_split_match_the_reference(layer, schedule, tokens):
    """A4 for every row, then split with every third row A4 (docs/numerics.md section 3)."""
    tiny, weights = layer
    hidden, topk_weights, topk_ids = inputs(tokens, seed=100 + tokens)
    scales = tiny.a4_scales
    gpu = [t.cuda() for t in (hidden, topk_weights, topk_ids)]
    config = decode_config(schedule)
    a4 = moe_reference(hidden, topk_weights, topk_ids, tiny.experts, scales)
    w4a16 = moe_reference(hidden, topk_weights, topk_ids, tiny.experts, None)
    result = fused_moe(*gpu, weights, scales.to("cuda"), None, config=config)
    assert_close_to_reference(result, a4, "a4")
    flags = (torch.arange(tokens) % 3 == 1).to(torch.uint8)
    split = fused_moe(*gpu, weights, scales.to("cuda"), None, flags.cuda(), config=config).cpu()
    is_a4 = flags.bool()
    assert_close_to_reference(split[is_a4], a4[is_a4], "a4")
    assert_close_to_reference(split[~is_a4], w4a16[~is_a4], "w4a16")


@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_a4_one_product_per_output_equals_the_tiled_kernels_bit_for_bit(schedule):
    """The tiled kernels' A4 path is the decode kernels' exact counterpart when every GEMM sum
    is one product: quantized FC1 input, alphas, re-quantization of FC1's output per 16 features
    with each expert's gs2 (most blocks of expert 0 saturate, none of expert 1)."""
    from a4prefill.ops.scales import derive_a4_scales

    columns = torch.arange(HIDDEN)
    weights, x, ids = one_hot_case(SCALE_BYTE_SETS["positive normal"], 3, HIDDEN, INTERMEDIATE, columns)
    scales = derive_a4_scales(torch.full((2, 2), 1 / 2688), torch.tensor([0.05, 2000.0])).to("cuda")
    gpu_weights, x, ids = weights.to("cuda"), x.cuda(), ids.cuda()
    ones = torch.ones(ids.shape, device="cuda")
    decoded = fused_moe(x, ones, ids, gpu_weights, scales, None, config=decode_config(schedule))
    tiled = fused_moe(x, ones, ids, gpu_weights, scales, None, config=TILED)
    assert torch.equal(decoded, tiled)


@pytest.mark.parametrize("ratio", [2.0, 0.5])
def test_gate_and_up_global_scales_apply_per_half_bit_exactly(layer, ratio):
    """As for the tiled kernels: moving a power-of-two ratio between the up half's global scale
    and its block scales leaves the output bit-identical."""
    tiny, _ = layer
    halves, uniform = (experts.to("cuda") for experts in halves_case(tiny, ratio))
    gpu = [t.cuda() for t in inputs(12, seed=5)]
    config = decode_config(SCHEDULES[0])
    per_half, uniform_out = (
        fused_moe(*gpu, experts, None, None, config=config) for experts in (halves, uniform)
    )
    assert torch.equal(per_half, uniform_out)


def test_out_of_range_expert_ids_are_ignored(layer):
    tiny, weights = layer
    hidden, topk_weights, topk_ids = inputs(10, seed=3)
    bad_ids = topk_ids.clone()
    bad_ids[::3, 0] = EXPERTS
    bad_ids[1::4, 1] = -1
    dropped = bad_ids != topk_ids
    gpu = [t.cuda() for t in (hidden, topk_weights, bad_ids)]
    result = fused_moe(*gpu, weights, None, None, config=decode_config(SCHEDULES[0]))
    expected = moe_reference(hidden, torch.where(dropped, 0.0, topk_weights), topk_ids, tiny.experts, None)
    assert_close_to_reference(result, expected, "w4a16")


@pytest.mark.parametrize("schedule", [SCHEDULES[0], SCHEDULES[-3], SCHEDULES[-1]], ids=str)
def test_captured_decode_replays_new_inputs_without_host_syncs(layer, schedule):
    _, weights = layer
    config = decode_config(schedule)
    static = [t.cuda() for t in inputs(6, seed=1)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(*static, weights, None, None, config=config)  # compile and warm up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fused_moe(*static, weights, None, None, config=config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fresh = [t.cuda() for t in inputs(6, seed=2)]
    for buffer, value in zip(static, fresh, strict=True):
        buffer.copy_(value)
    graph.replay()
    assert torch.equal(captured, fused_moe(*fresh, weights, None, None, config=config))


def test_decode_sizes_take_the_decode_kernels_by_default(layer, monkeypatch):
    _, weights = layer
    calls = []
    original = fused._fused_moe_decode

    def spy(*args, **kwargs):
        calls.append(args[5][0])  # the launch's schedule (launch: schedule, routing, overlap)
        return original(*args, **kwargs)

    monkeypatch.setattr(fused, "_fused_moe_decode", spy)
    for tokens in (2, 16, 1000):
        gpu = [t.cuda() for t in inputs(tokens, seed=tokens)]
        fused_moe(*gpu, weights, None, None)
        schedule = choose_config(tokens * TOP_K, EXPERTS, HIDDEN, INTERMEDIATE).decode
        assert (schedule is None) == (tokens == 1000)
        assert calls == ([] if schedule is None else [schedule])
        calls.clear()
    # A4 and split calls of decode size take them too; fp16 activations keep the tiled kernels
    scales = layer[0].a4_scales.to("cuda")
    hidden, topk_weights, topk_ids = (t.cuda() for t in inputs(2, seed=9))
    flags = torch.tensor([0, 1], dtype=torch.uint8, device="cuda")
    fused_moe(hidden, topk_weights, topk_ids, weights, scales, None)
    fused_moe(hidden, topk_weights, topk_ids, weights, scales, None, flags)
    assert len(calls) == 2
    fused_moe(hidden.half(), topk_weights, topk_ids, weights, None, None)
    assert len(calls) == 2
