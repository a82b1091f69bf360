"""The A8 prefill GEMM and A8 MoE of the ``triton`` backend on a GPU (sm_90: FP8 wgmma; issue 28):
the GEMM against the exact block product of ``fp8`` (the oracle) within the tensor cores'
reduced-precision sums inside a block, the MoE and a split A8 plan against the reference MoEs,
launched eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from a4prefill.ops import fp8
from a4prefill.ops.backends.triton.routing import build_routing
from a4prefill.ops.backends.triton.schedules import (
    A8_PREFILL,
    A8_PREFILL_RS,
    A8_PREFILL_WIDE_RS_TOK_Q4,
    A8_SCHEDULES,
)
from a4prefill.tools.numerics.layer_metrics import relative_error
from helpers.layers import EVERY_SCALE_BYTE
from helpers.markers import needs_gluon, needs_hopper

pytestmark = [
    pytest.mark.gpu,
    needs_gluon,
    needs_hopper,
]


@pytest.mark.parametrize("label", list(A8_SCHEDULES))
@pytest.mark.parametrize("gather", [True, False], ids=["fc1_gather", "fc2_sorted"])
def test_the_a8_gemm_matches_the_block_product_eagerly_and_in_a_cuda_graph(gather, label):
    """8 experts (one without routes), 512 weight rows, K = 8 blocks, rows gathered by token or
    sorted, activation rows of very different magnitudes (blocks of different magnitudes within a
    row): ``bf16(acc * 128)`` within one
    bf16 step of the exact block product plus ``2**-10`` of its absolute product (the tensor
    cores add a block's products with about 14 significant bits, DeepSeek-V3 report section
    3.3.2: measured on the H200 up to ``2**-12`` of a block's absolute product and ``2**-11.2``
    over 8 blocks, a few elements in a million; a wrong weight, scale or row is off by far
    more); the graph replay gives the same bits. Each A8 schedule (about 400 routes per expert:
    256-route tiles with both halves filled, and one ending inside a half)."""
    from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
    from test_triton_prefill_a8_on_cpu import oracle

    generator = torch.Generator().manual_seed(17)
    experts, n, k, tokens, top_k = 8, 512, 8 * fp8.A8_BLOCK, 700, 4
    codes = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=generator)
    picks = torch.randint(0, len(EVERY_SCALE_BYTE), (experts, n, k // 16), generator=generator)
    scales = EVERY_SCALE_BYTE[picks]
    ids = torch.stack([torch.randperm(experts - 1, generator=generator)[:top_k] for _ in range(tokens)]).int()
    rows = tokens if gather else tokens * top_k
    row_spread = torch.pow(2.0, torch.randint(-20, 20, (rows, 1), generator=generator).float())
    block_spread = torch.pow(
        2.0, torch.randint(-3, 4, (rows, k // fp8.A8_BLOCK), generator=generator).float()
    )
    spread = row_spread * block_spread
    x = torch.randn(rows, k, generator=generator) * spread.repeat_interleave(fp8.A8_BLOCK, dim=1)
    x8, row_scales = fp8.quantize_rows(x.bfloat16())
    cuda = [t.cuda() for t in (x8, row_scales, codes, scales, ids)]
    schedule = A8_SCHEDULES[label]
    routing = build_routing(cuda[4], experts, schedule.routes)
    out = torch.full((tokens * top_k, n), float("nan"), dtype=torch.bfloat16, device="cuda")

    def launch() -> None:
        launch_prefill_gemm(
            cuda[0],
            cuda[2],
            cuda[3],
            routing,
            out,
            schedule,
            top_k if gather else None,
            x_row_scales=cuda[1],
        )

    launch()
    cpu_routing = build_routing(ids, experts, schedule.routes, force_torch=True)
    assert torch.equal(routing.sorted_route.cpu(), cpu_routing.sorted_route)
    exact, magnitude = oracle(x8, row_scales, codes, scales, cpu_routing, top_k if gather else None)
    result = out.cpu()
    assert not result.isnan().any(), "a sorted position was not written"
    step = exact.abs().clamp(min=2.0**-120).float().bfloat16().double() * 2.0**-7
    assert ((result.double() - exact).abs() <= step + magnitude * 2.0**-10 + 1e-30).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out.cpu(), result)


@pytest.mark.parametrize("tokens", [64, 1500])
@pytest.mark.parametrize("register_weights", [False, True], ids=["shared", "registers"])
def test_the_a8_moe_and_a_split_a8_plan_match_the_references(tokens, register_weights):
    """``fused_moe_a8`` (16 experts, H 1024, I 512, top-4; a call of 16 and of 375 routes per
    expert) within the tensor cores' A8 bounds of ``moe_reference_a8`` and at most a fifth of
    A8's own error against W4A16 away from it, the same when replayed from a CUDA graph, with
    the size's schedule (``choose_a8_schedule``: FC1's rows copied by token) and the same tiles
    with the other weight placement (the form that gathers FC1's rows; with the weights in
    registers both GEMMs' rows quantized in ``a8_column_order``); the triton backend under a
    split A8 plan (its own schedule: once): prefill rows A8, decode rows W4A16."""
    import dataclasses

    from a4prefill.ops.backends.triton.backend import TritonBackend
    from a4prefill.ops.backends.triton.fused_a8 import fused_moe_a8
    from a4prefill.ops.backends.triton.schedules import choose_a8_schedule
    from a4prefill.ops.precision import A8, MoECall, RowPlan
    from a4prefill.ops.reference import moe_reference, moe_reference_a8
    from a4prefill.ops.rows import RowTypes
    from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing
    from helpers.layers import assert_close_to_reference

    experts, hidden_size, inter, top_k = 16, 1024, 512, 4
    layer = make_tiny_layer(experts, hidden_size, inter, top_k, seed=5, calibration_tokens=16)
    cuda_experts = layer.experts.to("cuda")
    generator = torch.Generator().manual_seed(tokens)
    hidden = (2 * torch.randn(tokens, hidden_size, generator=generator)).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(tokens, experts, top_k, generator)
    gpu = [t.cuda() for t in (hidden, topk_weights, topk_ids)]
    args = (hidden, topk_weights, topk_ids, layer.experts)
    a8, w4a16 = moe_reference_a8(*args, 4.0), moe_reference(*args, None, 4.0)
    chosen = choose_a8_schedule(tokens * top_k, experts, hidden_size)
    schedule = chosen
    if chosen.a8_register_weights != register_weights:  # the other placement's gathering form
        schedule = dataclasses.replace(chosen, a8_register_weights=register_weights, rows_by_token=False)
    assert schedule in A8_SCHEDULES.values()
    result = fused_moe_a8(*gpu, cuda_experts, 4.0, schedule=schedule)
    assert_close_to_reference(result, a8, "a8_tensor_cores")
    kernel_error, a8_error = relative_error(result.cpu(), a8), relative_error(a8, w4a16)
    assert kernel_error < a8_error / 5, (kernel_error, a8_error)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_moe_a8(*gpu, cuda_experts, 4.0, schedule=schedule)
    graph.replay()
    assert torch.equal(replayed, result)
    if schedule != chosen:  # the split plan runs the backend's own schedule: once per size
        return
    decode = tokens // 4
    row_types = RowTypes(tokens, decode=((0, decode),), prefill=((decode, tokens),), padding=())
    call = MoECall(*gpu, cuda_experts, None, 4.0, "layer", A8)
    split = TritonBackend().run(call, RowPlan.for_rows(row_types, prefill=A8)).cpu()
    assert_close_to_reference(split[decode:], a8[decode:], "a8_tensor_cores")
    assert_close_to_reference(split[:decode], w4a16[:decode], "w4a16")


@pytest.mark.parametrize(
    "schedule",
    [A8_PREFILL, A8_PREFILL_RS, A8_PREFILL_WIDE_RS_TOK_Q4],
    ids=["shared", "registers", "route_quarters"],
)
def test_every_code_and_scale_byte_converts_to_the_oracles_e4m3_weight_on_the_gpu(schedule):
    """The compiled kernel's weight conversion, bit for bit: the interpreter test's one-hot
    activation rows pick single weight columns, each of which must equal ``fp8.weights``' e4m3
    value times ``2**p`` exactly, for every code under every scale byte (rows 0-253) and mixed
    bytes per block (rows 256-511); the weights through a shared buffer or in the wgmma's A
    registers (the rows copied into ``a8_column_order`` by the launcher)."""
    from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
    from test_triton_prefill_a8_on_cpu import one_hot_case

    x8, row_scales, codes, scales, ids, expected = one_hot_case()
    cuda = [t.cuda() for t in (x8, row_scales, codes, scales, ids)]
    routing = build_routing(cuda[4], 1, schedule.routes)
    out = torch.full((ids.numel(), codes.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch_prefill_gemm(cuda[0], cuda[2], cuda[3], routing, out, schedule, None, x_row_scales=cuda[1])
    positions = torch.arange(ids.numel(), dtype=routing.sorted_route.dtype)
    assert torch.equal(routing.sorted_route.cpu(), positions)
    assert torch.equal(out.float().cpu(), expected)


def test_the_row_quantizer_is_fp8_quantize_rows_bit_for_bit_on_the_gpu():
    """``fused_a8.quantize_rows`` on the GPU against ``fp8.quantize_rows`` on the CPU: the same
    e4m3 bytes and fp32 scales (one per row; IEEE divisions, nearest-even e4m3), rows of blocks
    of every magnitude from bf16 subnormals to near its largest, a block of zeros and a row of
    zeros; with ``mma_order`` the same bytes at the positions of ``a8_column_order``."""
    from a4prefill.ops.backends.triton.fused_a8 import quantize_rows
    from a4prefill.ops.backends.triton.prefill import a8_column_order

    generator = torch.Generator().manual_seed(23)
    rows, k = 1000, 4 * fp8.A8_BLOCK
    exponents = torch.randint(-140, 120, (rows, k // fp8.A8_BLOCK), generator=generator).double()
    magnitudes = torch.pow(2.0, exponents).repeat_interleave(fp8.A8_BLOCK, dim=1)
    x = (torch.randn(rows, k, generator=generator, dtype=torch.float64) * magnitudes).bfloat16()
    x[3, : fp8.A8_BLOCK] = 0
    x[4] = 0
    codes, scales = quantize_rows(x.cuda())
    expected_codes, expected_scales = fp8.quantize_rows(x)
    assert torch.equal(codes.cpu().view(torch.uint8), expected_codes.view(torch.uint8))
    assert torch.equal(scales.cpu(), expected_scales)
    ordered, ordered_scales = quantize_rows(x.cuda(), mma_order=True)
    expected_ordered = expected_codes.view(torch.uint8)[:, a8_column_order(k, torch.device("cpu"))]
    assert torch.equal(ordered.cpu().view(torch.uint8), expected_ordered)
    assert torch.equal(ordered_scales.cpu(), expected_scales)
