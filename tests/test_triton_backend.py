"""The ``triton`` backend on a CUDA GPU: numerics against the reference, bit-exact activation
quantization, the split, no host syncs, CUDA-graph capture and replay. No speed assertions.

Tolerance (fp32 accumulation in a different order than the reference, then io-dtype rounding):
``helpers.layers.assert_close_to_reference`` with the per-precision ``helpers.layers.BOUNDS``.
"""

from __future__ import annotations

import pytest
import torch

from a4prefill import ops
from a4prefill.ops import backends, nvfp4
from a4prefill.ops.counters import A4, W4A16
from a4prefill.ops.reference import moe_reference
from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing
from helpers.layers import assert_close_to_reference, halves_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 24, 256, 128, 4


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=11, calibration_tokens=512)


@pytest.fixture(scope="module")
def gpu_layer(tiny):
    """CPU experts (for the reference), the same experts on the GPU, the GPU A4 scales."""
    return tiny.experts, tiny.experts.to("cuda"), tiny.a4_scales.to("cuda")


def inputs(tokens: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(tokens, HIDDEN, generator=generator)).to(dtype)
    topk_weights, topk_ids = random_routing(tokens, EXPERTS, TOP_K, generator)
    return hidden, topk_weights, topk_ids


def cuda(*tensors):
    return tuple(t.cuda() for t in tensors)


def reference_on_cpu(cpu_weights, hidden, topk_weights, topk_ids, a4_scales, limit=None) -> torch.Tensor:
    """The torch reference MoE on the CPU copy of the layer, W4A16 (``a4_scales`` None) or A4."""
    scales = None if a4_scales is None else a4_scales.to("cpu")
    return moe_reference(hidden, topk_weights, topk_ids, cpu_weights, scales, limit)


def triton_backend():
    return backends.get_backend("triton")


def run_uniform(routed, weights, a4_scales, limit) -> torch.Tensor:
    """The triton backend on ``(hidden, topk_weights, topk_ids)``: every row W4A16 (``a4_scales``
    None) or A4."""
    call = ops.MoECall(*routed, weights, a4_scales, limit, "test")
    return triton_backend().run_uniform(call, "w4a16" if a4_scales is None else "a4")


def test_auto_selection_on_cuda_takes_triton_unless_b12x_runs_there(monkeypatch):
    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)  # auto, whatever the user's shell says
    cuda = torch.device("cuda")
    b12x_runs = backends.get_backend("b12x").unsupported_reason(cuda) is None  # SM120/121 with b12x
    assert backends.backend_for(cuda).name == ("b12x" if b12x_runs else "triton")
    assert triton_backend().unsupported_reason(torch.device("cpu")) is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 33, 1000])
def test_activation_quantization_is_bit_exact_with_the_reference(dtype, tokens):
    from a4prefill.ops.backends.triton.quantize import quantize_rows

    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 512, generator=generator) * torch.logspace(-6, 3, 512)[torch.randperm(512)]
    x[0, :16] = 0  # a zero block
    x[-1, 16:32] = 1e4  # saturating block scales
    x = x.to(dtype)
    for gs in (0.37, 5.0, 2688.0 / 3.0):
        encode = torch.tensor([gs], dtype=torch.float32)
        codes, scales = nvfp4.quantize(x, encode)
        values, got_codes, got_scales = quantize_rows(x.cuda(), encode.cuda(), write_codes=True)
        assert torch.equal(got_codes.cpu(), codes)
        assert torch.equal(got_scales.cpu().view(torch.uint8), scales.view(torch.uint8))
        expected = nvfp4.quantize_dequantize_blocks(x, encode).to(dtype)
        assert torch.equal(values.cpu(), expected)


@pytest.mark.parametrize("routes", [8, 300, 4096, 5000, 40000, 131072])
def test_routing_kernel_equals_torch_routing(routes):
    from a4prefill.ops.backends.triton.routing import build_routing

    generator = torch.Generator().manual_seed(routes)
    ids = torch.randint(-1, EXPERTS + 1, (routes // 4, 4), generator=generator, dtype=torch.int32).cuda()
    for block_m in (16, 64):
        fast = build_routing(ids, EXPERTS, block_m)
        slow = build_routing(ids, EXPERTS, block_m, force_torch=True)
        tiles = int(slow.num_tiles)
        for name in ("sorted_route", "seg_start", "seg_count", "num_tiles"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name
        assert torch.equal(fast.tile_expert[:tiles], slow.tile_expert[:tiles])
        assert torch.equal(fast.tile_row[:tiles], slow.tile_row[:tiles])


@pytest.mark.parametrize("precision", ["w4a16", "a4"])
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 1100])
def test_matches_the_reference(gpu_layer, precision, limit, tokens):
    cpu_weights, weights, scales = gpu_layer
    hidden, topk_weights, topk_ids = inputs(tokens, seed=tokens)
    a4_scales = scales if precision == "a4" else None
    result = run_uniform(cuda(hidden, topk_weights, topk_ids), weights, a4_scales, limit)
    expected = reference_on_cpu(cpu_weights, hidden, topk_weights, topk_ids, a4_scales, limit)
    assert result.dtype == hidden.dtype and result.shape == hidden.shape
    assert_close_to_reference(result, expected, precision)


@pytest.mark.parametrize(
    ("ptx", "block_m", "split_k"),
    [(False, 16, 1), (False, 64, 1), (False, 16, 4), (True, 16, 1), (True, 64, 1), (True, 16, 2)],
)
def test_every_kernel_variant_matches_the_reference(gpu_layer, ptx, block_m, split_k):
    from a4prefill.ops.backends.triton.fused import fused_moe
    from a4prefill.ops.backends.triton.schedules import GemmConfig

    cpu_weights, weights, scales = gpu_layer
    config = GemmConfig(block_m, 32, 64, 64, 64, 4, 3, ptx, split_k)
    hidden, topk_weights, topk_ids = inputs(90, seed=block_m + split_k)
    for a4_scales, precision in ((None, "w4a16"), (scales, "a4")):
        result = fused_moe(*cuda(hidden, topk_weights, topk_ids), weights, a4_scales, None, config=config)
        expected = reference_on_cpu(cpu_weights, hidden, topk_weights, topk_ids, a4_scales)
        assert_close_to_reference(result, expected, precision)


@pytest.mark.parametrize(("block_m", "split_k"), [(16, 1), (64, 1), (16, 2)])
def test_ptx_dequantization_equals_the_triton_one_bit_for_bit(gpu_layer, block_m, split_k):
    """The PTX path forms the same exact weights (times 2**-7, undone in fp32) for the same MMAs."""
    from a4prefill.ops.backends.triton.fused import fused_moe
    from a4prefill.ops.backends.triton.schedules import GemmConfig

    _, weights, scales = gpu_layer
    hidden, topk_weights, topk_ids = cuda(*inputs(120, seed=block_m))
    for a4_scales in (None, scales):
        outputs = [
            fused_moe(
                hidden,
                topk_weights,
                topk_ids,
                weights,
                a4_scales,
                0.5,
                config=GemmConfig(block_m, 32, 64, 64, 64, 4, 3, ptx, split_k),
            )
            for ptx in (False, True)
        ]
        assert torch.equal(outputs[0], outputs[1])


def test_fp16_activations_match_the_reference(gpu_layer):
    cpu_weights, weights, scales = gpu_layer
    hidden, topk_weights, topk_ids = inputs(50, seed=1, dtype=torch.float16)
    for a4_scales in (None, scales):
        result = run_uniform(cuda(hidden, topk_weights, topk_ids), weights, a4_scales, None)
        expected = reference_on_cpu(cpu_weights, hidden, topk_weights, topk_ids, a4_scales)
        assert_close_to_reference(result, expected, "w4a16" if a4_scales is None else "a4")


def test_out_of_range_expert_ids_are_ignored(gpu_layer):
    cpu_weights, weights, _ = gpu_layer
    hidden, topk_weights, topk_ids = inputs(20, seed=3)
    bad_ids = topk_ids.clone()
    bad_ids[::3, 0] = EXPERTS
    bad_ids[1::5, 1] = -1
    dropped = bad_ids != topk_ids
    result = run_uniform(cuda(hidden, topk_weights, bad_ids), weights, None, None)
    expected = moe_reference(
        hidden, torch.where(dropped, 0.0, topk_weights), topk_ids, cpu_weights, None, None
    )
    assert_close_to_reference(result, expected, "w4a16")


@pytest.mark.parametrize("ratio", [2.0, 0.5])
@pytest.mark.parametrize("mode", ["w4a16", "a4", "split"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gate_and_up_global_scales_apply_per_half_bit_exactly(tiny, ratio, mode, split_k):
    """Per-half ``w13_weight_scale_2`` against one global scale with the ratio moved into the up
    block scales (an exact identity for power-of-two ratios): bit-identical outputs, also through
    the split-K epilogue kernel."""
    from a4prefill.ops.backends.triton.fused import fused_moe, row_flags_for
    from a4prefill.ops.backends.triton.schedules import GemmConfig

    halves, uniform = (experts.to("cuda") for experts in halves_case(tiny, ratio))
    scales = None if mode == "w4a16" else tiny.a4_scales.to("cuda")
    row_types = split_row_types()
    flags = row_flags_for(row_types, torch.device("cuda")) if mode == "split" else None
    hidden, topk_weights, topk_ids = cuda(*inputs(row_types.num_rows, seed=4))
    config = GemmConfig(16, 32, 64, 64, 64, 4, 3, True, split_k)
    per_half, uniform_out = (
        fused_moe(hidden, topk_weights, topk_ids, experts, scales, None, flags, config=config)
        for experts in (halves, uniform)
    )
    assert torch.equal(per_half, uniform_out)


def split_row_types(num_rows_padding: int = 3):
    return ops.row_types_from_query_lens([1, 1, 37, 1, 20, 1], 1, 61 + num_rows_padding)


def test_split_equals_w4a16_rows_plus_a4_rows(gpu_layer):
    _, weights, scales = gpu_layer
    row_types = split_row_types()
    hidden, topk_weights, topk_ids = cuda(*inputs(row_types.num_rows, seed=5))
    with ops.step_row_types(row_types):
        split = ops.call_moe(ops.moe_split, hidden, topk_weights, topk_ids, weights, scales, "split")
    w4a16 = ops.call_moe(ops.moe_w4a16, hidden, topk_weights, topk_ids, weights, scales, "split")
    a4 = ops.call_moe(ops.moe_a4, hidden, topk_weights, topk_ids, weights, scales, "split")
    prefill = torch.zeros(row_types.num_rows, dtype=torch.bool)
    for start, end in row_types.prefill:
        prefill[start:end] = True
    prefill = prefill.cuda()
    assert torch.equal(split[prefill], a4[prefill])
    assert torch.equal(split[~prefill], w4a16[~prefill])
    assert ops.ROW_COUNTERS.snapshot()[("split", A4)] == 57 + row_types.num_rows


@pytest.mark.parametrize("tokens", [64, 1500])
def test_split_op_issues_no_host_sync(gpu_layer, tokens):
    _, weights, scales = gpu_layer
    row_types = ops.row_types_from_query_lens([1, 2, tokens - 3], 1)
    hidden, topk_weights, topk_ids = cuda(*inputs(tokens, seed=9))
    with ops.step_row_types(row_types):
        ops.call_moe(ops.moe_split, hidden, topk_weights, topk_ids, weights, scales, "nosync")  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = ops.call_moe(ops.moe_split, hidden, topk_weights, topk_ids, weights, scales, "nosync")
            with pytest.raises(RuntimeError):
                out.sum().item()  # the debug mode is live: a real sync raises
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.float()).all()


def test_captured_split_runs_w4a16_for_every_row_and_replays_new_data(gpu_layer):
    cpu_weights, weights, scales = gpu_layer
    row_types = split_row_types()
    rows = row_types.num_rows
    static = [t.clone() for t in cuda(*inputs(rows, seed=21))]

    def step():
        with ops.step_row_types(row_types):
            return ops.call_moe(ops.moe_split, *static, weights, scales, "graph")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        # Compile the W4A16 kernels before capture (capture runs every row W4A16).
        ops.call_moe(ops.moe_w4a16, *static, weights, None, "warm-up")
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    ops.ROW_COUNTERS.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
        with pytest.raises(RuntimeError, match="while a CUDA stream is capturing"):
            ops.call_moe(ops.moe_a4, *static, weights, scales, "graph")
    assert ops.ROW_COUNTERS.snapshot() == {("graph", W4A16): rows}
    for seed in (22, 23):
        fresh = cuda(*inputs(rows, seed=seed))
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = ops.call_moe(ops.moe_w4a16, *fresh, weights, None, "eager")
        assert torch.equal(captured, eager)
        cpu = [t.cpu() for t in fresh]
        expected = moe_reference(*cpu, cpu_weights, None, None)
        assert_close_to_reference(captured, expected, "w4a16")
    assert ops.ROW_COUNTERS.total(A4) == 0
