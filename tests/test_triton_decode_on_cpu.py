"""The decode kernels' programs run on the CPU: ``fused_moe`` with its decode schedule, the two
Gluon GEMM kernels compiled for sm_90a as on an H100/H200 and their TTGIR interpreted
(``ttgir_interpreter``), against the reference and the literal e2m1/e4m3 tables.

What runs as on the GPU: the package's ``fused_moe`` and ``_fused_moe_decode``, the decode
kernels' compiled TTGIR (offsets, masks, K relabelling, warp splits, route tiles, the W4A16, A4
and split epilogues with the A4 re-quantization), their inline PTX (``ptx_subset``), the
activation permutation (Triton's own interpreter) and the torch routing path of
``build_routing``. What stands in, by its documented contract in torch (the plain Triton kernels
behind them call Triton's standard library, which Triton's interpreter only runs when chosen
before import): the top-k combine, and the A4 activation quantization (``quantize_rows``: the
reference quantizer's ``e2m1 * block_scale``); the one-program routing kernel is replaced by
``build_routing``'s torch path (same ``Routing`` contract). Not checked here: how
Triton lowers the layouts to PTX, the MMA's own addition order, speed (GPU tests and
``benchmarks/bench_moe.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from a4prefill.ops.backends.triton.schedules import DecodeGemm, DecodeTiles, GemmConfig, choose_config
from a4prefill.ops.reference import moe_reference
from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing
from helpers.layers import SCALE_BYTE_SETS, assert_close_to_reference, one_hot_case, one_hot_expected
from helpers.markers import needs_gluon

pytestmark = [
    pytest.mark.slow,
    needs_gluon,
]

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 5, 512, 256, 2
# Every kind of schedule that fits H=512, I=256: warps 1-8, K and row splits, 16 and 32 rows per
# warp, 128- and 256-column steps, 8-, 16- and 32-route tiles, with and without prefetching
# (1, 2 and 4 K steps per warp; odd counts above 1: test_prefetching_with_an_odd_step_count_...),
# code words staged through shared memory 2-6 steps deep (fewer steps than stages included), a
# register cap, FC2 overlapping FC1 (programmatic dependent launch: L2 prefetches, then a wait).
SCHEDULES = [
    DecodeTiles(DecodeGemm(4, 128), DecodeGemm(2, 128)),
    DecodeTiles(DecodeGemm(2, 256, "rows"), DecodeGemm(4, 128, "rows")),
    DecodeTiles(DecodeGemm(1, 128, "rows", 32), DecodeGemm(2, 128, "k", 32)),
    DecodeTiles(DecodeGemm(4, 128, "rows"), DecodeGemm(2, 128), routes=16),
    DecodeTiles(DecodeGemm(2, 256, "k", 32), DecodeGemm(8, 128, "rows"), routes=32),
    DecodeTiles(DecodeGemm(4, 128, "k", 32), DecodeGemm(2, 128, "rows", 32), routes=16),
    DecodeTiles(DecodeGemm(4, 128, prefetch=True), DecodeGemm(2, 128, "rows", prefetch=True)),
    DecodeTiles(DecodeGemm(1, 128, "rows", prefetch=True), DecodeGemm(2, 128, "k", 32, True), routes=16),
    DecodeTiles(DecodeGemm(4, 128, "rows", stages=3), DecodeGemm(2, 128, "rows", stages=4)),
    DecodeTiles(DecodeGemm(2, 128, "k", 32, stages=2), DecodeGemm(4, 128, "rows", stages=6), routes=16),
    DecodeTiles(
        DecodeGemm(4, 256, "rows", stages=3, max_registers=128), DecodeGemm(2, 128, "k"), overlap=True
    ),
    DecodeTiles(DecodeGemm(2, 128, "k", 32), DecodeGemm(1, 256, "rows", stages=2), routes=16, overlap=True),
]
TILED = GemmConfig(16, 32, 128, 64, 128, 2, 4)


def _combine_contract(y, topk_weights, topk_ids, output, experts, *_):
    """``shared_kernels.combine_kernel`` for W4A16 rows: ``out[t] = bf16(sum_j fp32(w[t, j]) *
    fp32(y[t k + j]))`` over the routes with a valid expert id."""
    tokens, top_k = topk_ids.shape
    valid = (topk_ids >= 0) & (topk_ids < experts.w13_weight.shape[0])
    rows = torch.where(valid[..., None], y.view(tokens, top_k, -1).float(), 0.0)  # never-written rows
    output.copy_((rows * topk_weights.float()[..., None]).sum(1).to(output.dtype))


def _quantize_rows_contract(x, encode_scale, row_flags=None, write_codes=False):
    """``quantize.quantize_rows`` without codes: ``e2m1 * block_scale`` of every row (rows whose
    flag is 0 copied), bit-exact with the reference quantizer."""
    from a4prefill.ops import nvfp4

    assert not write_codes
    quantized = nvfp4.quantize_dequantize_blocks(x, encode_scale).to(x.dtype)
    if row_flags is not None:
        quantized = torch.where(row_flags.bool()[:, None], quantized, x)
    return quantized, None, None


@pytest.fixture(scope="module")
def decode_on_cpu():
    """``fused_moe`` on CPU tensors with the decode kernels interpreted; yields the two
    interpreted GEMM kernels (their ``launches`` record the grids)."""
    from triton.runtime.interpreter import InterpretedFunction

    from a4prefill.ops.backends.triton import decode_kernels, fused, plan
    from helpers.gluon_on_cpu import InterpretedKernel

    kernels = {
        name: InterpretedKernel(getattr(decode_kernels, name))
        for name in ("fc1_decode_kernel", "fc2_decode_kernel")
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, kernel in kernels.items():
            patch.setattr(decode_kernels, name, kernel)
        patch.setattr(
            decode_kernels, "permute_k_kernel", InterpretedFunction(decode_kernels.permute_k_kernel.fn)
        )
        patch.setattr(plan, "routing_launch", functools.partial(plan.routing_launch, force_torch=True))
        patch.setattr(fused, "_combine", _combine_contract)
        patch.setattr(fused, "quantize_rows", _quantize_rows_contract)
        patch.setattr(plan, "decode_kernels_run", lambda device: True)
        patch.setattr(plan, "grid_dependencies_run", lambda device: True)
        yield kernels


@pytest.fixture(scope="module")
def layer():
    return make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=11, calibration_tokens=64)


def inputs(tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(tokens, HIDDEN, generator=generator)).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(tokens, EXPERTS, TOP_K, generator)
    return hidden, topk_weights, topk_ids


def run_decode(
    schedule: DecodeTiles, *args, limit: float | None = None, a4_scales=None, row_flags=None
) -> torch.Tensor:
    from a4prefill.ops.backends.triton.fused import fused_moe

    config = dataclasses.replace(TILED, decode=schedule)
    return fused_moe(*args, a4_scales, limit, row_flags, config=config)


@pytest.mark.parametrize("schedule", [SCHEDULES[0], SCHEDULES[3], SCHEDULES[4]], ids=str)
def test_a_tile_reads_the_activations_of_its_own_routes_only(decode_on_cpu, layer, schedule):
    """A tile's rows past its expert's routes (padding, the next expert's routes) are masked at
    the loads, so they cost no memory traffic: FC1 reads each route's input row and FC2 each
    route's FC1 output once per warp-K-slice of every CTA of the grid's second axis (a K split
    divides K among the warps, a row split gives each warp all of K), in 8-, 16- and 32-route
    tiles holding 1-3 routes each."""
    hidden, topk_weights, topk_ids = inputs(4, seed=5)
    run_decode(schedule, hidden, topk_weights, topk_ids, layer.experts)
    routes = topk_ids.numel()
    for name, gemm, k, rows in (
        ("fc1_decode_kernel", schedule.fc1, HIDDEN, "x_ptr"),
        ("fc2_decode_kernel", schedule.fc2, INTERMEDIATE, "h_ptr"),
    ):
        kernel = decode_on_cpu[name]
        warp_slices = 1 if gemm.split == "k" else gemm.warps
        assert kernel.reads[-1][rows] == routes * k * warp_slices * kernel.launches[-1][1], name


@pytest.mark.parametrize("tokens", [1, 23])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_the_decode_program_matches_the_reference(decode_on_cpu, layer, schedule, tokens):
    """23 tokens x top-2 over 5 experts: experts with several tiles of 8 routes, partial tiles,
    rows of the next expert inside a tile (masked at the store)."""
    hidden, topk_weights, topk_ids = inputs(tokens, seed=tokens)
    result = run_decode(schedule, hidden, topk_weights, topk_ids, layer.experts)
    expected = moe_reference(hidden, topk_weights, topk_ids, layer.experts, None)
    assert decode_on_cpu["fc1_decode_kernel"].launches[-1][1] == INTERMEDIATE // schedule.fc1.rows_per_cta
    assert_close_to_reference(result, expected, "w4a16")


@pytest.mark.parametrize("tokens", [1, 23])
@pytest.mark.parametrize("schedule", [SCHEDULES[0], SCHEDULES[2], SCHEDULES[4]], ids=str)
def test_the_a4_program_matches_the_reference(decode_on_cpu, layer, schedule, tokens):
    """Quantized FC1 input, alpha1 = scale2 / gs1, FC1 output re-quantized per 16 features with
    gs2[e], alpha2 = scale2 / gs2[e]."""
    hidden, topk_weights, topk_ids = inputs(tokens, seed=40 + tokens)
    scales = layer.a4_scales
    result = run_decode(schedule, hidden, topk_weights, topk_ids, layer.experts, a4_scales=scales)
    expected = moe_reference(hidden, topk_weights, topk_ids, layer.experts, scales)
    w4a16 = moe_reference(hidden, topk_weights, topk_ids, layer.experts, None)
    assert_close_to_reference(result, expected, "a4")
    assert (result.float() - expected.float()).norm() < (result.float() - w4a16.float()).norm()


@pytest.mark.parametrize("schedule", [SCHEDULES[1], SCHEDULES[3], SCHEDULES[5]], ids=str)
def test_the_split_program_gives_each_row_its_precision(decode_on_cpu, layer, schedule):
    """Rows flagged 1 are A4 and the others W4A16, within one launch of each kernel."""
    hidden, topk_weights, topk_ids = inputs(21, seed=7)
    flags = (torch.arange(21) % 3 == 1).to(torch.uint8)
    result = run_decode(
        schedule, hidden, topk_weights, topk_ids, layer.experts, a4_scales=layer.a4_scales, row_flags=flags
    )
    a4 = moe_reference(hidden, topk_weights, topk_ids, layer.experts, layer.a4_scales)
    w4a16 = moe_reference(hidden, topk_weights, topk_ids, layer.experts, None)
    is_a4 = flags.bool()
    assert_close_to_reference(result[is_a4], a4[is_a4], "a4")
    assert_close_to_reference(result[~is_a4], w4a16[~is_a4], "w4a16")
    assert not torch.equal(a4[is_a4], w4a16[is_a4])


@pytest.mark.parametrize("schedule", [SCHEDULES[0], SCHEDULES[4]], ids=str)
def test_the_swiglu_limit_is_applied(decode_on_cpu, layer, schedule):
    hidden, topk_weights, topk_ids = inputs(9, seed=4)
    result = run_decode(schedule, hidden, topk_weights, topk_ids, layer.experts, limit=0.5)
    expected = moe_reference(hidden, topk_weights, topk_ids, layer.experts, None, 0.5)
    unlimited = moe_reference(hidden, topk_weights, topk_ids, layer.experts, None)
    assert not torch.equal(expected, unlimited)
    assert_close_to_reference(result, expected, "w4a16")


@pytest.mark.parametrize("scale_set", sorted(SCALE_BYTE_SETS))
@pytest.mark.parametrize("schedule", [SCHEDULES[0], SCHEDULES[2], SCHEDULES[4]], ids=str)
def test_every_code_and_scale_byte_goes_through_its_k_slot(decode_on_cpu, schedule, scale_set):
    """One product per output element (``helpers.layers.one_hot_case``); the 128 one-hot columns cover
    every slot of the 128-column K relabelling, in every 128-column block and warp slice."""
    columns = torch.tensor([128 * (t % (HIDDEN // 128)) + (37 * t) % 128 for t in range(128)])
    weights, x, ids = one_hot_case(SCALE_BYTE_SETS[scale_set], len(scale_set), HIDDEN, INTERMEDIATE, columns)
    decoded = run_decode(schedule, x, torch.ones(ids.shape), ids, weights)
    assert_close_to_reference(decoded, one_hot_expected(weights, columns), "w4a16")


@pytest.mark.parametrize("precision", ["w4a16", "a4"])
@pytest.mark.parametrize("schedule", [SCHEDULES[1], SCHEDULES[5]], ids=str)
def test_one_product_per_output_is_bit_exact_with_the_reference(decode_on_cpu, schedule, precision):
    """With one product per GEMM output (``helpers.layers.one_hot_case``) every sum is exact, and the
    interpreter computes SiLU with the reference's own exp: so the kernels' epilogues (alphas,
    bf16 roundings, SwiGLU, and for A4 the quantized FC1 input, the per-16 re-quantization of
    FC1's output with each expert's gs2 and alpha2) must give the reference's bits."""
    from a4prefill.ops.scales import derive_a4_scales

    columns = torch.tensor([128 * (t % (HIDDEN // 128)) + (53 * t) % 128 for t in range(64)])
    weights, x, ids = one_hot_case(SCALE_BYTE_SETS["positive normal"], 3, HIDDEN, INTERMEDIATE, columns)
    scales = None
    if precision == "a4":  # FC2 input ranges: most blocks of expert 0 saturate, none of expert 1
        scales = derive_a4_scales(torch.full((2, 2), 1 / 2688), torch.tensor([0.05, 2000.0]))
    ones = torch.ones(ids.shape)
    decoded = run_decode(schedule, x, ones, ids, weights, a4_scales=scales)
    assert torch.equal(decoded, moe_reference(x, ones, ids, weights, scales))


def test_out_of_range_expert_ids_are_ignored(decode_on_cpu, layer):
    hidden, topk_weights, topk_ids = inputs(10, seed=3)
    bad_ids = topk_ids.clone()
    bad_ids[::3, 0] = EXPERTS
    bad_ids[1::4, 1] = -1
    dropped = bad_ids != topk_ids
    result = run_decode(SCHEDULES[3], hidden, topk_weights, bad_ids, layer.experts)
    expected = moe_reference(hidden, torch.where(dropped, 0.0, topk_weights), topk_ids, layer.experts, None)
    assert_close_to_reference(result, expected, "w4a16")


def _default_schedules() -> list[DecodeTiles]:
    """Every decode schedule ``choose_config`` picks for the GLM-5.3-Flash TP2 shape (H 4096,
    I 1024, 288 experts, top-8) from 1 to 2048 tokens."""
    found = []
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        schedule = choose_config(8 * tokens, 288, 4096, 1024).decode
        if schedule is not None and schedule not in found:
            found.append(schedule)
    return found


@pytest.mark.parametrize("hidden", [384, 640])
def test_prefetching_with_an_odd_step_count_matches_the_reference(decode_on_cpu, hidden):
    """3 and 5 K steps per warp: the prefetching loop's pairs plus its last step, no single step
    before them (the even counts of SCHEDULES take that one)."""
    tiny = make_tiny_layer(4, hidden, 384, 2, seed=8, calibration_tokens=32)
    generator = torch.Generator().manual_seed(9)
    x = (2 * torch.randn(5, hidden, generator=generator)).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(5, 4, 2, generator)
    schedule = DecodeTiles(
        DecodeGemm(1, 128, "rows", prefetch=True), DecodeGemm(1, 128, "rows", prefetch=True)
    )
    result = run_decode(schedule, x, topk_weights, topk_ids, tiny.experts)
    expected = moe_reference(x, topk_weights, topk_ids, tiny.experts, None)
    assert_close_to_reference(result, expected, "w4a16")


@pytest.mark.parametrize(
    "fc2",
    [DecodeGemm(2, 128, "k"), DecodeGemm(1, 128, "rows", stages=2), DecodeGemm(4, 256, "rows", 32)],
    ids=str,
)
def test_an_overlapping_fc2_prefetches_its_weights_and_waits_for_fc1(decode_on_cpu, fc2):
    """FC2 launched as FC1's programmatic dependent may run while FC1 does: before its wait it
    reads only what FC1 does not write (routing) and writes nothing, and its L2
    prefetches ask for exactly the 128-byte lines of code words it reads (I=512: 4 or 2 K steps
    per warp)."""
    tiny = make_tiny_layer(4, 1024, 512, 2, seed=5, calibration_tokens=32)
    generator = torch.Generator().manual_seed(7)
    hidden = (2 * torch.randn(7, 1024, generator=generator)).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(7, 4, 2, generator)
    schedule = DecodeTiles(DecodeGemm(2, 128, "rows"), fc2, overlap=True)
    result = run_decode(schedule, hidden, topk_weights, topk_ids, tiny.experts)
    kernel = decode_on_cpu["fc2_decode_kernel"]
    routing = {"sorted_route_ptr", "tile_expert_ptr", "tile_row_ptr", "seg_start_ptr", "seg_count_ptr"}
    # (W4A16 passes seg_count as the unread row flags: the same tensor, so both names show)
    assert kernel.before_wait[-1] <= {"num_tiles_ptr", "flag_ptr", *routing}, "read FC1's output early"
    read, prefetched = kernel.accessed[-1]["w_ptr"]
    assert prefetched is not None
    assert not bool((prefetched & ~read).any()), "a prefetch of a word no warp reads"
    assert torch.equal(read.view(-1, 32).any(-1), prefetched.view(-1, 32).any(-1))
    expected = moe_reference(hidden, topk_weights, topk_ids, tiny.experts, None)
    assert_close_to_reference(result, expected, "w4a16")


@pytest.mark.parametrize("schedule", _default_schedules(), ids=str)
def test_the_default_schedules_match_the_reference(decode_on_cpu, schedule):
    """At H=1024, I=512, which every default divides."""
    tiny = make_tiny_layer(4, 1024, 512, 2, seed=5, calibration_tokens=32)
    generator = torch.Generator().manual_seed(6)
    hidden = (2 * torch.randn(7, 1024, generator=generator)).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(7, 4, 2, generator)
    assert schedule.fits(1024, 512)
    result = run_decode(schedule, hidden, topk_weights, topk_ids, tiny.experts)
    expected = moe_reference(hidden, topk_weights, topk_ids, tiny.experts, None)
    assert_close_to_reference(result, expected, "w4a16")
