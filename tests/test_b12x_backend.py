"""The b12x backend: weight translation, plans, selection (CPU) and its kernels (SM120/SM121 only)."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers.markers import NEEDS_B12X

pytest.importorskip("b12x.moe.fused_moe", reason=NEEDS_B12X)

from a4prefill.ops import backends, dequantize_experts, nvfp4
from a4prefill.ops.backends import b12x_plans
from a4prefill.ops.backends.b12x_moe import B12xBackend, b12x_unsupported_reason
from a4prefill.ops.backends.b12x_weights import (
    swizzle_block_scales,
    translate_weights,
    unswizzle_block_scales,
    untranslate_weights,
)
from a4prefill.ops.precision import MoECall, RowPlan
from a4prefill.ops.reference import moe_reference
from a4prefill.ops.rows import RowTypes
from a4prefill.tools.numerics.layer_metrics import relative_error
from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing
from helpers.layers import EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, halves_case, make_inputs

# (experts, hidden, intermediate, top_k): conftest's layer, make_tiny_layer's default, and the
# expert shapes of a tiny Qwen3-MoE (hidden 128-256, 8 experts, top-2).
SHAPES = [(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K), (8, 256, 128, 2), (8, 128, 64, 2), (8, 256, 64, 2)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: "E{}-H{}-I{}-k{}".format(*s))
def shaped_layer(request):
    experts, hidden, intermediate, top_k = request.param
    return make_tiny_layer(experts, hidden, intermediate, top_k, seed=5, calibration_tokens=64)


# -- weight translation --------------------------------------------------------------------------


@pytest.mark.parametrize("rows,cols", [(64, 4), (128, 8), (200, 5), (256, 16), (32, 2)])
def test_swizzle_round_trip_and_layout(rows: int, cols: int) -> None:
    generator = torch.Generator().manual_seed(rows * cols)
    raw = torch.randint(0, 0x7F, (3, rows, cols), dtype=torch.uint8, generator=generator)
    scales = raw.view(torch.float8_e4m3fn)
    swizzled = swizzle_block_scales(scales)
    rows_p, cols_p = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert swizzled.shape == (3, rows_p, cols_p) and swizzled.dtype == torch.float8_e4m3fn
    assert torch.equal(_bytes(unswizzle_block_scales(swizzled, rows, cols)), raw)
    # The documented 128x4 position: (r = 128m + 32a + b, c = 4k + j) -> [m, k, b, a, j].
    tiles = _bytes(swizzled).reshape(3, rows_p // 128, cols_p // 4, 32, 4, 4)
    for r, c in [(0, 0), (rows - 1, cols - 1), (rows // 2, cols // 2)]:
        m, rest = divmod(r, 128)
        a, b = divmod(rest, 32)
        k, j = divmod(c, 4)
        assert tiles[1, m, k, b, a, j] == raw[1, r, c]
    assert int(_bytes(swizzled).sum()) == int(raw.sum(dtype=torch.int64))  # padding is zero


def test_translation_round_trips_bit_exactly(shaped_layer) -> None:
    experts, scales = shaped_layer.experts, shaped_layer.a4_scales
    back, back_scales = untranslate_weights(translate_weights(experts, scales))
    for name, tensor in experts.named_tensors().items():
        assert torch.equal(_bytes(getattr(back, name)), _bytes(tensor)), name
    assert torch.equal(back_scales.fc1_encode_scale, scales.fc1_encode_scale)
    assert torch.equal(back_scales.fc2_encode_scales, scales.fc2_encode_scales)


@pytest.mark.parametrize("ratio", [2.0, 0.5])
def test_per_half_global_scales_are_folded_exactly(layer, ratio) -> None:
    """b12x has one FC1 global scale per expert: a power-of-two gate/up ratio goes into the block
    scales of one half, and the translated experts dequantize to exactly the per-half weights."""
    halves, uniform = halves_case(layer, ratio)
    back, _ = untranslate_weights(translate_weights(halves, None))
    assert torch.equal(dequantize_experts(back)[0], dequantize_experts(halves)[0])
    assert torch.equal(dequantize_experts(back)[0], dequantize_experts(uniform)[0])


def test_a_ratio_b12x_cannot_absorb_exactly_is_an_error(layer) -> None:
    experts = layer.experts
    scale_2 = experts.w13_weight_scale_2.clone()
    scale_2[3, 1] *= 0.7
    bad = dataclasses.replace(experts, w13_weight_scale_2=scale_2)
    with pytest.raises(ValueError, match="w13_weight_scale_2: expert 3 has gate/up global scales"):
        translate_weights(bad, None)


def test_b12x_layout_is_up_first_with_swizzled_scales(shaped_layer) -> None:
    weights = shaped_layer.experts
    experts, two_i, hidden_half = weights.w13_weight.shape
    intermediate, hidden = two_i // 2, 2 * hidden_half
    tensors = translate_weights(weights, None)
    scales = unswizzle_block_scales(tensors.w13_block_scales, two_i, hidden // 16)
    b12x_fc1 = nvfp4.dequantize_blocks(tensors.w13, scales)
    vllm_fc1 = nvfp4.dequantize_blocks(weights.w13_weight, weights.w13_weight_scale)
    assert torch.equal(b12x_fc1[:, :intermediate], vllm_fc1[:, intermediate:])  # up first
    assert torch.equal(b12x_fc1[:, intermediate:], vllm_fc1[:, :intermediate])  # then gate
    assert tensors.w13_block_scales.shape == (experts, -(-two_i // 128) * 128, -(-(hidden // 16) // 4) * 4)
    assert tensors.w2_block_scales.shape == (
        experts,
        -(-hidden // 128) * 128,
        -(-(intermediate // 16) // 4) * 4,
    )
    fc2 = nvfp4.dequantize_blocks(
        tensors.w2, unswizzle_block_scales(tensors.w2_block_scales, hidden, intermediate // 16)
    )
    assert torch.equal(fc2, nvfp4.dequantize_blocks(weights.w2_weight, weights.w2_weight_scale))


def test_scale_conventions(layer, uncalibrated_layer) -> None:
    weights = layer.quantized
    tensors = translate_weights(layer.experts, layer.a4_scales)
    assert tensors.calibrated
    assert torch.equal(tensors.w13_global_scales, weights.w13_weight_scale_2[:, 0])  # decode multiplier as-is
    assert torch.equal(tensors.w2_global_scales, weights.w2_weight_scale_2)
    shared = 1.0 / weights.w13_input_scale.max()
    assert torch.equal(tensors.input_scale, torch.full((EXPERTS,), float(shared)))  # one FC1 scale
    assert torch.equal(tensors.intermediate_scale, 1.0 / weights.w2_input_scale)  # per-expert FC2
    plain = translate_weights(uncalibrated_layer.experts, None)
    assert not plain.calibrated
    assert torch.equal(plain.input_scale, torch.ones(EXPERTS))
    assert torch.equal(plain.intermediate_scale, torch.ones(EXPERTS))


def test_translation_never_touches_the_callers_tensors(layer) -> None:
    experts = layer.experts
    before = [t.clone() for t in experts.tensors()]
    versions = [t._version for t in experts.tensors()]
    tensors = translate_weights(experts, layer.a4_scales)
    geometry = b12x_plans.check_geometry(experts.w13_weight, experts.w2_weight, TOP_K, 64)
    b12x_plans.prepare_weights(b12x_plans.plan_weights(geometry, "a4", torch.bfloat16, None), tensors)
    ours = {t.untyped_storage().data_ptr() for t in vars(tensors).values() if isinstance(t, torch.Tensor)}
    assert not ours & {t.untyped_storage().data_ptr() for t in experts.tensors()}
    for old, new, version in zip(before, experts.tensors(), versions, strict=True):
        assert torch.equal(_bytes(old), _bytes(new)) and new._version == version


# -- plans -----------------------------------------------------------------------------------------


def _geometry(shaped_layer, max_tokens: int = 256) -> b12x_plans.B12xGeometry:
    weights = shaped_layer.quantized
    return b12x_plans.check_geometry(weights.w13_weight, weights.w2_weight, shaped_layer.top_k, max_tokens)


def test_weight_plans_for_both_precisions(shaped_layer) -> None:
    geometry = _geometry(shaped_layer)
    w4a16 = b12x_plans.plan_weights(geometry, "w4a16", torch.bfloat16, None)
    a4 = b12x_plans.plan_weights(geometry, "a4", torch.bfloat16, 7.0)
    # bf16 W4A16 = b12x's mixed plan with a cutoff at the capacity, over source-native storage.
    assert w4a16._impl.quant_modes == {"nvfp4", "w4a16"}
    assert w4a16.activation.a16_max_tokens == geometry.max_tokens
    assert a4._impl.quant_modes == {"nvfp4"} and a4.activation.a16_max_tokens == 0
    for plan in (w4a16, a4):
        assert plan._impl.storage_policy.value == "keep_source"  # both plans share one copy
        assert plan._impl.w13_layout == "w13"  # up first: b12x flips nothing in place
    assert b12x_plans.shares_storage("w4a16", torch.bfloat16) and b12x_plans.shares_storage(
        "a4", torch.float16
    )
    # fp16 W4A16 is a pure A16 plan, repacked in place: it needs its own copy (2x weights).
    fp16 = b12x_plans.plan_weights(geometry, "w4a16", torch.float16, None)
    assert fp16._impl.quant_modes == {"w4a16"} and fp16._impl.storage_policy.value == "reuse_source"
    assert not b12x_plans.shares_storage("w4a16", torch.float16)


def test_a4_weights_and_execution_plan_on_cpu(shaped_layer) -> None:
    weights = shaped_layer.quantized
    geometry = _geometry(shaped_layer)
    tensors = translate_weights(shaped_layer.experts, shaped_layer.a4_scales)
    experts = b12x_plans.prepare_weights(
        b12x_plans.plan_weights(geometry, "a4", torch.bfloat16, None), tensors
    )
    assert experts._impl.w1_fp4.data_ptr() == tensors.w13.data_ptr()  # kept, not copied
    assert experts._impl.w2_fp4.data_ptr() == tensors.w2.data_ptr()
    expected_alpha = weights.w13_weight_scale_2[:, 0] / tensors.input_scale  # alpha1 = ws2 / gs1
    assert torch.allclose(experts._impl.w1_alphas, expected_alpha, rtol=0, atol=0)
    assert experts._impl.can_share_input(input_scales_static=True)  # each token quantized once
    declaration = b12x_plans.plan_execution(experts, geometry)
    assert declaration.query.num_tokens == geometry.max_tokens
    assert declaration.query.quant_mode == "nvfp4"


def test_b12x_rejects_an_fp16_token_cutoff() -> None:
    from b12x.moe import fused_moe

    with pytest.raises(ValueError, match="BF16"):
        fused_moe.plan_weights(
            source=fused_moe.PackedSource(format="modelopt_nvfp4", w13_layout="w13"),
            activation=fused_moe.ActivationSpec(
                mode="a4", nonlinearity="silu", io_dtype=torch.float16, a16_max_tokens=8
            ),
            geometry=fused_moe.MoEGeometry(num_experts=8, hidden_size=128, intermediate_size=64),
        )


def test_bad_geometry_names_the_argument(layer) -> None:
    w = layer.quantized
    with pytest.raises(ValueError, match="w13_weight: hidden size H=40"):
        b12x_plans.check_geometry(torch.zeros(4, 64, 20, dtype=torch.uint8), w.w2_weight, 2, 8)
    with pytest.raises(ValueError, match="intermediate size I"):
        b12x_plans.check_geometry(torch.zeros(4, 40, 32, dtype=torch.uint8), w.w2_weight, 2, 8)
    with pytest.raises(ValueError, match="w2_weight must be uint8"):
        b12x_plans.check_geometry(w.w13_weight, w.w2_weight[:, :-1], 2, 8)
    with pytest.raises(ValueError, match="top_k must be in"):
        b12x_plans.check_geometry(w.w13_weight, w.w2_weight, EXPERTS + 1, 8)
    with pytest.raises(ValueError, match="max_tokens must be"):
        b12x_plans.check_geometry(w.w13_weight, w.w2_weight, 2, 0)
    with pytest.raises(ValueError, match="max_tokens must be"):
        B12xBackend(max_tokens=0)
    with pytest.raises(ValueError, match="w13_weight must be uint8"):
        b12x_plans.check_geometry(w.w13_weight.float(), w.w2_weight, 2, 8)


# -- the plan invariant: calls on the W4A16 plan never exceed its A16 cutoff ----------------------


def _prepared_plan(precision: str, geometry: b12x_plans.B12xGeometry, io_dtype=torch.bfloat16):
    """A ``PreparedPlan`` whose cutoff is read from a real b12x weight plan (nothing prepared)."""
    from a4prefill.ops.backends.b12x_moe import PreparedPlan

    weight_plan = b12x_plans.plan_weights(geometry, precision, io_dtype, None)
    return PreparedPlan(precision, None, None, None, weight_plan.activation.a16_max_tokens)


def _prepared_layer(geometry, w4a16, a4, io_dtype=torch.bfloat16):
    from a4prefill.ops.backends.b12x_moe import PreparedLayer, _TensorsSeen

    return PreparedLayer(_TensorsSeen.of(()), geometry, io_dtype, w4a16, a4, None, 0)


def test_a_w4a16_plan_whose_cutoff_differs_from_the_call_size_is_refused(layer) -> None:
    """Calls are cut at the declarations' capacity; a W4A16 plan planned for another cutoff
    would run the longer calls A4 (bf16), or be no pure A16 plan (fp16)."""
    w = layer.quantized
    geometry = b12x_plans.check_geometry(w.w13_weight, w.w2_weight, TOP_K, 256)
    smaller = b12x_plans.check_geometry(w.w13_weight, w.w2_weight, TOP_K, 128)
    assert _prepared_layer(geometry, _prepared_plan("w4a16", geometry), None).call_tokens == 256
    with pytest.raises(ValueError, match="a16_max_tokens=128 but the backend cuts calls at 256 rows"):
        _prepared_layer(geometry, _prepared_plan("w4a16", smaller), None)
    with pytest.raises(ValueError, match="a16_max_tokens=0"):
        _prepared_layer(geometry, _prepared_plan("a4", geometry), None)  # an A4 plan as W4A16
    fp16 = _prepared_plan("w4a16", geometry, torch.float16)
    assert _prepared_layer(geometry, fp16, None, torch.float16).w4a16.a16_max_tokens == 0


@given(
    lengths=st.lists(st.integers(1, 700), min_size=1, max_size=8),
    kinds=st.lists(st.sampled_from(["decode", "prefill", "padding"]), min_size=8, max_size=8),
    call_tokens=st.sampled_from([1, 16, 256]),
)
def test_every_row_goes_once_to_its_plan_in_calls_within_the_cutoff(layer, lengths, kinds, call_tokens):
    """Decode and padding rows reach the W4A16 plan, prefill rows the A4 plan, each row once, in
    calls of at most ``call_tokens`` rows, which is the W4A16 plan's A16 cutoff."""
    w = layer.quantized
    geometry = b12x_plans.check_geometry(w.w13_weight, w.w2_weight, TOP_K, call_tokens)
    prepared = _prepared_layer(geometry, _prepared_plan("w4a16", geometry), _prepared_plan("a4", geometry))
    labels = [kind for length, kind in zip(lengths, kinds, strict=False) for _ in range(length)]
    rows = RowTypes.from_labels(labels)
    seen = [0] * len(labels)
    for plan, prefill, (start, end) in prepared.launches(RowPlan.for_rows(rows)):
        assert end - start <= call_tokens
        assert prefill is (plan.precision == "a4")
        if plan.precision == "w4a16":
            assert end - start <= plan.a16_max_tokens
        for row in range(start, end):
            seen[row] += 1
            assert (labels[row] == "prefill") is prefill
    assert seen == [1] * len(labels)


def test_scratch_is_one_buffer_per_device_and_stream(monkeypatch) -> None:
    """Two streams (dual-batch overlap) never share a scratch; one stream keeps its buffer,
    grown when a layer needs more."""
    from a4prefill.ops.backends import b12x_moe

    backend = B12xBackend(max_tokens=8)
    stream = {"id": 1}
    monkeypatch.setattr(b12x_moe, "_stream_id", lambda device: stream["id"])
    cpu = torch.device("cpu")
    first = backend.scratch(cpu, 100)
    assert first.numel() >= 100 and backend.scratch(cpu, 50) is first
    stream["id"] = 2
    second = backend.scratch(cpu, 100)
    assert second.data_ptr() != first.data_ptr()
    stream["id"] = 1
    grown = backend.scratch(cpu, 1000)
    assert grown.numel() >= 1000 and backend.scratch(cpu, 10) is grown
    stream["id"] = 2
    assert backend.scratch(cpu, 100) is second


def test_b12x_151_has_no_per_call_a4_flag() -> None:
    assert b12x_plans.per_call_a4_parameter() is None


# -- selection ---------------------------------------------------------------------------------------


@pytest.fixture
def b12x_registered():
    """Register the backend as the registry does (conftest's reset restores the registry)."""
    backends.register_backend("b12x", B12xBackend, priority=20)


def test_selected_exactly_where_b12x_supports_the_device(b12x_registered) -> None:
    """Holds on every machine: never on a CPU; on a CUDA device exactly when b12x's own
    ``is_supported()`` says so (SM120/SM121), with the reason shown otherwise."""
    from b12x.moe import fused_moe

    assert backends.registered_backends()[0] == "b12x"
    assert backends.backend_for(torch.device("cpu")).name != "b12x"
    reason = B12xBackend().unsupported_reason(torch.device("cpu"))
    assert reason is not None and "SM120" in reason
    cuda = torch.device("cuda", 0)
    supported = torch.cuda.is_available() and bool(fused_moe.is_supported(cuda))
    cuda_reason = b12x_unsupported_reason(cuda)
    if supported:
        assert cuda_reason is None and backends.backend_for(cuda).name == "b12x"
    else:
        assert cuda_reason is not None and (
            "is_supported() is False" in cuda_reason or "SM120" in cuda_reason
        )


# -- SM120/SM121 ---------------------------------------------------------------------------------------

ON_SM120 = torch.cuda.is_available() and b12x_unsupported_reason(torch.device("cuda")) is None
sm120 = pytest.mark.skipif(not ON_SM120, reason="needs an SM120/SM121 GPU (b12x kernels)")
# b12x quantizes A4 activations with its own quantizer and sums routes its own way; relative
# Frobenius error against the reference of the same precision must stay below these.
W4A16_TOLERANCE = 2e-2
A4_TOLERANCE = 6e-2


def _gpu_case(tokens: int, seed: int = 0):
    layer = make_tiny_layer(8, 256, 128, 2, seed=7, calibration_tokens=256)
    generator = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(tokens, 256, generator=generator)).to(torch.bfloat16).cuda()
    topk_weights, topk_ids = random_routing(tokens, 8, 2, generator)
    return layer.experts.to("cuda"), hidden, topk_weights.cuda(), topk_ids.cuda(), layer.a4_scales.to("cuda")


@pytest.mark.sm120
@sm120
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_sm120_w4a16_and_a4_match_the_reference(tokens: int) -> None:
    weights, hidden, topk_weights, topk_ids, scales = _gpu_case(tokens)
    backend = B12xBackend(max_tokens=512)
    call = MoECall(hidden, topk_weights, topk_ids, weights, scales)
    w4a16 = backend.run_uniform(call, "w4a16")
    a4 = backend.run_uniform(call, "a4")
    ref16 = moe_reference(hidden, topk_weights, topk_ids, weights, None)
    ref4 = moe_reference(hidden, topk_weights, topk_ids, weights, scales)
    assert relative_error(w4a16, ref16) < W4A16_TOLERANCE
    assert relative_error(a4, ref4) < A4_TOLERANCE
    # A short call still runs A4 when asked: it is closer to the A4 reference than to W4A16's.
    assert relative_error(a4, ref4) < relative_error(a4, ref16)


@pytest.mark.sm120
@sm120
def test_sm120_split_runs_each_row_in_its_precision() -> None:
    weights, hidden, topk_weights, topk_ids, scales = _gpu_case(40, seed=1)
    labels = ["decode"] * 4 + ["prefill"] * 3 + ["decode"] * 2 + ["prefill"] * 29 + ["padding"] * 2
    rows = RowTypes.from_labels(labels)
    backend = B12xBackend(max_tokens=16)  # the long prefill span is cut into calls of 16
    out = backend.run(MoECall(hidden, topk_weights, topk_ids, weights, scales), RowPlan.for_rows(rows))
    ref16 = moe_reference(hidden, topk_weights, topk_ids, weights, None)
    ref4 = moe_reference(hidden, topk_weights, topk_ids, weights, scales)
    for start, end in rows.decode + rows.padding:
        assert relative_error(out[start:end], ref16[start:end]) < W4A16_TOLERANCE
    for start, end in rows.prefill:
        assert relative_error(out[start:end], ref4[start:end]) < A4_TOLERANCE


@pytest.mark.sm120
@sm120
def test_sm120_a_layer_below_b12xs_w4a16_tiles_is_refused(layer) -> None:
    """The conftest layer (H=64, I=32) is below b12x 1.5.1's W4A16 tile sizes: preparing it
    fails with b12x's reason (seen when compiling offline: tests/test_b12x_compile.py)."""
    hidden, topk_weights, topk_ids = make_inputs(33)
    backend = B12xBackend(max_tokens=64)
    args = (hidden.cuda(), topk_weights.cuda(), topk_ids.cuda(), layer.experts.to("cuda"))
    with pytest.raises(ValueError, match="no valid W4A16 tile config"):
        backend.run_uniform(MoECall(*args), "w4a16")


# -- which b12x: PyPI's or FlashInfer's embedded copy ----------------------------------------------


def test_the_installed_b12x_is_recognised_as_pypis() -> None:
    import b12x

    from a4prefill.ops.backends.b12x_source import PYPI, b12x_source

    source = b12x_source()
    assert source.kind == PYPI and source.location == str(Path(b12x.__file__).parent)
    assert "PyPI b12x" in source.describe()


@pytest.mark.parametrize(
    ("file", "path", "kind"),
    [
        # FlashInfer >= 0.7.2: sys.modules["b12x"] is flashinfer/experimental/b12x/_api.py
        ("/sp/flashinfer/experimental/b12x/_api.py", ["/sp/flashinfer/experimental/b12x"], "flashinfer"),
        ("/sp/b12x/__init__.py", ["/sp/b12x"], "pypi"),
        ("/home/u/src/b12x/b12x/__init__.py", ["/home/u/src/b12x/b12x"], "pypi"),  # a checkout
    ],
)
def test_flashinfers_embedded_b12x_is_told_apart(file, path, kind) -> None:
    from a4prefill.ops.backends.b12x_source import b12x_source

    module = types.ModuleType("b12x")
    module.__file__ = file
    module.__path__ = path
    assert b12x_source(module).kind == kind


@pytest.mark.parametrize("value", ["abc", "0", "-5", "8k"])
def test_a_bad_call_capacity_names_the_variable_or_the_argument(monkeypatch, value) -> None:
    from a4prefill.ops.backends.b12x_moe import MAX_TOKENS_ENV

    monkeypatch.setenv(MAX_TOKENS_ENV, value)
    with pytest.raises(ValueError, match=f"{MAX_TOKENS_ENV} must be a positive integer, got"):
        B12xBackend()
    with pytest.raises(ValueError, match="max_tokens must be a positive integer, got 0"):
        B12xBackend(max_tokens=0)
    monkeypatch.setenv(MAX_TOKENS_ENV, "96")
    assert B12xBackend().max_tokens == 96
