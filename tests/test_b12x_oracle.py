"""An independent oracle for the b12x path, on the CPU: b12x 1.5.1's own torch references
(``b12x.moe._shared.kernels.reference``) run on the package's translation of vLLM's tensors.

- Against the same arithmetic derived from vLLM's ModelOpt tensors (``b12x_conventions``): equal
  bit for bit, for W4A16 and A4, per-half global scales folded, with a swiglu clamp. A wrong half
  order, swizzle, scale fold, alpha or encode scale shows here, before any SM120 kernel runs.
- Against the package's reference (the contract): within the distance that b12x's fewer bf16
  roundings account for (docs/numerics.md, section 7), measured here.
- A layer that mixes decode, padding and prefill rows, each span sent to the plan the backend
  picks for it (``PreparedLayer.launches``, real b12x weight plans): every row gets the reference
  of its precision.

b12x's references loop over routes in Python (about a millisecond each): tiny shapes only.
"""

from __future__ import annotations

import pytest
import torch

from helpers.markers import NEEDS_B12X

pytest.importorskip("b12x.moe.fused_moe", reason=NEEDS_B12X)

from a4prefill.ops.backends import b12x_plans
from a4prefill.ops.backends.b12x_moe import PreparedLayer, PreparedPlan, _TensorsSeen
from a4prefill.ops.backends.b12x_weights import to_packed_weights, translate_weights
from a4prefill.ops.precision import RowPlan
from a4prefill.ops.reference import moe_reference
from a4prefill.ops.rows import RowTypes
from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing
from helpers.b12x_conventions import b12x_reference_from_modelopt
from helpers.layers import halves_case

# b12x 1.5.1's evaluation orders of the activation quantizer (its kernels: micro, dynamic with and
# without fast math; the older orders its own callers still use)
QUANT_MODES = ("micro", "dynamic_precise", "dynamic_fast", "direct_division", "reciprocal_multiply")
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 256, 128, 2
# relative Frobenius distance of b12x's references from the package's, per precision: measured
# 4.3e-3 (W4A16: b12x's reference rounds nothing) and 2.4e-2 - 3.3e-2 (A4: b12x rounds once,
# after SwiGLU; the package also after gate/up, after silu and per route)
CONTRACT_DISTANCE = {"w4a16": 1e-2, "a4": 5e-2}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def layer():
    return make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=5, calibration_tokens=256)


def inputs(tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(tokens, EXPERTS, TOP_K, generator)
    return hidden, topk_weights, topk_ids


def b12x_reference(hidden, topk_weights, topk_ids, experts, a4_scales, swiglu_limit=None, mode="micro"):
    """b12x's own reference on the package's translation: for A4 with the alphas and encode
    scales b12x's ``prepare_weights`` derives (an A4 plan prepares on the CPU), for W4A16 with
    the global scales as b12x's W4A16 kernels take them."""
    from b12x.moe._shared.kernels import reference

    tensors = translate_weights(experts, a4_scales)
    packed = to_packed_weights(tensors)
    common = (topk_ids, topk_weights, EXPERTS, HIDDEN, INTERMEDIATE)
    if a4_scales is None:
        return reference.moe_reference_w4a16_f32(
            hidden, packed.w13, packed.w13_block_scales, packed.w13_global_scales,
            packed.w2, packed.w2_block_scales, packed.w2_global_scales, *common,
            swiglu_limit=swiglu_limit,
        )  # fmt: skip
    geometry = b12x_plans.check_geometry(experts.w13_weight, experts.w2_weight, TOP_K, 64)
    plan = b12x_plans.plan_weights(geometry, "a4", torch.bfloat16, swiglu_limit)
    prepared = b12x_plans.prepare_weights(plan, tensors)._impl
    return reference.moe_reference_nvfp4(
        hidden, packed.w13, packed.w13_block_scales, prepared.w1_alphas,
        packed.w2, packed.w2_block_scales, prepared.w2_alphas, prepared.a1_gscale, prepared.a2_gscale,
        *common, swiglu_limit=swiglu_limit, quant_scale_math=mode,
    )  # fmt: skip


@pytest.mark.parametrize("mode", QUANT_MODES)
def test_b12x_a4_reference_on_the_translation_is_b12x_arithmetic_on_vllms_tensors(layer, mode):
    hidden, topk_weights, topk_ids = inputs(24, seed=1)
    ours = b12x_reference_from_modelopt(hidden, topk_weights, topk_ids, layer.experts, layer.a4_scales)
    theirs = b12x_reference(hidden, topk_weights, topk_ids, layer.experts, layer.a4_scales, mode=mode)
    assert torch.equal(theirs, ours)


@pytest.mark.parametrize("ratio", [2.0, 0.5])
@pytest.mark.parametrize("precision", ["w4a16", "a4"])
def test_per_half_global_scales_reach_b12x_exactly(layer, ratio, precision):
    """Gate and up global scales a factor of two apart: b12x's one FC1 alpha per expert with the
    ratio folded into one half's block scales gives the per-half arithmetic bit for bit."""
    halves, _ = halves_case(layer, ratio)
    scales = layer.a4_scales if precision == "a4" else None
    hidden, topk_weights, topk_ids = inputs(16, seed=2)
    ours = b12x_reference_from_modelopt(hidden, topk_weights, topk_ids, halves, scales)
    assert torch.equal(b12x_reference(hidden, topk_weights, topk_ids, halves, scales), ours)


@pytest.mark.parametrize("precision", ["w4a16", "a4"])
def test_the_swiglu_clamp_reaches_b12x(layer, precision):
    scales = layer.a4_scales if precision == "a4" else None
    hidden, topk_weights, topk_ids = inputs(16, seed=3)
    clamped = b12x_reference(hidden, topk_weights, topk_ids, layer.experts, scales, swiglu_limit=0.25)
    ours = b12x_reference_from_modelopt(hidden, topk_weights, topk_ids, layer.experts, scales, 0.25)
    assert torch.equal(clamped, ours)
    assert not torch.equal(clamped, b12x_reference(hidden, topk_weights, topk_ids, layer.experts, scales))


@pytest.mark.parametrize("precision", ["w4a16", "a4"])
def test_b12x_references_stay_within_the_documented_distance_of_the_contract(layer, precision):
    """Not equal: b12x's references round fewer times than the package's contract. The distance
    stays below ``CONTRACT_DISTANCE`` and well below the distance between the precisions."""
    scales = layer.a4_scales if precision == "a4" else None
    hidden, topk_weights, topk_ids = inputs(32, seed=4)
    contract = moe_reference(hidden, topk_weights, topk_ids, layer.experts, scales)
    theirs = b12x_reference(hidden, topk_weights, topk_ids, layer.experts, scales)
    other = moe_reference(hidden, topk_weights, topk_ids, layer.experts, None if scales else layer.a4_scales)
    distance = relative(theirs, contract)
    print(f"b12x {precision} reference vs the package's: relative {distance:.2e}")
    assert distance < CONTRACT_DISTANCE[precision]
    assert distance < relative(other, contract) / 4


def _plan(precision: str, geometry: b12x_plans.B12xGeometry) -> PreparedPlan:
    weight_plan = b12x_plans.plan_weights(geometry, precision, torch.bfloat16, None)
    return PreparedPlan(precision, None, None, None, weight_plan.activation.a16_max_tokens)


def test_a_step_of_decode_padding_and_prefill_rows_through_both_plans(layer):
    """Each span goes to the plan the backend picks (calls of at most 8 rows); run by b12x's
    reference of that plan's precision, every row equals b12x arithmetic of its own precision:
    decode and padding rows W4A16, prefill rows A4, whatever span they were cut into."""
    labels = ["decode"] * 3 + ["prefill"] * 11 + ["decode"] * 2 + ["prefill"] * 5 + ["padding"] * 3
    rows = RowTypes.from_labels(labels)
    hidden, topk_weights, topk_ids = inputs(len(labels), seed=6)
    experts, scales = layer.experts, layer.a4_scales
    geometry = b12x_plans.check_geometry(experts.w13_weight, experts.w2_weight, TOP_K, 8)
    prepared = PreparedLayer(
        _TensorsSeen.of(()),
        geometry,
        torch.bfloat16,
        _plan("w4a16", geometry),
        _plan("a4", geometry),
        None,
        0,
    )
    output = torch.zeros(len(labels), HIDDEN)
    calls = []
    for plan, prefill, (start, end) in prepared.launches(RowPlan.for_rows(rows)):
        span = (hidden[start:end], topk_weights[start:end], topk_ids[start:end], experts)
        output[start:end] = b12x_reference(*span, scales if prefill else None).float()
        calls.append((plan.precision, end - start))
    # decode 3, decode 2, padding 3; prefill 11 cut into 8 + 3, then 5
    assert calls == [("w4a16", 3), ("w4a16", 2), ("w4a16", 3), ("a4", 8), ("a4", 3), ("a4", 5)]
    w4a16 = b12x_reference_from_modelopt(hidden, topk_weights, topk_ids, experts, None)
    a4 = b12x_reference_from_modelopt(hidden, topk_weights, topk_ids, experts, scales).float()
    for row, label in enumerate(labels):
        expected = a4[row] if label == "prefill" else w4a16[row]
        assert torch.equal(output[row], expected), (row, label)
    assert not torch.equal(a4, w4a16)


def test_the_oracle_tells_a_wrong_half_order_and_an_unswizzled_scale_apart(layer):
    """The same comparison with the translation's two layout steps undone fails loudly: this
    check would have caught either mistake."""
    from b12x.moe._shared.kernels import reference

    from a4prefill.ops.backends.b12x_weights import unswizzle_block_scales

    hidden, topk_weights, topk_ids = inputs(8, seed=7)
    expected = b12x_reference_from_modelopt(hidden, topk_weights, topk_ids, layer.experts, None)
    packed = to_packed_weights(translate_weights(layer.experts, None))
    gate_first = torch.cat([packed.w13[:, INTERMEDIATE:], packed.w13[:, :INTERMEDIATE]], dim=1)
    plain = torch.zeros_like(packed.w13_block_scales)
    rows, cols = 2 * INTERMEDIATE, HIDDEN // 16
    plain[:, :rows, :cols] = unswizzle_block_scales(packed.w13_block_scales, rows, cols)
    common = (packed.w2, packed.w2_block_scales, packed.w2_global_scales, topk_ids, topk_weights)
    sizes = (EXPERTS, HIDDEN, INTERMEDIATE)
    for w13, scales in ((gate_first, packed.w13_block_scales), (packed.w13, plain)):
        wrong = reference.moe_reference_w4a16_f32(
            hidden, w13, scales, packed.w13_global_scales, *common, *sizes
        )
        assert relative(wrong, expected) > 0.1
    good = reference.moe_reference_w4a16_f32(
        hidden, packed.w13, packed.w13_block_scales, packed.w13_global_scales, *common, *sizes
    )
    assert torch.equal(good, expected)
