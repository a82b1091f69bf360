"""The custom ops: split equals W4A16/A4 by rows, numerics of both precisions, fake impls,
opcheck, torch.compile without graph breaks, backend registry, errors for bad input."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from a4prefill import ops
from a4prefill.ops import backends, nvfp4
from a4prefill.ops.backends.reference import ReferenceBackend
from a4prefill.ops.counters import A4, W4A16
from a4prefill.ops.modelopt import QuantizedStack, dequantize_expert_stack
from a4prefill.ops.reference import swiglu
from a4prefill.tiny_layer import TinyMoEModel
from conftest import HIDDEN, make_inputs

OPS = [ops.moe_w4a16, ops.moe_a4, ops.moe_split]


def run(op, hidden, topk_weights, topk_ids, weights, name="layer", limit=None):
    return ops.call_moe(op, hidden, topk_weights, topk_ids, weights, name, limit)


def rows_of(spans):
    return torch.tensor([r for a, b in spans for r in range(a, b)], dtype=torch.long)


@given(
    lens=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    max_decode_len=st.integers(1, 3),
    padding=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_split_equals_w4a16_on_decode_rows_and_a4_on_prefill_rows(layer, lens, max_decode_len, padding, seed):
    row_types = ops.row_types_from_query_lens(lens, max_decode_len, sum(lens) + padding)
    hidden, topk_weights, topk_ids = make_inputs(row_types.num_rows, seed)
    with ops.step_row_types(row_types):
        split = run(ops.moe_split, hidden, topk_weights, topk_ids, layer.quantized)
    for spans, op in ((row_types.decode + row_types.padding, ops.moe_w4a16), (row_types.prefill, ops.moe_a4)):
        index = rows_of(sorted(spans))
        separately = run(op, hidden[index], topk_weights[index], topk_ids[index], layer.quantized)
        assert torch.equal(split[index], separately)
        whole_batch = run(op, hidden, topk_weights, topk_ids, layer.quantized)[index]
        torch.testing.assert_close(split[index], whole_batch, rtol=1e-2, atol=1e-2)


def test_split_counts_rows_per_precision(layer):
    row_types = ops.row_types_from_query_lens([1, 6, 1, 1, 4], 1)
    hidden, topk_weights, topk_ids = make_inputs(row_types.num_rows)
    with ops.step_row_types(row_types):
        run(ops.moe_split, hidden, topk_weights, topk_ids, layer.quantized, "counted")
    assert ops.ROW_COUNTERS.snapshot() == {("counted", W4A16): 3, ("counted", A4): 10}


def test_precision_matters_so_the_split_is_observable(layer):
    hidden, topk_weights, topk_ids = make_inputs(16)
    w4a16 = run(ops.moe_w4a16, hidden, topk_weights, topk_ids, layer.quantized)
    a4 = run(ops.moe_a4, hidden, topk_weights, topk_ids, layer.quantized)
    assert not torch.equal(w4a16, a4)


def test_uncalibrated_layer_runs_every_row_w4a16_with_one_warning(uncalibrated_layer, caplog):
    row_types = ops.row_types_from_query_lens([1, 8], 1)
    hidden, topk_weights, topk_ids = make_inputs(row_types.num_rows)
    expected = run(ops.moe_w4a16, hidden, topk_weights, topk_ids, uncalibrated_layer.quantized)
    with caplog.at_level(logging.WARNING), ops.step_row_types(row_types):
        for _ in range(3):
            split = run(ops.moe_split, hidden, topk_weights, topk_ids, uncalibrated_layer.quantized, "mtp.0")
    assert torch.equal(split, expected)
    assert len([r for r in caplog.records if "mtp.0" in r.message]) == 1
    assert ops.ROW_COUNTERS.total(A4) == 0
    with pytest.raises(ValueError, match="needs calibrated input scales"):
        run(ops.moe_a4, hidden, topk_weights, topk_ids, uncalibrated_layer.quantized, "mtp.0")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_any_invalid_input_scale_disables_a4_for_the_layer(layer, bad):
    w2_input_scale = layer.quantized.w2_input_scale.clone()
    w2_input_scale[2] = bad
    weights = dataclasses.replace(layer.quantized, w2_input_scale=w2_input_scale)
    row_types = ops.row_types_from_query_lens([10], 1)
    hidden, topk_weights, topk_ids = make_inputs(10)
    with ops.step_row_types(row_types):
        split = run(ops.moe_split, hidden, topk_weights, topk_ids, weights, f"bad{bad}")
    assert torch.equal(split, run(ops.moe_w4a16, hidden, topk_weights, topk_ids, weights))


def _dequantized(weights):
    w13 = dequantize_expert_stack(
        QuantizedStack(weights.w13_weight, weights.w13_weight_scale, weights.w13_weight_scale_2[:, 0])
    )
    w2 = dequantize_expert_stack(
        QuantizedStack(weights.w2_weight, weights.w2_weight_scale, weights.w2_weight_scale_2)
    )
    return w13, w2


def _route_by_route(hidden, topk_weights, topk_ids, weights, quantize_activations: bool, limit=None):
    """The MoE one route at a time, built from the public format API (dequantize with the
    global scales folded in), independent of the reference's expert loop."""
    w13, w2 = _dequantized(weights)
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
    result = run(op, hidden, topk_weights, topk_ids, layer.quantized, limit=limit).float()
    expected = _route_by_route(hidden, topk_weights, topk_ids, layer.quantized, quantize_activations, limit)
    # Only fp32 reassociation and the resulting bf16 rounding flips separate the two.
    assert float((result - expected).norm() / expected.norm()) < 1e-2


def test_swiglu_clamps_gate_from_above_and_up_on_both_sides():
    gate_up = torch.tensor([[5.0, -5.0, 5.0, -5.0]], dtype=torch.bfloat16)
    result = swiglu(gate_up, 1.0).float()
    expected = torch.tensor([F.silu(torch.tensor(1.0)) * 1.0, F.silu(torch.tensor(-5.0)) * -1.0])
    torch.testing.assert_close(result[0], expected, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("op", OPS)
def test_fake_impl_shapes_equal_real_shapes(layer, op):
    hidden, topk_weights, topk_ids = make_inputs(11)
    real = run(op, hidden, topk_weights, topk_ids, layer.quantized)
    with FakeTensorMode() as mode:
        fake_args = [
            mode.from_tensor(t) for t in (hidden, topk_weights, topk_ids, *layer.quantized.tensors())
        ]
        fake = op(*fake_args, "layer", None)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


@pytest.mark.parametrize("op", OPS)
def test_opcheck_passes(layer, op):
    """opcheck's fake-tensor, autograd-registration and AOT-dispatch checks. Its schema check
    compares inputs with ``allclose``, which torch does not implement for float8 on CPU; the
    next test checks the same promise (functional, no aliasing) bitwise."""
    hidden, topk_weights, topk_ids = make_inputs(9)
    with ops.step_row_types(ops.row_types_from_query_lens([1, 8], 1)):
        torch.library.opcheck(
            op,
            (hidden, topk_weights, topk_ids, *layer.quantized.tensors(), "layer", None),
            test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
        )


@pytest.mark.parametrize("op", OPS)
def test_ops_are_functional_they_mutate_and_alias_no_input(layer, op):
    hidden, topk_weights, topk_ids = make_inputs(9)
    inputs = (hidden, topk_weights, topk_ids, *layer.quantized.tensors())
    before = [t.clone() for t in inputs]
    with ops.step_row_types(ops.row_types_from_query_lens([1, 8], 1)):
        out = op(*inputs, "layer", None)
    for old, new in zip(before, inputs, strict=True):
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))
    assert all(out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in inputs)


@pytest.mark.parametrize("op", OPS)
def test_compiled_module_has_no_graph_breaks_and_matches_eager(layer, op):
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = TinyMoEModel([layer.quantized], op)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for tokens in (13, 29):
        hidden, _, _ = make_inputs(tokens, seed=tokens)
        with ops.step_row_types(ops.row_types_from_query_lens([1, 2, tokens - 3], 1)):
            assert torch.equal(compiled(hidden), module(hidden))
    assert not torch._dynamo.utils.counters["graph_break"]


class RecordingBackend(ReferenceBackend):
    name = "recording"

    def __init__(self):
        self.calls = []

    def run(self, hidden_states, topk_weights, topk_ids, weights, a4_scales, swiglu_limit):
        self.calls.append((hidden_states.shape[0], a4_scales is not None))
        return super().run(hidden_states, topk_weights, topk_ids, weights, a4_scales, swiglu_limit)


def test_registry_plugs_a_backend_in_without_touching_the_ops(layer, monkeypatch):
    recording = RecordingBackend()
    backends.register_backend("recording", lambda: recording, priority=100)
    try:
        hidden, topk_weights, topk_ids = make_inputs(7)
        with ops.step_row_types(ops.row_types_from_query_lens([1, 6], 1)):
            run(ops.moe_split, hidden, topk_weights, topk_ids, layer.quantized)
        assert recording.calls == [(1, False), (6, True)]
        monkeypatch.setenv(backends.BACKEND_ENV, "reference")
        assert backends.backend_for(torch.device("cpu")).name == "reference"
        monkeypatch.setenv(backends.BACKEND_ENV, "fastest")
        with pytest.raises(ValueError, match="A4PREFILL_BACKEND='fastest'"):
            backends.backend_for(torch.device("cpu"))
    finally:
        backends._factories.pop("recording")
        backends._instances.pop("recording", None)
        backends._selected.clear()


def _bad_inputs(layer):
    hidden, topk_weights, topk_ids = make_inputs(6)
    q = layer.quantized
    wide = torch.randn(6, 2 * HIDDEN, dtype=torch.bfloat16)
    return [
        ("hidden_states must be bfloat16 or float16", (hidden.float(), topk_weights, topk_ids, q)),
        ("hidden_states must be contiguous", (wide[:, ::2], topk_weights, topk_ids, q)),
        ("hidden_states must be 2-D", (hidden[None], topk_weights, topk_ids, q)),
        ("topk_ids must be int32 or int64", (hidden, topk_weights, topk_ids.float(), q)),
        (r"topk_weights must have shape \[6, 2\]", (hidden, topk_weights[:5], topk_ids, q)),
        (r"topk_ids must lie in \[0, 6\)", (hidden, topk_weights, topk_ids + 5, q)),
        (
            r"w13_weight_scale must have shape",
            (
                hidden,
                topk_weights,
                topk_ids,
                dataclasses.replace(q, w13_weight_scale=q.w13_weight_scale[:, :, :2]),
            ),
        ),
        (
            "w2_weight must be uint8",
            (hidden, topk_weights, topk_ids, dataclasses.replace(q, w2_weight=q.w2_weight.to(torch.int8))),
        ),
        (
            "w2_input_scale must be float32",
            (
                hidden,
                topk_weights,
                topk_ids,
                dataclasses.replace(q, w2_input_scale=q.w2_input_scale.double()),
            ),
        ),
        ("topk_ids is on meta", (hidden, topk_weights, topk_ids.to("meta"), q)),
    ]


@pytest.mark.parametrize("case", range(10))
@pytest.mark.parametrize("op", OPS)
def test_bad_input_gets_an_error_naming_the_argument(layer, op, case):
    message, (hidden, topk_weights, topk_ids, weights) = _bad_inputs(layer)[case]
    with pytest.raises((ValueError, TypeError), match=message):
        run(op, hidden, topk_weights, topk_ids, weights)


def test_swiglu_limit_must_be_positive(layer):
    hidden, topk_weights, topk_ids = make_inputs(4)
    with pytest.raises(ValueError, match="swiglu_limit"):
        run(ops.moe_w4a16, hidden, topk_weights, topk_ids, layer.quantized, limit=-1.0)
