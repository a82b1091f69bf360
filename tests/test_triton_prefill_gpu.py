"""The Hopper prefill GEMM core on a GPU (sm_90): every named schedule against the fp32 product,
FC1 (rows gathered by token) and FC2 (sorted rows) layouts, launched eagerly and replayed from a
CUDA graph (no host sync, no allocation in the launch)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from a4prefill.ops.backends.triton.routing import build_routing
from a4prefill.ops.backends.triton.schedules import PREFILL_SCHEDULES, GemmConfig
from helpers.layers import EVERY_SCALE_BYTE
from helpers.markers import needs_gluon, needs_hopper

pytestmark = [
    pytest.mark.gpu,
    needs_gluon,
    needs_hopper,
]


@pytest.mark.parametrize("label", list(PREFILL_SCHEDULES))
@pytest.mark.parametrize("gather", [True, False], ids=["fc1_gather", "fc2_sorted"])
def test_matches_the_fp32_product_eagerly_and_in_a_cuda_graph(label, gather):
    from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
    from test_triton_prefill_on_cpu import assert_rounded_product, expected

    schedule = PREFILL_SCHEDULES[label]
    generator = torch.Generator().manual_seed(11)
    # 8 K steps; with scale_sectors 24, more than their scale ring's slots (16 in each such
    # schedule), so that it is refilled within an item
    steps = 24 if schedule.scale_sectors else 8
    experts, n, k, tokens, top_k = 8, 4 * schedule.weight_rows, steps * schedule.block_k, 700, 4
    codes = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=generator)
    picks = torch.randint(0, len(EVERY_SCALE_BYTE), (experts, n, k // 16), generator=generator)
    scales = EVERY_SCALE_BYTE[picks]
    ids = torch.stack([torch.randperm(experts - 1, generator=generator)[:top_k] for _ in range(tokens)]).int()
    x = torch.randn(tokens if gather else tokens * top_k, k, generator=generator).bfloat16()
    cuda = [t.cuda() for t in (x, codes, scales, ids)]
    routing = build_routing(cuda[3], experts, schedule.routes)
    out = torch.full((tokens * top_k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch = lambda: launch_prefill_gemm(*cuda[:3], routing, out, schedule, top_k if gather else None)  # noqa: E731
    launch()
    cpu_routing = build_routing(ids, experts, schedule.routes, force_torch=True)
    product = expected(x, codes, scales, cpu_routing, top_k if gather else None)
    assert torch.equal(routing.sorted_route.cpu(), cpu_routing.sorted_route)
    assert_rounded_product(out.cpu(), product)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    out.fill_(float("nan"))
    graph.replay()
    assert_rounded_product(out.cpu(), product)


@pytest.mark.parametrize(
    ("tokens", "fc1"),
    [
        (96, "rs_w256_t32_d5_ws_c2_tok_la_ss"),
        (192, "rs_w128_t64_d6_ws_c2_tok_ss"),
        (512, "rs_w256_t128_d6_ws_tok_la_ss"),
        (1024, "rs_w128_t256_d4_ws_x2_h2_tok_ss"),
        (2048, "rs_w128_t256_d4_ws_x2_h2_tok_ss"),
    ],
)
def test_the_w4a16_prefill_moe_matches_the_reference_eagerly_and_in_a_cuda_graph(tokens, fc1):
    """``fused_moe`` on calls of 24, 48, 128, 256 and 512 routes per expert (16 experts, top-4):
    planned onto the prefill GEMMs of each size (two CTAs per SM at 24 and 48), within
    the W4A16 bounds of the fp32 reference MoE, the same when replayed from a CUDA graph."""
    from a4prefill.ops.backends.triton.fused import fused_moe
    from a4prefill.ops.backends.triton.plan import plan_call
    from a4prefill.ops.reference import moe_reference
    from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing
    from helpers.layers import assert_close_to_reference

    experts, hidden_size, inter, top_k = 16, 1024, 512, 4
    layer_experts = make_tiny_layer(experts, hidden_size, inter, top_k, seed=3, calibration_tokens=16).experts
    layer_experts = layer_experts.to("cuda")
    generator = torch.Generator().manual_seed(tokens)
    hidden = (2 * torch.randn(tokens, hidden_size, generator=generator)).to(torch.bfloat16).cuda()
    topk_weights, topk_ids = (t.cuda() for t in random_routing(tokens, experts, top_k, generator))
    plan = plan_call(tokens, top_k, experts, hidden_size, inter, torch.bfloat16, hidden.device)
    assert plan.prefill is not None and plan.prefill.fc1 == PREFILL_SCHEDULES[fc1]
    expected = moe_reference(hidden, topk_weights, topk_ids, layer_experts, None, 4.0)
    result = fused_moe(hidden, topk_weights, topk_ids, layer_experts, None, 4.0)
    assert_close_to_reference(result, expected, "w4a16")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_moe(hidden, topk_weights, topk_ids, layer_experts, None, 4.0)
    graph.replay()
    assert torch.equal(replayed, result)


@pytest.mark.parametrize(
    ("tokens", "fc1"),
    [
        (96, "rs_w256_t32_d5_ws_c2_tok_la_ss"),
        (192, "rs_w128_t64_d6_ws_c2_tok_ss"),
        (512, "rs_w256_t128_d6_ws_tok_la_ss"),
        (2048, "rs_w128_t256_d4_ws_x2_h2_tok_ss"),
    ],
)
def test_a4_and_split_prefill_moe_match_the_reference_eagerly_and_in_a_cuda_graph(tokens, fc1):
    """A4 and split calls of 24, 48, 128 and 512 routes per expert through the prefill GEMMs (the
    warp-specialized kernel on 32-route tiles of 256-row items with two CTAs per SM at 24,
    64-route tiles with two at 48, 128-route tiles of 256-row items as two partitions at 128,
    256-route tiles above; every FC1 copying its rows by token): :func:`check_a4_and_split_moe`
    on the plan's own choice (the ``scale_sectors`` forms: below 160 routes per expert since the
    forty-second round, the 256-route tiles since the forty-third)."""
    check_a4_and_split_moe(tokens, fc1, None)


@pytest.mark.parametrize(
    ("tokens", "label"),
    [
        (96, "rs_w128_t32_d6_ws_c3"),
        (512, "rs_w128_t128_d6_ws"),
        (512, "rs_w256_t128_d6_ws"),
        (512, "rs_w256_t128_d6_ws_x2_h2_tok"),
        (1024, "rs_w128_t256_d4_ws_x2_h2"),
        (192, "rs_w256_t64_d6_ws_tok"),
        (192, "rs_w256_t64_d6_ws_tok_la"),
        (192, "rs_w256_t64_d6_ws_tok_la_ss"),
        (96, "rs_w256_t32_d6_ws_c2_tok_la"),
        (192, "rs_w128_t64_d6_ws_c2_tok"),
        (512, "rs_w256_t128_d6_ws_tok_la"),
        (1024, "rs_w128_t256_d4_ws_x2_h2_tok"),
    ],
)
def test_a4_and_split_prefill_moe_on_a_schedule_not_chosen_match_the_reference(tokens, label):
    """:func:`check_a4_and_split_moe` at 24, 48, 128 and 256 routes per expert with the call's config
    naming ``label`` for both GEMMs: schedules whose A4 and split kernels no default of a
    ``rows_by_token`` size runs, the defaults of 16-32 and 64-160 routes per expert before the
    twenty-third round (128 weight rows: three CTAs per SM; 128-row items), the 64-160 default
    of A4 and split before the twenty-ninth (256-row items as one 8-warp partition), and the
    64-160 and 256-route defaults' tiles with FC1's rows gathered before the launch (the
    defaults until the twenty-fifth round; calls too large for ``rows_by_token``'s int32
    offsets still run them), the thirty-sixth round's 64-route candidates of 256-row items and
    their ``scale_sectors`` form (forty-seventh round), the 32-, 64- and 128-route defaults
    without ``scale_sectors`` (the defaults until the forty-second round; still the choice where
    ``K`` is not a multiple of 512), the 256-route tiles without it (the default until the
    forty-third)."""
    from a4prefill.ops.backends.triton.schedules import PrefillTiles, choose_config

    schedule = PREFILL_SCHEDULES[label]
    config = dataclasses.replace(
        choose_config(tokens * 4, 16, 1024, 512), decode=None, prefill=PrefillTiles(schedule, schedule)
    )
    check_a4_and_split_moe(tokens, label, config)


def test_a_call_whose_fc2_k_is_no_group_of_8_steps_runs_fc1_with_scale_sectors():
    """I 768 (FC2's K: 12 steps, no whole groups of 8) at 24 routes per expert: the plan runs FC1
    on the 32-route ``scale_sectors`` form and FC2 on the form without (forty-second round);
    :func:`check_a4_and_split_moe` on that plan."""
    from a4prefill.ops.backends.triton.plan import plan_call

    plan = plan_call(96, 4, 16, 1024, 768, torch.bfloat16, torch.device("cuda"))
    assert plan.prefill is not None
    assert plan.prefill.fc2 == PREFILL_SCHEDULES["rs_w256_t32_d6_ws_c2_tok_la"]
    check_a4_and_split_moe(96, "rs_w256_t32_d5_ws_c2_tok_la_ss", None, inter=768)


def check_a4_and_split_moe(tokens: int, fc1: str, config: GemmConfig | None, inter: int = 512) -> None:
    """``fused_moe`` of ``tokens`` tokens (16 experts, top-4, H 1024, I ``inter``) with ``config``
    (None: the plan's choice), planned onto the prefill GEMMs with ``fc1`` (a
    ``PREFILL_SCHEDULES`` label) for FC1: all-A4 within the A4 bounds of the reference A4 MoE;
    split with every third token A4, its A4 rows within those bounds and its W4A16 rows within
    the W4A16 bounds; the split call replayed from a CUDA graph gives the same output."""
    from a4prefill.ops.backends.triton.fused import fused_moe
    from a4prefill.ops.backends.triton.plan import plan_call
    from a4prefill.ops.reference import moe_reference
    from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing
    from helpers.layers import assert_close_to_reference

    experts, hidden_size, top_k = 16, 1024, 4
    layer = make_tiny_layer(experts, hidden_size, inter, top_k, seed=4, calibration_tokens=16)
    cuda_experts, cuda_scales = layer.experts.to("cuda"), layer.a4_scales.to("cuda")
    generator = torch.Generator().manual_seed(tokens + 1)
    hidden = (2 * torch.randn(tokens, hidden_size, generator=generator)).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(tokens, experts, top_k, generator)
    device = torch.device("cuda")
    plan = plan_call(tokens, top_k, experts, hidden_size, inter, torch.bfloat16, device, config)
    assert plan.prefill is not None and plan.prefill.fc1 == PREFILL_SCHEDULES[fc1]
    gpu = [t.cuda() for t in (hidden, topk_weights, topk_ids)]
    args = (hidden, topk_weights, topk_ids, layer.experts)
    a4 = moe_reference(*args, layer.a4_scales, 4.0)
    w4a16 = moe_reference(*args, None, 4.0)
    assert_close_to_reference(fused_moe(*gpu, cuda_experts, cuda_scales, 4.0, None, config), a4, "a4")
    flags = (torch.arange(tokens) % 3 == 1).to(torch.uint8).cuda()
    split = fused_moe(*gpu, cuda_experts, cuda_scales, 4.0, flags, config)
    is_a4 = flags.bool().cpu()
    assert_close_to_reference(split.cpu()[is_a4], a4[is_a4], "a4")
    assert_close_to_reference(split.cpu()[~is_a4], w4a16[~is_a4], "w4a16")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_moe(*gpu, cuda_experts, cuda_scales, 4.0, flags, config)
    graph.replay()
    assert torch.equal(replayed, split)
