"""The A8 mainloop of the warp-specialized Hopper prefill GEMM (``triton.prefill_a8_kernels``,
issue 28) on the CPU: compiled for sm_90a as on an H100/H200, its TTGIR interpreted, against the
oracle of docs/numerics.md section 8 (``a4prefill.ops.fp8``).

Checked here: the conversion of every e2m1 code under every non-NaN scale byte to the e4m3
weights of ``fp8.weights``, bit for bit (one-hot activation rows pick single weights), the
exponent of blocks whose groups differ, the per-block promotion and the activation rows' scales,
the gather by token, tiles that end inside a segment, empty experts and more steps than the ring has
slots. Not checked here: the tensor cores' reduced-precision sums inside a block (the interpreter
sums exactly), speed, the ordering between warpgroups.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a4prefill.ops import fp8
from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
from a4prefill.ops.backends.triton.routing import build_routing
from a4prefill.ops.backends.triton.schedules import PREFILL_EPILOGUES, PrefillGemm
from helpers.layers import EVERY_SCALE_BYTE
from helpers.markers import needs_gluon
from helpers.sass_loops import innermost_loops

pytestmark = [pytest.mark.slow, needs_gluon]

SCHEDULE = PrefillGemm(128, 128, depth=3, register_weights=True, warp_specialized=True)
# 256-route tiles: two wgmmas of 128 routes on each step's converted weights
SCHEDULE_WIDE = dataclasses.replace(SCHEDULE, routes=256)
# the converted weights in the FP8 wgmma's A registers, the rows' columns in a8_column_order
SCHEDULE_RS = dataclasses.replace(SCHEDULE, a8_register_weights=True)
SCHEDULE_WIDE_RS = dataclasses.replace(SCHEDULE_WIDE, a8_register_weights=True)
# and each step converted in two K halves, the second while the first half's wgmmas run
SCHEDULE_RS_H2 = dataclasses.replace(SCHEDULE_RS, wgmmas_per_step=2)
SCHEDULE_WIDE_RS_H2 = dataclasses.replace(SCHEDULE_WIDE_RS, wgmmas_per_step=2)
# FC1's rows copied by token in the producer (``rows_by_token``)
SCHEDULE_RS_TOK = dataclasses.replace(SCHEDULE_RS, rows_by_token=True)
SCHEDULE_WIDE_TOK = dataclasses.replace(SCHEDULE_WIDE, rows_by_token=True)
# 256-route register weights, each step's routes as four wgmma groups of 64 into two partials
SCHEDULE_WIDE_RS_TOK_Q4 = dataclasses.replace(SCHEDULE_WIDE_RS, rows_by_token=True, a8_route_quarters=True)
E4M3_ONE = 0x38  # the e4m3 byte of 1.0


@pytest.fixture(scope="module")
def interpreted():
    """The warp-specialized kernel under the TTGIR interpreter."""
    from a4prefill.ops.backends.triton import kernel_modules
    from helpers.gluon_on_cpu import InterpretedKernel

    return InterpretedKernel(kernel_modules.prefill_ws().grouped_w4_gemm_ws_kernel)


def run_a8(kernel, x8, row_scales, codes, scales, ids, top_k, schedule=SCHEDULE):
    """One A8 launch (``epilogue="none"``) of ``schedule`` with torch-built routing whose entries
    past ``num_tiles`` hold an out-of-range expert and row: ``(out [R, N] bf16, routing)``."""
    routing = build_routing(ids, codes.shape[0], schedule.routes, force_torch=True)
    live = int(routing.num_tiles)
    routing.tile_expert[live:] = 1 << 24
    routing.tile_row[live:] = 1 << 24
    out = torch.full((ids.numel(), codes.shape[1]), float("nan"), dtype=torch.bfloat16)
    launch_prefill_gemm(
        x8, codes, scales, routing, out, schedule, top_k, kernel=kernel, x_row_scales=row_scales
    )
    return out, routing


def oracle(x8, row_scales, codes, scales, routing, top_k):
    """``(exact, magnitude)`` fp64 ``[R, N]`` per sorted position: ``fp8.block_product`` of its
    row and its expert's weights computed exactly, and the same of the absolute values."""
    experts = codes.shape[0]
    expert_of = torch.repeat_interleave(torch.arange(experts), routing.seg_count.long())
    rows = routing.sorted_route.long() // top_k if top_k else torch.arange(routing.sorted_route.numel())
    weights, exponents = fp8.weights(codes, scales.view(torch.float8_e4m3fn))
    blocks = codes.shape[2] * 2 // fp8.A8_BLOCK
    w = weights.double().unflatten(-1, (blocks, fp8.A8_BLOCK))[expert_of]  # [R, N, B, 128]
    x = x8.double().unflatten(-1, (blocks, fp8.A8_BLOCK))[rows]  # [R, B, 128]
    shift = torch.pow(2.0, exponents[expert_of].double())  # [R, N, B]
    row_scale = row_scales.double()[rows][:, None]  # [R, 1]
    exact = (torch.einsum("rbk,rnbk->rnb", x, w) * shift).sum(-1) * row_scale
    magnitude = (torch.einsum("rbk,rnbk->rnb", x.abs(), w.abs()) * shift).sum(-1) * row_scale.abs()
    return exact, magnitude


def one_hot_case():
    """``(x8, row_scales, codes, scales, ids, expected)`` of the one-hot conversion check: 128
    one-hot activation rows (code 1.0, scale 1.0) against one expert of 512 weight rows, one A8
    block: rows 0-253 take one non-NaN scale byte each for all their groups (all 16 codes, 8
    times, under every scale byte); rows 256-511 take 8 different bytes per block (the block's
    largest sets ``p``: the smaller groups' weights lose bits in e4m3's subnormals or become 0).
    ``expected [128, 512]`` fp32: sorted position ``c`` (route ``c``) times weight row ``n`` is
    ``fp8.weights``' value of column ``c`` of row ``n`` times ``2**p``."""
    n, k = 512, fp8.A8_BLOCK
    codes = (torch.arange(n * k // 2) % 256).to(torch.uint8).reshape(1, n, k // 2)
    uniform = EVERY_SCALE_BYTE[torch.arange(256) % len(EVERY_SCALE_BYTE)].repeat_interleave(8)
    mixed = EVERY_SCALE_BYTE[(torch.arange(256 * 8) * 37) % len(EVERY_SCALE_BYTE)]
    scales = torch.cat([uniform, mixed]).reshape(1, n, k // 16)
    columns = torch.arange(k)
    x8 = torch.zeros(k, k, dtype=torch.uint8)
    x8[columns, columns] = E4M3_ONE
    weights, exponents = fp8.weights(codes[0], scales[0].view(torch.float8_e4m3fn))
    expected = weights.float() * torch.pow(2.0, exponents.float())  # [N, K]
    ids = torch.zeros(k, 1, dtype=torch.int32)
    return x8.view(torch.float8_e4m3fn), torch.ones(k), codes, scales, ids, expected.T.contiguous()


@pytest.mark.parametrize(
    "schedule",
    [SCHEDULE, SCHEDULE_RS, SCHEDULE_WIDE_RS_H2, SCHEDULE_WIDE_RS_TOK_Q4],
    ids=["shared_weights", "register_weights", "wide_register_weights_halves", "wide_route_quarters"],
)
def test_every_code_and_scale_byte_converts_to_the_oracles_e4m3_weight(interpreted, schedule):
    """One-hot activation rows pick single weight columns (:func:`one_hot_case`), so every output
    is one weight times ``2**p``: each equals ``fp8.weights``' value times ``2**p`` exactly, with
    the block exponents ``p`` reduced by the consumers (shared-buffer weights) or stored by the
    producer (register weights; another valid exponent would round the small weights of a block
    differently)."""
    x8, row_scales, codes, scales, ids, expected = one_hot_case()
    out, routing = run_a8(interpreted, x8, row_scales, codes, scales, ids, None, schedule)
    assert routing.sorted_route.tolist() == list(range(ids.numel()))
    assert torch.equal(out.float(), expected), "an e4m3 weight differs from fp8.weights"
    assert (expected[:, 256:] == 0).any() and (expected[:, :256] != 0).any()  # both cases are exercised


@pytest.mark.parametrize(
    ("gather", "schedule"),
    [
        (True, SCHEDULE),
        (False, SCHEDULE),
        (True, SCHEDULE_WIDE),
        (False, SCHEDULE_WIDE),
        (True, SCHEDULE_RS),
        (False, SCHEDULE_RS),
        (True, SCHEDULE_WIDE_RS),
        (False, SCHEDULE_WIDE_RS),
        (True, SCHEDULE_RS_H2),
        (False, SCHEDULE_WIDE_RS_H2),
        (True, SCHEDULE_RS_TOK),
        (True, SCHEDULE_WIDE_TOK),
        (True, SCHEDULE_WIDE_RS_TOK_Q4),
        (False, SCHEDULE_WIDE_RS_TOK_Q4),
    ],
    ids=[
        "fc1_gather",
        "fc2_sorted",
        "fc1_gather_wide",
        "fc2_sorted_wide",
        "fc1_gather_registers",
        "fc2_sorted_registers",
        "fc1_gather_wide_registers",
        "fc2_sorted_wide_registers",
        "fc1_gather_registers_halves",
        "fc2_sorted_wide_registers_halves",
        "fc1_by_token_registers",
        "fc1_by_token_wide",
        "fc1_by_token_wide_route_quarters",
        "fc2_sorted_wide_route_quarters",
    ],
)
def test_a8_product_matches_the_block_product(interpreted, gather, schedule):
    """Three experts (one without routes), segments that end inside a tile, more steps (128-column
    blocks) than the ring has slots, rows gathered by token or in sorted order, activation rows of
    very different magnitudes (and blocks of different magnitudes within a row):
    ``bf16(acc * 128)`` is the exact block product rounded once to bf16, give or take one bf16
    step, plus ``2**-16`` of the absolute product (the promotion's fp32 roundings). Each of the
    two programs runs several work items, the ring running on across them, and the interpreter
    reads a wgmma's operands when it retires: a buffer rewritten before its wgmma retired, a
    step's factors paired with another step, or an item's route scales taken from another item's
    slot, fail. On 256-route tiles (``SCHEDULE_WIDE``) 300 tokens give each of the two experts
    with routes 300: a full tile (both halves) and a tile that ends inside its first half (its
    second half past the segment): a half's accumulator promoted or scaled with the other half's
    routes, or a second half written past the segment, fail. With the weights in registers
    (``SCHEDULE_RS``, ``SCHEDULE_WIDE_RS``) the launcher copies the rows' columns into
    ``a8_column_order``: a weight paired with another column than its activation's fails; with
    each step converted in two K halves (``SCHEDULE_RS_H2``, ``SCHEDULE_WIDE_RS_H2``) a half
    multiplied with the other half's rows, or a second half that replaced the first in the
    partial, fails. With ``rows_by_token`` (``SCHEDULE_RS_TOK``, ``SCHEDULE_WIDE_TOK``) the
    producer copies FC1's rows by token from the quantized ``[T, K]`` rows: a piece taken from
    another token, row or step fails. With the route quarters (``SCHEDULE_WIDE_RS_TOK_Q4``: four
    wgmma groups of 64 routes a step into two alternating partials, each retired while the next
    runs) a quarter promoted from the other partial, scaled with another quarter's routes or
    written to another quarter's positions fails."""
    generator = torch.Generator().manual_seed(3)
    tokens = 300 if schedule.routes == 256 else 45
    experts, n, k, top_k = 3, 256, (SCHEDULE.depth + 2) * fp8.A8_BLOCK, 2
    codes = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=generator)
    picks = torch.randint(0, len(EVERY_SCALE_BYTE), (experts, n, k // 16), generator=generator)
    scales = EVERY_SCALE_BYTE[picks]
    ids = torch.stack([torch.randperm(2, generator=generator) for _ in range(tokens)]).int()  # expert 2: none
    rows = tokens if gather else tokens * top_k
    row_spread = torch.pow(2.0, torch.randint(-20, 20, (rows, 1), generator=generator).float())
    block_spread = torch.pow(
        2.0, torch.randint(-3, 4, (rows, k // fp8.A8_BLOCK), generator=generator).float()
    )
    spread = row_spread * block_spread
    x = torch.randn(rows, k, generator=generator) * spread.repeat_interleave(fp8.A8_BLOCK, dim=1)
    x8, row_scales = fp8.quantize_rows(x.bfloat16())
    out, routing = run_a8(
        interpreted, x8, row_scales, codes, scales, ids, top_k if gather else None, schedule
    )
    if schedule.routes == 256:  # tiles full, ending in a first half, and a second tile per expert
        assert routing.seg_count[:2].tolist() == [300, 300] and int(routing.num_tiles) == 4
    exact, magnitude = oracle(x8, row_scales, codes, scales, routing, top_k if gather else None)
    assert not out.isnan().any(), "a sorted position was not written"
    step = exact.abs().clamp(min=2.0**-120).float().bfloat16().double() * 2.0**-7
    assert ((out.double() - exact).abs() <= step + magnitude * 2.0**-16 + 1e-30).all()


def test_a8_launches_refuse_what_the_kernel_cannot_run():
    """``x_row_scales`` needs the warp-specialized schedule of 128 or 256 routes with one A
    register set and 128 weight rows with one wgmma per step (the A8 mainloops have no other
    form), W4A16
    multipliers, K a multiple of 128, e4m3 rows and fp32 scales of their shape: each a
    ``ValueError``."""
    codes = torch.zeros(1, 128, 64, dtype=torch.uint8)
    scales = torch.zeros(1, 128, 8, dtype=torch.uint8)
    ids = torch.zeros(4, 1, dtype=torch.int32)
    routing = build_routing(ids, 1, 128, force_torch=True)
    out = torch.zeros(4, 128, dtype=torch.bfloat16)
    x8 = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    row_scales = torch.ones(4)
    cases = [
        (x8, row_scales, PrefillGemm(128, 128, register_weights=True)),
        (x8, row_scales, PrefillGemm(128, 64, depth=3, register_weights=True, warp_specialized=True)),
        (x8, row_scales, dataclasses.replace(SCHEDULE, wgmmas_per_step=2)),
        (x8, row_scales, dataclasses.replace(SCHEDULE, weight_rows=256, depth=4)),
        (x8, row_scales, dataclasses.replace(SCHEDULE_WIDE, a_register_sets=2)),
        (x8, row_scales, dataclasses.replace(SCHEDULE, a_register_sets=2)),  # no A8 form since 2026-12-05
        (x8, torch.ones(4, 1), SCHEDULE),  # one per block: the contract before 2026-12-05
        (x8, torch.ones(3), SCHEDULE),
        (x8, row_scales.double(), SCHEDULE),
        (x8.view(torch.uint8), row_scales, SCHEDULE),
    ]
    for rows, row, schedule in cases:
        with pytest.raises(ValueError, match=r"x_row_scales|must be torch\.float8_e4m3fn"):
            launch_prefill_gemm(rows, codes, scales, routing, out, schedule, None, x_row_scales=row)


@pytest.mark.parametrize("epilogue", ["swiglu", "alpha"])
def test_the_a8_kernels_compile_to_fp8_wgmmas_without_spills(epilogue):
    """FC1 (SwiGLU, rows gathered by token) and FC2 (alpha) in A8, compiled for sm_90a as the
    launcher would: the products are e4m3 x e4m3 wgmmas from shared memory into fp32, the weights
    reach e4m3 by ``cvt.rn.satfinite.e4m3x2.f32`` (nearest even), nothing spills to local memory."""
    from test_triton_prefill_on_cpu import compile_prefill_kernel, cuobjdump

    kernel = compile_prefill_kernel(SCHEDULE, a8=True, EPILOGUE=PREFILL_EPILOGUES[epilogue])
    ptx = kernel.asm["ptx"]
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.(\w+)\.(\w+)", ptx)) == {
        ("e4m3", "e4m3")
    }
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert re.findall(r"\b(?:STL|LDL)\b", cuobjdump(kernel, "-sass")) == []


@pytest.mark.parametrize("epilogue", ["swiglu", "alpha"])
def test_the_wide_a8_kernels_convert_once_for_two_wgmmas_and_fit_an_sm(epilogue):
    """``A8_PREFILL_WIDE`` (256-route tiles) compiled for sm_90a with its own ring depth: each
    consumer K loop converts a step's 32 weights a thread once (16 e4m3 pair conversions) for
    two FP8 wgmma groups of 128 routes (8 ``QGMMA`` of 32 columns), stores them once (4
    ``STS.128``), spills at most one value a step in the K loop, and the kernel's shared memory
    fits an H100/H200 CTA's 227 KiB. The H200's Triton 3.6 spills nothing in either kernel
    (offline, seventeenth round); this suite's Triton 3.9 reloads one value a step in each FC1
    loop and spills and reloads one in one FC2 loop (a version of the loop that scaled both halves
    by their routes after both promotions spilled hundreds a step with either compiler)."""
    from a4prefill.ops.backends.triton.schedules import A8_PREFILL_WIDE
    from test_triton_prefill_on_cpu import compile_prefill_kernel

    kernel = compile_prefill_kernel(A8_PREFILL_WIDE, a8=True, EPILOGUE=PREFILL_EPILOGUES[epilogue])
    loops = k_loops(kernel)
    assert len(loops) == 2  # the two consumer partitions
    for body in loops:
        text = " ".join(body)
        assert len(re.findall(r"\bQGMMA\.64x128x32\b", text)) == 8
        assert len(re.findall(r"\bF2FP\.SATFINITE\.E4M3", text)) == 16
        assert re.findall(r"\bSTS\S*", text) == ["STS.128"] * 4
        assert len(re.findall(r"\bSTL\b", text)) <= 1 and len(re.findall(r"\bLDL\b", text)) <= 1
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("epilogue", ["swiglu", "alpha"])
def test_a_steps_only_shared_stores_are_its_converted_weights(epilogue):
    """Each consumer K loop of the shared-buffer A8 schedule stores to shared memory only the
    step's e4m3 weights (4 ``STS.128``: 64 bytes a thread): the rows' promotion factors are
    computed from scale bytes loaded in the accumulator's row layout (``a8_codes_layout``), not
    moved there through shared memory (the first cut: an ``STS.64`` and two more warpgroup
    barriers a step)."""
    from test_triton_prefill_on_cpu import compile_prefill_kernel

    kernel = compile_prefill_kernel(SCHEDULE, a8=True, EPILOGUE=PREFILL_EPILOGUES[epilogue])
    stores = [re.findall(r"\bSTS\S*", " ".join(body)) for body in k_loops(kernel)]
    assert stores == [["STS.128"] * 4] * 2, stores


def k_loops(kernel) -> list[list[str]]:
    """The SASS of each consumer K loop of an A8 kernel compiled offline: every innermost loop
    with FP8 wgmmas (``QGMMA``)."""
    from test_triton_prefill_on_cpu import cuobjdump

    return [
        body for body in innermost_loops(cuobjdump(kernel, "-sass")) if any("QGMMA" in line for line in body)
    ]


QUANTIZER_KERNELS = ("fp8_block_amax_kernel", "quantize_fp8_rows_kernel")  # its two launches


@pytest.fixture(scope="module")
def interpreted_quantizer():
    """The A8 row quantizer's kernels under the TTGIR interpreter, by name."""
    from a4prefill.ops.backends.triton import kernel_modules
    from helpers.gluon_on_cpu import InterpretedKernel

    kernels = kernel_modules.prefill_a8()
    return {name: InterpretedKernel(getattr(kernels, name)) for name in QUANTIZER_KERNELS}


@pytest.mark.parametrize("mma_order", [False, True], ids=["k_order", "a8_column_order"])
@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 40),
    blocks=st.integers(1, 3),
    exponents=st.lists(st.integers(-140, 120), min_size=3, max_size=3),
    significands=st.binary(min_size=256, max_size=256),
    zero_block=st.booleans(),
)
def test_the_row_quantizer_is_fp8_quantize_rows_bit_for_bit(
    interpreted_quantizer, mma_order, rows, blocks, exponents, significands, zero_block
):
    """``fused_a8.quantize_rows`` (the Gluon kernel, interpreted) against ``fp8.quantize_rows``:
    the same e4m3 bytes and fp32 scales (one per row, over all its blocks), for row counts that
    end inside a program, several blocks each of its own magnitude, from bf16 subnormals (under
    the ``2**-100`` floor) to near bf16's largest, and a block of zeros (a row of zeros when it
    is the row's only block); the values' signs and bf16 significands are 128 drawn ones, each
    row reading them from its own offset. With ``mma_order`` each block's bytes sit at the positions of
    ``prefill.a8_column_order`` (what the register-weights schedules read; ``launch_prefill_gemm``
    copies other rows into it), the scales as without."""
    from a4prefill.ops.backends.triton import fused_a8
    from a4prefill.ops.backends.triton.prefill import a8_column_order

    k = blocks * fp8.A8_BLOCK
    block_magnitudes = torch.pow(2.0, torch.tensor(exponents[:blocks], dtype=torch.float64))  # one per block
    magnitudes = block_magnitudes.repeat_interleave(fp8.A8_BLOCK)
    # each drawn int16: its sign bit and 7 significand bits on a bf16 in [1, 2)
    drawn = torch.frombuffer(bytearray(significands), dtype=torch.int16)
    unit = ((drawn & -32641) | 0x3F80).view(torch.bfloat16).double()  # -32641: 0x807F as int16
    offsets = (torch.arange(rows)[:, None] * 37 + torch.arange(k)[None, :]) % unit.numel()
    x = (unit[offsets] * magnitudes).bfloat16()
    if zero_block:
        x[0, : fp8.A8_BLOCK] = 0
    with pytest.MonkeyPatch.context() as patch:
        for name, kernel in interpreted_quantizer.items():
            patch.setattr(fused_a8.kernel_modules.prefill_a8(), name, kernel)
        codes, scales = fused_a8.quantize_rows(x, mma_order)
    expected_codes, expected_scales = fp8.quantize_rows(x)
    if mma_order:
        expected_codes = expected_codes.view(torch.uint8)[:, a8_column_order(k, x.device)]
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert torch.equal(scales, expected_scales)


@pytest.fixture
def a8_moe_on_cpu(interpreted, interpreted_quantizer):
    """``fused_moe_a8`` (and the ``triton`` backend's plans) on CPU tensors as on an H200: the
    prefill GEMMs interpreted (the warp-specialized kernel, A8 or W4A16), the routing by torch
    ops, the combine by its contract (as in ``test_triton_decode_on_cpu``)."""
    from a4prefill.ops.backends.triton import (
        backend,
        fused,
        fused_a8,
        kernel_modules,
        plan,
        prefill_kernels,
        prefill_ws_kernels,
    )
    from helpers.gluon_on_cpu import InterpretedKernel, interpreted_shared_kernel
    from test_triton_decode_on_cpu import _combine_contract

    with pytest.MonkeyPatch.context() as patch:
        interpreted_shared_kernel(patch)
        patch.setattr(prefill_ws_kernels, "grouped_w4_gemm_ws_kernel", interpreted)
        for name, kernel in interpreted_quantizer.items():
            patch.setattr(kernel_modules.prefill_a8(), name, kernel)
        patch.setattr(
            prefill_kernels,
            "grouped_w4_gemm_rs_kernel",
            InterpretedKernel(prefill_kernels.grouped_w4_gemm_rs_kernel),
        )
        patch.setattr(fused_a8, "a8_device_refusal", lambda device: None)
        patch.setattr(backend, "a8_device_refusal", lambda device: None)
        patch.setattr(fused_a8, "routing_launch", functools.partial(plan.routing_launch, force_torch=True))
        patch.setattr(plan, "routing_launch", functools.partial(plan.routing_launch, force_torch=True))
        patch.setattr(plan, "prefill_kernels_run", lambda device: True)
        patch.setattr(fused_a8, "_combine", _combine_contract)
        patch.setattr(fused, "_combine", _combine_contract)
        yield


def tiny_a8_layer(tokens: int, seed: int):
    """A tiny layer whose GEMMs take A8 (H 256, I 128: multiples of 128; 4 experts, top-2) and
    ``tokens`` bf16 rows with random routing: ``(layer, hidden, topk_weights, topk_ids)``."""
    from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing

    layer = make_tiny_layer(4, 256, 128, 2, seed=seed, calibration_tokens=16)
    generator = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(tokens, 256, generator=generator)).to(torch.bfloat16)
    return (layer, hidden, *random_routing(tokens, 4, 2, generator))


@pytest.mark.parametrize(
    ("tokens", "limit", "label"),
    [
        (40, None, "a8"),
        (150, 2.5, "a8"),
        (600, 2.5, "a8_t256"),
        (150, 2.5, "a8_rs"),
        (600, 2.5, "a8_t256_rs"),
        (150, 2.5, "a8_rs_h2"),
        (600, 2.5, "a8_t256_rs_h2"),
        (150, 2.5, "a8_rs_tok"),
        (600, 2.5, "a8_t256_tok"),
    ],
)
def test_an_a8_call_matches_the_a8_reference_moe(a8_moe_on_cpu, tokens, limit, label):
    """The whole A8 MoE (quantized rows, FC1 with SwiGLU, ``h`` quantized per route, FC2, combine)
    within the bounds of ``moe_reference_a8``, clamp included, at a size of one tile per expert
    and of several, with each A8 schedule (``schedules.A8_SCHEDULES``; 600 tokens give each
    expert about 300 routes: a full 256-route tile and one ending in its first half). The
    register-weights schedules take both GEMMs' rows as the quantizer writes them for them, in
    ``a8_column_order``."""
    from a4prefill.ops.backends.triton.fused_a8 import fused_moe_a8
    from a4prefill.ops.backends.triton.schedules import A8_SCHEDULES
    from a4prefill.ops.reference import moe_reference_a8
    from helpers.layers import assert_close_to_reference

    layer, hidden, topk_weights, topk_ids = tiny_a8_layer(tokens, seed=tokens)
    result = fused_moe_a8(hidden, topk_weights, topk_ids, layer.experts, limit, schedule=A8_SCHEDULES[label])
    expected = moe_reference_a8(hidden, topk_weights, topk_ids, layer.experts, limit)
    assert_close_to_reference(result, expected, "a8")


def test_an_a8_call_without_a_schedule_runs_its_size_s_and_the_warm_up_compiles_each(
    a8_moe_on_cpu, monkeypatch
):
    """``fused_moe_a8`` without ``schedule`` runs ``choose_a8_schedule``'s: 128-route tiles with the
    weights converted into registers below ``WIDE_TILE_MIN_ROWS_PER_EXPERT`` routes per expert
    (mean), 256-route tiles from there, both with FC1's rows copied by token (both GEMMs, routing
    in the schedule's tiles); the A8 warm-up's representatives of a GLM-like layer (64 experts,
    top-8) hold every size's schedule and routing launch, the wide one first at 1280 tokens, so
    that serving compiles neither."""
    from a4prefill.ops.backends.triton import fused_a8
    from a4prefill.ops.backends.triton.routing import routing_launch
    from a4prefill.ops.backends.triton.schedules import (
        A8_PREFILL_RS_TOK,
        A8_PREFILL_WIDE_TOK,
        WIDE_TILE_MIN_ROWS_PER_EXPERT,
        choose_a8_schedule,
    )
    from a4prefill.ops.backends.triton.warmup import a8_representatives

    launched: list[object] = []
    sort_routes = fused_a8.sort_routes

    def sorted_in_tiles(ids, experts, launch):
        launched.append(launch.block_m)
        return sort_routes(ids, experts, launch)

    monkeypatch.setattr(fused_a8, "sort_routes", sorted_in_tiles)
    monkeypatch.setattr(fused_a8, "launch_prefill_gemm", lambda *args, **kwargs: launched.append(args[5]))
    wide_tokens = WIDE_TILE_MIN_ROWS_PER_EXPERT * 4 // 2  # 4 experts, top-2
    for tokens, schedule in ((wide_tokens - 1, A8_PREFILL_RS_TOK), (wide_tokens, A8_PREFILL_WIDE_TOK)):
        layer, hidden, topk_weights, topk_ids = tiny_a8_layer(tokens, seed=3)
        fused_a8.fused_moe_a8(hidden, topk_weights, topk_ids, layer.experts, None)
        assert launched == [schedule.routes, schedule, schedule]
        launched.clear()
    representatives = a8_representatives(2048, 8, 64, 4096)
    assert {schedule for schedule, _ in representatives} == {A8_PREFILL_RS_TOK, A8_PREFILL_WIDE_TOK}
    assert min(t for (s, _), t in representatives.items() if s == A8_PREFILL_WIDE_TOK) == 1280
    for tokens in range(1, 2049):
        schedule = choose_a8_schedule(tokens * 8, 64, 4096)
        assert (schedule, routing_launch(tokens * 8, schedule.routes)) in representatives


def test_a8_calls_copy_fc1_rows_by_token_unless_x_may_outgrow_int32_offsets():
    """``choose_a8_schedule`` takes the ``_tok`` forms (``rows_by_token``) wherever ``routes *
    hidden`` stays below 2**31, the bound of the launcher's int32 offsets into ``x``; from there
    the same tiles gathering their rows first, at both tile sizes, so that the default never
    meets the launcher's refusal. The warm-up's representatives follow the same switch."""
    from a4prefill.ops.backends.triton.schedules import (
        A8_PREFILL_RS,
        A8_PREFILL_RS_TOK,
        A8_PREFILL_WIDE,
        A8_PREFILL_WIDE_TOK,
        choose_a8_schedule,
    )
    from a4prefill.ops.backends.triton.warmup import a8_representatives

    hidden = 2**16
    largest_by_token = (2**31 - 1) // hidden  # 32767 routes
    for experts, small, large in (
        (1024, A8_PREFILL_RS_TOK, A8_PREFILL_RS),
        (16, A8_PREFILL_WIDE_TOK, A8_PREFILL_WIDE),
    ):
        assert choose_a8_schedule(largest_by_token, experts, hidden) == small
        assert choose_a8_schedule(largest_by_token + 1, experts, hidden) == large
    assert all(choose_a8_schedule(routes, 288, 6144).rows_by_token for routes in (8, 4096, 2**17, 2**18))
    top_k = 8
    representatives = a8_representatives(largest_by_token // top_k + 1, top_k, 16, hidden)
    assert {schedule for schedule, _ in representatives} >= {A8_PREFILL_WIDE_TOK, A8_PREFILL_WIDE}
    assert (
        min(t for (s, _), t in representatives.items() if s == A8_PREFILL_WIDE)
        == largest_by_token // top_k + 1
    )


def test_an_a8_call_refuses_a_schedule_that_is_not_an_a8_schedule():
    """``fused_moe_a8(schedule=...)`` takes only ``schedules.A8_SCHEDULES``' schedules: another
    (here the W4A16 256-row one, which the A8 mainloop cannot run) is a ``ValueError`` naming the
    argument, before anything runs."""
    from a4prefill.ops.backends.triton.fused_a8 import fused_moe_a8
    from a4prefill.ops.backends.triton.schedules import PREFILL_SCHEDULES

    layer, hidden, topk_weights, topk_ids = tiny_a8_layer(8, seed=1)
    with pytest.raises(ValueError, match="schedule must be one of"):
        fused_moe_a8(
            hidden,
            topk_weights,
            topk_ids,
            layer.experts,
            None,
            schedule=PREFILL_SCHEDULES["rs_w256_t128_d6_ws"],
        )


def test_a_split_a8_plan_runs_prefill_rows_a8_and_the_others_w4a16(a8_moe_on_cpu):
    """The ``triton`` backend under a split plan with prefill precision A8: the prefill rows
    match the A8 reference MoE, the decode and padding rows the W4A16 one (each within its own
    bounds), and they differ from each other's precision where the two references differ."""
    from a4prefill.ops.backends.triton.backend import TritonBackend
    from a4prefill.ops.precision import A8, MoECall, RowPlan
    from a4prefill.ops.reference import moe_reference, moe_reference_a8
    from a4prefill.ops.rows import RowTypes
    from helpers.layers import assert_close_to_reference

    layer, hidden, topk_weights, topk_ids = tiny_a8_layer(200, seed=9)
    row_types = RowTypes(200, decode=((0, 70),), prefill=((70, 190),), padding=((190, 200),))
    plan = RowPlan.for_rows(row_types, prefill=A8)
    call = MoECall(hidden, topk_weights, topk_ids, layer.experts, prefill_precision=A8, layer_name="layer")
    result = TritonBackend().run(call, plan)
    args = (hidden, topk_weights, topk_ids, layer.experts)
    a8, w4a16 = moe_reference_a8(*args), moe_reference(*args, None)
    prefill = torch.zeros(200, dtype=torch.bool)
    prefill[70:190] = True
    assert_close_to_reference(result[prefill], a8[prefill], "a8")
    assert_close_to_reference(result[~prefill], w4a16[~prefill], "w4a16")
    assert not torch.equal(result[prefill], w4a16[prefill].to(result.dtype))


def test_the_row_quantizer_compiles_to_ieee_divisions_and_nearest_even_e4m3():
    """What the interpreter cannot tell apart (it divides exactly whatever the division): compiled
    for sm_90a, the row quantizer's second pass divides with ``div.rn.f32`` only (no approximate
    division) and rounds to e4m3 with ``cvt.rn.satfinite.e4m3x2.f32``."""
    from a4prefill.ops.backends.triton import kernel_modules
    from helpers.gluon_on_cpu import compile_sm90

    kernel = kernel_modules.prefill_a8().quantize_fp8_rows_kernel
    pointers = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32"}
    signature = {**pointers, "ROWS": "i32", "K": "i32"}
    ptx = compile_sm90(kernel, signature, {"BR": 16, "BLOCKS": 32}, 4, {*pointers, "K"}).asm["ptx"]
    divisions = set(re.findall(r"\bdiv\.[\w.]+", ptx))
    assert divisions == {"div.rn.f32"}, divisions
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


def compiled_beside(*pairs: tuple[str, str], epilogue: str):
    """For each ``(label, baseline)`` of ``schedules.A8_SCHEDULES`` labels: ``(schedule, kernel,
    baseline kernel)``, both compiled offline for sm_90a in A8 with ``epilogue``, as the launcher
    would."""
    from a4prefill.ops.backends.triton.schedules import A8_SCHEDULES
    from test_triton_prefill_on_cpu import compile_prefill_kernel

    for label, baseline in pairs:
        compiled = [
            compile_prefill_kernel(A8_SCHEDULES[name], a8=True, EPILOGUE=PREFILL_EPILOGUES[epilogue])
            for name in (label, baseline)
        ]
        yield A8_SCHEDULES[label], *compiled


def linear_layout(layout, shape: list[int]):
    """Triton's linear layout of the Gluon distributed ``layout`` over ``shape``
    (``DistributedLinearLayout``: which tensor index each register, lane and warp bit adds)."""
    from triton._C.libtriton import gluon_ir, ir

    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    return builder.to_linear_layout(layout._to_ir(builder), shape)


def lane_indices(layout, lane: int) -> set[tuple[int, ...]]:
    """The tensor indices lane ``lane`` of warp 0 holds in ``layout`` (a linear layout): every
    sum (xor) of its register bases with the lane's own bases."""
    own = [0] * len(layout.shape)
    for bit, basis in enumerate(layout.lane_bases):
        if lane >> bit & 1:
            own = [a ^ b for a, b in zip(own, basis, strict=True)]
    indices = set()
    for registers in range(1 << len(layout.reg_bases)):
        index = list(own)
        for bit, basis in enumerate(layout.reg_bases):
            if registers >> bit & 1:
                index = [a ^ b for a, b in zip(index, basis, strict=True)]
        indices.add(tuple(index))
    return indices


def test_the_a8_column_order_gives_each_lane_the_columns_it_converts():
    """What lets the register-weights schedules skip the shared buffer: in Triton's own layout of
    the FP8 wgmma's A registers (``a8_operand_layout``, one step ``[64, 128]``, for the 128-route
    accumulators of both register-weights schedules), the K positions a lane holds carry, through
    ``prefill.a8_column_order``, exactly the columns that lane converts in ``a8_codes_layout``
    (its rows' groups, 16 columns each), for every lane of a warp, and every position of a block
    holds another column."""
    from a4prefill.ops.backends.triton import kernel_modules
    from a4prefill.ops.backends.triton.prefill import a8_column_order

    kernels = kernel_modules.prefill_a8()
    operand = linear_layout(kernels.a8_operand_layout(128, 4), [64, 128])
    codes = linear_layout(kernels.a8_codes_layout(4), [64, 8, 8])
    order = a8_column_order(fp8.A8_BLOCK, torch.device("cpu")).tolist()
    assert sorted(order) == list(range(fp8.A8_BLOCK))
    for lane in range(32):
        held = {(row, order[position]) for row, position in lane_indices(operand, lane)}
        converted = {
            (row, 16 * group + column) for row, group, _ in lane_indices(codes, lane) for column in range(16)
        }
        assert held == converted, lane


def test_the_a8_column_order_refuses_a_k_that_is_not_whole_blocks():
    """``a8_column_order(k)`` takes whole A8 blocks only: ``k`` not a multiple of 128 is a
    ``ValueError`` naming it."""
    from a4prefill.ops.backends.triton.prefill import a8_column_order

    with pytest.raises(ValueError, match="k must be a multiple of 128, got 192"):
        a8_column_order(192, torch.device("cpu"))


@pytest.mark.parametrize("epilogue", ["swiglu", "alpha"])
def test_the_register_weights_a8_kernels_take_a_from_registers_and_store_nothing(epilogue):
    """``A8_PREFILL_RS`` and ``A8_PREFILL_WIDE_RS`` compiled for sm_90a as the launcher would: every
    FP8 wgmma takes its A operand from registers, each consumer K loop stores nothing to shared
    memory and exchanges no value between lanes (no ``SHFL``: the fragment order is a renaming
    of registers, and the block exponents come from the producer, where the shared-buffer
    schedule's loop reduces them across lanes), no instruction writes a register that a wgmma
    still in flight reads as A, the K loops store nothing to local memory and reload at most 2
    values a step (Triton 3.6 and 3.9: none on 128 routes, 0-2 on 256), and the kernel needs the
    shared-buffer kernel's shared memory less the converted weights' buffers (2 x 8 KiB) plus
    the ring's block exponents (``DEPTH x 128`` int32)."""
    from test_triton_prefill_on_cpu import a_register_hazards

    pairs = (("a8_rs", "a8"), ("a8_t256_rs", "a8_t256"))
    for registers, kernel, baseline in compiled_beside(*pairs, epilogue=epilogue):
        ptx = kernel.asm["ptx"]
        wgmmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.e4m3\.e4m3 \{[^}]*\}, (\S)", ptx)
        assert wgmmas and set(wgmmas) == {"{"}, registers  # A: a register list, not a descriptor
        assert a_register_hazards(ptx) == [], registers
        loops, baseline_loops = k_loops(kernel), k_loops(baseline)
        assert len(loops) == len(baseline_loops) == 2
        for body in loops:
            text = " ".join(body)
            assert re.findall(r"\b(?:STS|SHFL|STL)\S*", text) == [], registers
            assert len(re.findall(r"\bLDL\b", text)) <= 2, registers
        converted, exponents = 2 * 64 * fp8.A8_BLOCK, registers.depth * registers.weight_rows * 4
        assert kernel.metadata.shared == baseline.metadata.shared - converted + exponents, registers


def waits_for_its_scale_load(body: list[str]) -> list[str]:
    """In a producer loop's SASS ``body`` (an innermost loop holding the scale bytes' 8-byte
    global load, ``LDG.E.64``): the instructions after that load, to the loop's back edge, that
    name one of its destination registers (each waits for the load before the loop goes round)."""
    (at,) = [i for i, line in enumerate(body) if re.search(r"\bLDG\.E\.64\b", line)]
    first = int(re.search(r"LDG\.E\.64 R(\d+),", body[at])[1])
    registers = re.compile(rf"\bR(?:{first}|{first + 1})\b")
    return [line for line in body[at + 1 :] if registers.search(line)]


def test_the_register_weights_producer_loads_a_steps_scales_a_step_ahead_without_waiting():
    """The four register-weights schedules compiled for sm_90a (FC1, Triton's own): the producer
    loop loads the next step's scale bytes (one ``LDG.E.64`` a thread: two int32 words) and
    nothing after that load in the loop names its registers, so the load is in flight through the
    step's barrier and arrival and the next wait for a free slot (``SYNCS.PHASECHK``, also in the
    loop), and first used after it. Loaded as 8 bytes, the compiled loop unpacked them right
    after the load and so waited for it every step."""
    from a4prefill.ops.backends.triton.schedules import A8_SCHEDULES
    from test_triton_prefill_on_cpu import compile_prefill_kernel, cuobjdump

    swiglu = PREFILL_EPILOGUES["swiglu"]
    for label in ("a8_rs", "a8_t256_rs", "a8_rs_h2", "a8_t256_rs_h2"):
        kernel = compile_prefill_kernel(A8_SCHEDULES[label], a8=True, EPILOGUE=swiglu)
        loops = [
            body
            for body in innermost_loops(cuobjdump(kernel, "-sass"))
            if any(re.search(r"\bLDG\.E\.64\b", line) for line in body)
        ]
        assert len(loops) == 1 and any("SYNCS.PHASECHK" in line for line in loops[0]), label
        assert waits_for_its_scale_load(loops[0]) == [], label


def second_half_after_first_issue(kernel) -> list[tuple[int, int]]:
    """Per consumer K loop of an A8 kernel compiled offline (:func:`k_loops`): the code-byte
    loads (``LDS``) and byte lookups (``PRMT``) between the loop's first FP8 wgmma and the next
    ``WARPGROUP`` instruction (the fence before the next wgmma group, or the wait for the
    first)."""
    counts = []
    for body in k_loops(kernel):
        first = next(i for i, line in enumerate(body) if "QGMMA" in line)
        fence = next(i for i, line in enumerate(body) if i > first and "WARPGROUP." in line)
        between = body[first:fence]
        counts.append(
            (
                sum(bool(re.search(r"\bLDS\b", line)) for line in between),
                sum("PRMT" in line for line in between),
            )
        )
    return counts


@pytest.mark.parametrize("epilogue", ["swiglu", "alpha"])
def test_the_two_halves_schedules_convert_the_second_half_while_the_first_runs(epilogue):
    """``A8_PREFILL_RS_H2`` and ``A8_PREFILL_WIDE_RS_H2`` compiled for sm_90a as the launcher
    would: in each consumer K loop the second half's code bytes are loaded and looked up (at least
    its 16 ``PRMT`` of 32 weights a thread) after the first half's wgmmas were issued and before
    the second half's, where the compilers would otherwise hoist the whole conversion above the
    first wgmma (the first cut, which loaded both halves' bytes at once); the one-wgmma-group
    schedules issue nothing before their conversion is done. Four FP8 wgmmas of 32 columns a
    step per 128 routes, as without halves. Local memory in the K loops: none on 128-route tiles;
    on 256-route tiles no store and at most 4 reloads a step of values the loop does not change
    (the H200's Triton 3.6: 1-2, this suite's 3.9: 1-4; the one-group wide loop 0-2: the second
    half's bytes, loaded again after the first issue, keep more registers live)."""
    pairs = (("a8_rs_h2", "a8_rs"), ("a8_t256_rs_h2", "a8_t256_rs"))
    for halves, kernel, baseline in compiled_beside(*pairs, epilogue=epilogue):
        for loads, lookups in second_half_after_first_issue(kernel):
            assert loads >= 1 and lookups >= 16, (halves, loads, lookups)
        assert second_half_after_first_issue(baseline) == [(0, 0), (0, 0)], halves
        for body, baseline_body in zip(k_loops(kernel), k_loops(baseline), strict=True):
            text, baseline_text = " ".join(body), " ".join(baseline_body)
            assert len(re.findall(r"\bQGMMA\b", text)) == len(re.findall(r"\bQGMMA\b", baseline_text))
            assert re.findall(r"\bSTL\b", text) == [], halves
            assert len(re.findall(r"\bLDL\b", text)) <= (4 if halves.routes == 256 else 0), halves


@pytest.mark.parametrize("epilogue", ["swiglu", "alpha"])
def test_the_route_quarters_promote_each_quarter_while_the_next_ones_wgmma_runs(epilogue):
    """``A8_PREFILL_WIDE_RS_TOK_Q4`` compiled for sm_90a as the launcher would: each consumer K
    loop issues 16 FP8 wgmmas of 64 routes and 32 columns a step (four quarters of four), converts
    the step's weights once (16 e4m3 pair conversions), waits three times with one wgmma group
    still in flight and once for none (ptxas keeps the two partials in flight in both consumer
    partitions, the worker's too; a wait for none before each promotion would serialize them as
    the two-halves loop does), promotes 128 accumulator elements a thread (``FFMA``), and the
    kernel fits an H100/H200 CTA's shared memory. With the GPU machines' Triton 3.6
    (``scripts/test_triton_version.sh 3.6.0``) it uses no local memory; this suite's Triton 3.9
    allocates the same loop otherwise and spills in it (26 stores and 34 loads a step, forty-eighth
    round), so the schedule is a candidate for the Triton the GPUs run and local memory is
    checked under 3.6 only."""
    import triton

    from a4prefill.ops.backends.triton.schedules import A8_SCHEDULES
    from test_triton_prefill_on_cpu import compile_prefill_kernel, cuobjdump

    fc2 = {"GATHER": False} if epilogue == "alpha" else {}
    overrides = {"EPILOGUE": PREFILL_EPILOGUES[epilogue], **fc2}
    kernel = compile_prefill_kernel(A8_SCHEDULES["a8_t256_rs_tok_q4"], a8=True, **overrides)
    loops = k_loops(kernel)
    assert len(loops) == 2  # the two consumer partitions
    for body in loops:
        text = " ".join(body)
        assert len(re.findall(r"\bQGMMA\.64x64x32\b", text)) == 16 and "QGMMA.64x128" not in text
        assert len(re.findall(r"\bF2FP\.SATFINITE\.E4M3", text)) == 16
        waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", text)
        assert waits == ["0x1", "0x1", "0x1", "0x0"], waits
        assert len(re.findall(r"\bFFMA\b", text)) == 128
    if triton.__version__.startswith("3.6."):
        assert re.findall(r"\b(?:STL|LDL)\b", cuobjdump(kernel, "-sass")) == []
    assert kernel.metadata.shared <= 227 * 1024


def test_route_quarters_need_register_weights_and_256_routes():
    """``a8_route_quarters`` names what it needs where the tile cannot run it: the shared-weights
    consumer, 128-route tiles, two wgmmas per step: each a ``ValueError``."""
    for base in (SCHEDULE_WIDE, SCHEDULE_RS, SCHEDULE_WIDE_RS_H2):
        with pytest.raises(ValueError, match="a8_route_quarters needs a8_register_weights, 256 routes"):
            dataclasses.replace(base, a8_route_quarters=True)
    assert str(SCHEDULE_WIDE_RS_TOK_Q4).endswith("_a8rs_tok_q4")


def test_register_weights_a8_schedules_run_a8_only_and_one_register_set():
    """``a8_register_weights`` needs the warp-specialized 128-row tiles of 128 or 256 routes with
    one A register set (``PrefillGemm``), and an A8 launch (``x_row_scales``); ``x_mma_order``
    in an A8 launch only with such a schedule: each a ``ValueError`` naming what it needs."""
    with pytest.raises(ValueError, match="a8_register_weights needs warp_specialized"):
        dataclasses.replace(SCHEDULE, a_register_sets=2, a8_register_weights=True)
    with pytest.raises(ValueError, match=r"x_row_scales \(A8\) needs"):  # two halves need register weights
        launch_prefill_gemm(
            torch.zeros(4, 128, dtype=torch.float8_e4m3fn),
            torch.zeros(1, 128, 64, dtype=torch.uint8),
            torch.zeros(1, 128, 8, dtype=torch.uint8),
            build_routing(torch.zeros(4, 1, dtype=torch.int32), 1, 128, force_torch=True),
            torch.zeros(4, 128, dtype=torch.bfloat16),
            dataclasses.replace(SCHEDULE, wgmmas_per_step=2),
            None,
            x_row_scales=torch.ones(4),
        )
    with pytest.raises(ValueError, match="a8_register_weights needs warp_specialized"):
        PrefillGemm(128, 128, depth=3, register_weights=True, a8_register_weights=True)
    codes = torch.zeros(1, 128, 64, dtype=torch.uint8)
    scales = torch.zeros(1, 128, 8, dtype=torch.uint8)
    ids = torch.zeros(4, 1, dtype=torch.int32)
    routing = build_routing(ids, 1, 128, force_torch=True)
    out = torch.zeros(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runs A8 calls only"):
        launch_prefill_gemm(
            torch.zeros(4, 128, dtype=torch.bfloat16), codes, scales, routing, out, SCHEDULE_RS, None
        )
    x8 = torch.zeros(4, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="x_mma_order only with a8_register_weights"):
        launch_prefill_gemm(
            x8, codes, scales, routing, out, SCHEDULE, None, x_mma_order=True, x_row_scales=torch.ones(4)
        )


@pytest.mark.parametrize(("label", "fenced"), [("a8_rs_tok", True), ("a8_t256_tok", True), ("a8_rs", False)])
def test_an_a8_fc1_whose_rows_come_by_cp_async_fences_them_before_its_wgmma(label, fenced):
    """The producer's copies by token (``rows_by_token``) write a slot's rows with ``cp.async``,
    through the generic proxy, and the FP8 wgmma reads them through the async proxy: each
    consumer step has a ``fence.proxy.async`` between the slot's wait and its first wgmma (the
    register-weights consumer its own, ``FENCE_ROWS``; the shared-weights one that of its
    converted weights). Without ``rows_by_token`` the TMA wrote them (the async proxy) and the
    register-weights consumer has no fence, as before. Compiled for sm_90a (PTX of the K loop)."""
    from a4prefill.ops.backends.triton.schedules import A8_SCHEDULES
    from test_triton_prefill_on_cpu import compile_prefill_kernel, loop_body

    kernel = compile_prefill_kernel(A8_SCHEDULES[label], a8=True, EPILOGUE=PREFILL_EPILOGUES["swiglu"])
    body = loop_body(kernel.asm["ptx"])
    wait, issue = body.find("mbarrier.try_wait"), body.find("wgmma.mma_async")
    assert 0 <= wait < issue
    fence = body.find("fence.proxy.async", wait)
    assert (wait < fence < issue) is fenced, (label, wait, fence, issue)
