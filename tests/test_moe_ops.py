"""The custom ops: split equals W4A16/A4 by rows, A4 scales as data, per-half gate/up scales,
numerics of both precisions, fake impls, opcheck, torch.compile without graph breaks, backend
registry, errors for bad input."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from a4prefill import ops
from a4prefill.ops import backends, moe, nvfp4
from a4prefill.ops.backends.b12x_moe import B12xBackend
from a4prefill.ops.backends.reference import ReferenceBackend
from a4prefill.ops.backends.triton.backend import TritonBackend
from a4prefill.ops.counters import A4, W4A16
from a4prefill.ops.precision import RowPlan
from a4prefill.ops.reference import moe_reference, swiglu
from a4prefill.ops.rows import RowTypes
from a4prefill.tools.tiny_layer import TinyMoEModel
from helpers.layers import halves_case, make_inputs, moe_inputs, rows_of

OPS = [ops.moe_w4a16, ops.moe_a4, ops.moe_split]


def run(op, hidden, topk_weights, topk_ids, layer, name="layer", limit=None, scales="layer"):
    """Call ``op`` on a TinyMoELayer with its own A4 scales (or ``scales`` given explicitly)."""
    a4_scales = layer.a4_scales if scales == "layer" else scales
    return ops.call_moe(op, hidden, topk_weights, topk_ids, layer.experts, a4_scales, name, limit)


@given(
    lens=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    max_decode_len=st.integers(1, 3),
    padding=st.integers(0, 3),
    data=st.data(),
)
def test_split_equals_w4a16_on_decode_rows_and_a4_on_prefill_rows(layer, lens, max_decode_len, padding, data):
    row_types = ops.row_types_from_query_lens(lens, max_decode_len, sum(lens) + padding)
    hidden, topk_weights, topk_ids = data.draw(moe_inputs(row_types.num_rows))
    with ops.step_row_types(row_types):
        split = run(ops.moe_split, hidden, topk_weights, topk_ids, layer)
    for spans, op in ((row_types.decode + row_types.padding, ops.moe_w4a16), (row_types.prefill, ops.moe_a4)):
        index = rows_of(sorted(spans))
        separately = run(op, hidden[index], topk_weights[index], topk_ids[index], layer)
        assert torch.equal(split[index], separately)


def test_split_counts_rows_per_precision(layer):
    row_types = ops.row_types_from_query_lens([1, 6, 1, 1, 4], 1)
    hidden, topk_weights, topk_ids = make_inputs(row_types.num_rows)
    with ops.step_row_types(row_types):
        run(ops.moe_split, hidden, topk_weights, topk_ids, layer, "counted")
    assert ops.ROW_COUNTERS.snapshot() == {("counted", W4A16): 3, ("counted", A4): 10}


def test_precision_matters_so_the_split_is_observable(layer):
    hidden, topk_weights, topk_ids = make_inputs(16)
    w4a16 = run(ops.moe_w4a16, hidden, topk_weights, topk_ids, layer)
    a4 = run(ops.moe_a4, hidden, topk_weights, topk_ids, layer)
    assert not torch.equal(w4a16, a4)


# -- A4 scales are data: absent = W4A16 only -------------------------------------------------------


def test_schema_carries_a4_scales_as_optional_tensors_and_no_input_scales():
    for op in OPS:
        arguments = {a.name: a for a in op._schema.arguments}
        assert "w13_input_scale" not in arguments and "w2_input_scale" not in arguments
        for name in ("a4_fc1_encode_scale", "a4_fc2_encode_scales"):
            assert str(arguments[name].type) == "Optional[Tensor]" and arguments[name].default_value is None


def test_split_without_a4_scales_runs_every_row_w4a16(layer):
    """The op decides nothing: the calibrated layer's prefill rows run W4A16 when no scales are
    passed, even though its input scales are valid (they are not op arguments any more)."""
    row_types = ops.row_types_from_query_lens([1, 8], 1)
    hidden, topk_weights, topk_ids = make_inputs(row_types.num_rows)
    expected = run(ops.moe_w4a16, hidden, topk_weights, topk_ids, layer, scales=None)
    with ops.step_row_types(row_types):
        split = run(ops.moe_split, hidden, topk_weights, topk_ids, layer, "no-scales", scales=None)
    assert torch.equal(split, expected)
    assert ops.ROW_COUNTERS.snapshot()[("no-scales", W4A16)] == 9
    assert ops.ROW_COUNTERS.total(A4) == 0


def test_the_scales_passed_are_the_scales_used(layer):
    """A4 rows follow the encode scales given to the op, not anything cached per layer name."""
    hidden, topk_weights, topk_ids = make_inputs(12)
    own = layer.a4_scales
    doubled = ops.A4Scales(own.fc1_encode_scale * 2, own.fc2_encode_scales * 2)
    first = run(ops.moe_a4, hidden, topk_weights, topk_ids, layer, "same-name", scales=own)
    second = run(ops.moe_a4, hidden, topk_weights, topk_ids, layer, "same-name", scales=doubled)
    assert torch.equal(first, moe_reference(hidden, topk_weights, topk_ids, layer.experts, own))
    assert torch.equal(second, moe_reference(hidden, topk_weights, topk_ids, layer.experts, doubled))
    assert not torch.equal(first, second)


def test_moe_a4_without_scales_is_an_error(uncalibrated_layer):
    hidden, topk_weights, topk_ids = make_inputs(4)
    assert uncalibrated_layer.a4_scales is None
    with pytest.raises(ValueError, match=r"moe_a4 on layer 'mtp.0' needs A4 scales \(a4_fc1_encode_scale"):
        run(ops.moe_a4, hidden, topk_weights, topk_ids, uncalibrated_layer, "mtp.0")


def test_one_scale_without_the_other_is_an_error(layer):
    hidden, topk_weights, topk_ids = make_inputs(4)
    with pytest.raises(ValueError, match="given together or not at all; got only a4_fc2_encode_scales"):
        ops.moe_split(
            hidden,
            topk_weights,
            topk_ids,
            *layer.experts.tensors(),
            "layer",
            a4_fc2_encode_scales=layer.a4_scales.fc2_encode_scales,
        )


def test_moe_a4_while_a_stream_captures_is_an_error(layer, monkeypatch):
    """CPU stand-in for capture (the GPU test captures for real): the op's own guard raises."""
    monkeypatch.setattr(moe, "is_capturing", lambda tensor: True)
    hidden, topk_weights, topk_ids = make_inputs(4)
    with pytest.raises(RuntimeError, match="while a CUDA stream is capturing"):
        run(ops.moe_a4, hidden, topk_weights, topk_ids, layer)
    with ops.step_row_types(ops.row_types_from_query_lens([4], 1)):  # the split op stays W4A16
        split = run(ops.moe_split, hidden, topk_weights, topk_ids, layer, "captured")
    assert torch.equal(split, run(ops.moe_w4a16, hidden, topk_weights, topk_ids, layer))
    assert ops.ROW_COUNTERS.total(A4) == 0


# -- gate and up global scales apply per half ---------------------------------------------------------


@pytest.mark.parametrize("ratio", [2.0, 0.5])
@pytest.mark.parametrize("precision", ["w4a16", "a4"])
def test_gate_and_up_global_scales_apply_per_half_bit_exactly(layer, ratio, precision):
    halves, uniform = halves_case(layer, ratio)
    hidden, topk_weights, topk_ids = make_inputs(20, seed=5)
    scales = layer.a4_scales if precision == "a4" else None
    op = ops.moe_a4 if precision == "a4" else ops.moe_w4a16
    per_half = ops.call_moe(op, hidden, topk_weights, topk_ids, halves, scales, "halves")
    expected = ops.call_moe(op, hidden, topk_weights, topk_ids, uniform, scales, "uniform")
    assert torch.equal(per_half, expected)
    w13_halves, w2_halves = ops.dequantize_experts(halves)
    w13_uniform, w2_uniform = ops.dequantize_experts(uniform)
    assert torch.equal(w13_halves, w13_uniform) and torch.equal(w2_halves, w2_uniform)


# -- numerics -------------------------------------------------------------------------------------------


def _route_by_route(hidden, topk_weights, topk_ids, layer, quantize_activations: bool, limit=None):
    """The MoE one route at a time, built from the public format API (dequantize with the
    global scales folded in), independent of the reference's expert loop."""
    w13, w2 = ops.dequantize_experts(layer.experts)
    weights = layer.quantized
    gs1 = 1 / weights.w13_input_scale.max()
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        x = hidden[t : t + 1]
        if quantize_activations:
            x = nvfp4.dequantize(*nvfp4.quantize(x, gs1), gs1)
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = (x.float() @ w13[e].T).to(torch.bfloat16)
            h = swiglu(gate_up, limit)
            if quantize_activations:
                gs2 = 1 / weights.w2_input_scale[e]
                h = nvfp4.dequantize(*nvfp4.quantize(h, gs2), gs2)
            out[t] += topk_weights[t, j] * (h.float() @ w2[e].T).to(torch.bfloat16).float()[0]
    return out


@pytest.mark.parametrize(("op", "quantize_activations"), [(ops.moe_w4a16, False), (ops.moe_a4, True)])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_both_precisions_follow_the_numerics_contract(layer, op, quantize_activations, limit):
    hidden, topk_weights, topk_ids = make_inputs(12, seed=7)
    result = run(op, hidden, topk_weights, topk_ids, layer, limit=limit).float()
    expected = _route_by_route(hidden, topk_weights, topk_ids, layer, quantize_activations, limit)
    # Only fp32 reassociation and the resulting bf16 rounding flips separate the two.
    assert float((result - expected).norm() / expected.norm()) < 1e-2


def test_swiglu_clamps_gate_from_above_and_up_on_both_sides():
    gate_up = torch.tensor([[5.0, -5.0, 5.0, -5.0]], dtype=torch.bfloat16)
    result = swiglu(gate_up, 1.0).float()
    expected = torch.tensor([F.silu(torch.tensor(1.0)) * 1.0, F.silu(torch.tensor(-5.0)) * -1.0])
    torch.testing.assert_close(result[0], expected, rtol=1e-2, atol=1e-3)


# -- torch.library contract -----------------------------------------------------------------------------


def _op_args(layer, hidden, topk_weights, topk_ids):
    scales = layer.a4_scales
    return (
        (hidden, topk_weights, topk_ids, *layer.experts.tensors(), "layer"),
        {"a4_fc1_encode_scale": scales.fc1_encode_scale, "a4_fc2_encode_scales": scales.fc2_encode_scales},
    )


@pytest.mark.parametrize("op", OPS)
def test_fake_impl_shapes_equal_real_shapes(layer, op):
    hidden, topk_weights, topk_ids = make_inputs(11)
    real = run(op, hidden, topk_weights, topk_ids, layer)
    args, kwargs = _op_args(layer, hidden, topk_weights, topk_ids)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(*fake_args, **{k: mode.from_tensor(v) for k, v in kwargs.items()})
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


@pytest.mark.parametrize("op", OPS)
def test_opcheck_passes(layer, op):
    """opcheck's fake-tensor, autograd-registration and AOT-dispatch checks. Its schema check
    compares inputs with ``allclose``, which torch does not implement for float8 on CPU; the
    next test checks the same promise (functional, no aliasing) bitwise."""
    hidden, topk_weights, topk_ids = make_inputs(9)
    args, kwargs = _op_args(layer, hidden, topk_weights, topk_ids)
    with ops.step_row_types(ops.row_types_from_query_lens([1, 8], 1)):
        torch.library.opcheck(
            op,
            args,
            kwargs,
            test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
        )


@pytest.mark.parametrize("op", OPS)
def test_ops_are_functional_they_mutate_and_alias_no_input(layer, op):
    hidden, topk_weights, topk_ids = make_inputs(9)
    args, kwargs = _op_args(layer, hidden, topk_weights, topk_ids)
    inputs = [a for a in args if isinstance(a, torch.Tensor)] + list(kwargs.values())
    before = [t.clone() for t in inputs]
    with ops.step_row_types(ops.row_types_from_query_lens([1, 8], 1)):
        out = op(*args, **kwargs)
    for old, new in zip(before, inputs, strict=True):
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))
    assert all(out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in inputs)


@pytest.mark.parametrize("op", OPS)
def test_compiled_module_has_no_graph_breaks_and_matches_eager(layer, op):
    torch._dynamo.reset()
    module = TinyMoEModel([layer.quantized], op)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for tokens in (13, 29):
        hidden, _, _ = make_inputs(tokens, seed=tokens)
        with ops.step_row_types(ops.row_types_from_query_lens([1, 2, tokens - 3], 1)):
            assert torch.equal(compiled(hidden), module(hidden))
    assert not torch._dynamo.utils.counters["graph_break"]


# -- backend registry -----------------------------------------------------------------------------------


class RecordingBackend(ReferenceBackend):
    name = "recording"

    def __init__(self):
        self.calls = []

    def run_uniform(self, call, precision):
        self.calls.append((call.num_rows, precision == "a4"))
        return super().run_uniform(call, precision)


def test_registry_plugs_a_backend_in_without_touching_the_ops(layer, monkeypatch):
    """(conftest's reset of the process state takes the registration back)"""
    recording = RecordingBackend()
    backends.register_backend("recording", lambda: recording, priority=100)
    hidden, topk_weights, topk_ids = make_inputs(7)
    with ops.step_row_types(ops.row_types_from_query_lens([1, 6], 1)):
        run(ops.moe_split, hidden, topk_weights, topk_ids, layer)
    assert recording.calls == [(1, False), (6, True)]
    monkeypatch.setenv(backends.BACKEND_ENV, "reference")
    assert backends.backend_for(torch.device("cpu")).name == "reference"
    monkeypatch.setenv(backends.BACKEND_ENV, "fastest")
    with pytest.raises(ValueError, match="A4PREFILL_BACKEND='fastest'"):
        backends.backend_for(torch.device("cpu"))


# -- expert parallelism --------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [ops.moe_w4a16, ops.moe_a4])
@given(remote=st.lists(st.booleans(), min_size=14, max_size=14))
def test_routes_to_another_ranks_experts_contribute_nothing(layer, op, remote):
    """Expert parallelism: id -1 marks a route whose expert another rank holds. The output is the
    one where that route's weight is zero, bit for bit (A4 quantizes per token, not per route)."""
    hidden, topk_weights, topk_ids = make_inputs(7)
    elsewhere = torch.tensor(remote).reshape(7, 2)
    local_only = run(op, hidden, torch.where(elsewhere, 0.0, topk_weights), topk_ids, layer)
    marked = run(op, hidden, topk_weights, torch.where(elsewhere, -1, topk_ids), layer)
    assert torch.equal(marked, local_only)
    if elsewhere.any() and not elsewhere.all():
        assert not torch.equal(marked, run(op, hidden, topk_weights, topk_ids, layer))


@pytest.mark.parametrize("op", [ops.moe_a4, ops.moe_split])
@pytest.mark.parametrize(
    ("which", "bad"),
    [
        ("fc1", math.nan),
        ("fc1", 0.0),
        ("fc1", -2.0),
        ("fc2", math.inf),
        ("fc2", 0.0),
        ("fc1", 2.0**110),
        ("fc2", 2.0**-110),
    ],
)
def test_hand_made_encode_scales_must_be_finite_positive_and_in_range(layer, op, which, bad):
    """Issue 27: the ops took a zero, negative or non-finite encode scale and returned zeros or
    NaNs; on the CPU they now refuse it, naming the argument. Twenty-ninth round: also finite
    ones outside ``[2**-100, 2**100]``, where the kernels' per-block multipliers overflow."""
    hidden, topk_weights, topk_ids = make_inputs(4)
    fc1 = layer.a4_scales.fc1_encode_scale.clone()
    fc2 = layer.a4_scales.fc2_encode_scales.clone()
    (fc1 if which == "fc1" else fc2)[0] = bad
    name = "a4_fc1_encode_scale" if which == "fc1" else "a4_fc2_encode_scales"
    rows = ops.row_types_from_query_lens([4], 1)  # one prefill request: every row A4
    with (
        ops.step_row_types(rows),
        pytest.raises(ValueError, match=rf"{name} must lie within \[2\*\*-100, 2\*\*100\]"),
    ):
        run(op, hidden, topk_weights, topk_ids, layer, scales=ops.A4Scales(fc1, fc2))


# -- bad input -----------------------------------------------------------------------------------------


# (the error message expected, what the case does to good inputs (hidden, weights, ids, experts,
# scales) of 6 tokens, top-2, over the 6 experts of ``layer``)
BAD_INPUTS = [
    ("hidden_states must be bfloat16 or float16", lambda h, w, i, q, s: (h.float(), w, i, q, s)),
    (
        "hidden_states must be contiguous",
        lambda h, w, i, q, s: (torch.cat([h, h], dim=1)[:, ::2], w, i, q, s),
    ),
    ("hidden_states must be 2-D", lambda h, w, i, q, s: (h[None], w, i, q, s)),
    ("topk_ids must be int32 or int64", lambda h, w, i, q, s: (h, w, i.float(), q, s)),
    (r"topk_weights must have shape \[6, 2\]", lambda h, w, i, q, s: (h, w[:5], i, q, s)),
    (
        "topk_weights has top_k=1 columns but topk_ids has top_k=2",
        lambda h, w, i, q, s: (h, w[:, :1].contiguous(), i, q, s),
    ),
    (r"topk_ids must lie in \[0, 6\)", lambda h, w, i, q, s: (h, w, i + 5, q, s)),
    (r"or be -1 for a route whose expert another", lambda h, w, i, q, s: (h, w, i - 3, q, s)),
    (
        r"w13_weight_scale must have shape",
        lambda h, w, i, q, s: (
            h,
            w,
            i,
            dataclasses.replace(q, w13_weight_scale=q.w13_weight_scale[:, :, :2]),
            s,
        ),
    ),
    (
        "w2_weight must be uint8",
        lambda h, w, i, q, s: (h, w, i, dataclasses.replace(q, w2_weight=q.w2_weight.to(torch.int8)), s),
    ),
    (
        r"a4_fc2_encode_scales must have shape \[6\]",
        lambda h, w, i, q, s: (h, w, i, q, ops.A4Scales(s.fc1_encode_scale, s.fc2_encode_scales[:3])),
    ),
    (
        "a4_fc1_encode_scale must be float32",
        lambda h, w, i, q, s: (h, w, i, q, ops.A4Scales(s.fc1_encode_scale.double(), s.fc2_encode_scales)),
    ),
    ("topk_ids is on meta", lambda h, w, i, q, s: (h, w, i.to("meta"), q, s)),
]


@pytest.mark.parametrize(("message", "make_bad"), BAD_INPUTS, ids=[message for message, _ in BAD_INPUTS])
@pytest.mark.parametrize("op", OPS)
def test_bad_input_gets_an_error_naming_the_argument(layer, op, message, make_bad):
    hidden, topk_weights, topk_ids = make_inputs(6)
    bad = make_bad(hidden, topk_weights, topk_ids, layer.experts, layer.a4_scales)
    with pytest.raises((ValueError, TypeError), match=message):
        ops.call_moe(op, *bad, "layer")


def test_swiglu_limit_must_be_positive(layer):
    hidden, topk_weights, topk_ids = make_inputs(4)
    with pytest.raises(ValueError, match="swiglu_limit"):
        run(ops.moe_w4a16, hidden, topk_weights, topk_ids, layer, limit=-1.0)


@pytest.mark.parametrize(
    "backend",
    [ReferenceBackend(), TritonBackend(), B12xBackend()],
    ids=lambda backend: backend.name,
)
@pytest.mark.parametrize(
    "labels", [["prefill"] * 6, ["decode", "prefill", "prefill", "decode", "prefill", "padding"]]
)
def test_a4_rows_of_a_call_without_a4_scales_are_refused_by_every_backend(layer, backend, labels):
    """A plan with A4 rows on a call that carries no A4 scales is refused before anything runs:
    no backend quietly runs those rows W4A16 (``MoEBackend.check_plan``)."""
    hidden, topk_weights, topk_ids = make_inputs(6)
    call = ops.MoECall(hidden, topk_weights, topk_ids, layer.experts, None, None, "layers.3")
    plan = RowPlan.for_rows(RowTypes.from_labels(labels))
    assert plan.rows(A4) > 0
    with pytest.raises(
        ValueError, match=r"layer 'layers\.3': the plan has A4 rows but the call no a4_scales"
    ):
        backend.run(call, plan)
