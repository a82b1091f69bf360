"""A8 prefill rows through the custom ops (issue 28): the ``prefill_precision`` argument, the split
equal to W4A16 on decode rows and to the A8 oracle (``moe_reference_a8``) on prefill rows, the
row counters' A8 slot, the capture guard, errors, backends without an A8 kernel, torch.compile.
Mirrors the A4 tests of ``test_moe_ops.py`` on a layer of A8 sizes (H = I = 128)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from a4prefill import ops
from a4prefill.ops import backends, moe
from a4prefill.ops.backends.b12x_moe import B12xBackend
from a4prefill.ops.backends.reference import ReferenceBackend
from a4prefill.ops.backends.triton.backend import TritonBackend
from a4prefill.ops.counters import A4, A8, W4A16
from a4prefill.ops.precision import RowPlan
from a4prefill.ops.reference import moe_reference, moe_reference_a8
from a4prefill.tools.tiny_layer import TinyMoEModel
from helpers.layers import A8_HIDDEN, make_inputs, moe_inputs, rows_of


def run_a8(op, hidden, topk_weights, topk_ids, layer, name="layer", limit=None):
    """Call ``op`` on ``layer`` with prefill precision A8 (no A4 scales)."""
    return ops.call_moe(
        op, hidden, topk_weights, topk_ids, layer.experts, None, name, limit, prefill_precision=A8
    )


def inputs(tokens, seed=0):
    return make_inputs(tokens, seed, hidden_size=A8_HIDDEN)


@given(
    lens=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    max_decode_len=st.integers(1, 3),
    padding=st.integers(0, 3),
    limit=st.sampled_from([None, 0.5]),
    data=st.data(),
)
def test_a8_split_equals_w4a16_on_decode_rows_and_the_a8_oracle_on_prefill_rows(
    a8_layer, lens, max_decode_len, padding, limit, data
):
    row_types = ops.row_types_from_query_lens(lens, max_decode_len, sum(lens) + padding)
    hidden, topk_weights, topk_ids = data.draw(moe_inputs(row_types.num_rows, A8_HIDDEN))
    with ops.step_row_types(row_types):
        split = run_a8(ops.moe_split, hidden, topk_weights, topk_ids, a8_layer, limit=limit)
    decode = rows_of(sorted(row_types.decode + row_types.padding))
    w4a16 = moe_reference(
        hidden[decode], topk_weights[decode], topk_ids[decode], a8_layer.experts, None, limit
    )
    assert torch.equal(split[decode], w4a16)
    prefill = rows_of(row_types.prefill)
    a8 = moe_reference_a8(hidden[prefill], topk_weights[prefill], topk_ids[prefill], a8_layer.experts, limit)
    assert torch.equal(split[prefill], a8)


def test_a8_prefill_rows_differ_from_w4a16_so_the_split_is_observable(a8_layer):
    hidden, topk_weights, topk_ids = inputs(16)
    with ops.step_row_types(ops.row_types_from_query_lens([16], 1)):
        a8 = run_a8(ops.moe_split, hidden, topk_weights, topk_ids, a8_layer)
    assert not torch.equal(a8, run_a8(ops.moe_w4a16, hidden, topk_weights, topk_ids, a8_layer))
    assert torch.equal(a8, moe_reference_a8(hidden, topk_weights, topk_ids, a8_layer.experts))


def test_a8_rows_are_counted_apart_from_a4_rows_on_the_host_and_the_device(a8_layer):
    """The device counter has one slot per precision: A8 rows land in the A8 slot, none in A4."""
    counter = ops.DEVICE_ROW_COUNTERS.attach(a8_layer.experts.w13_weight, "counted")
    row_types = ops.row_types_from_query_lens([1, 6, 1, 1, 4], 1, 15)  # 3 decode, 10 prefill, 2 padding
    hidden, topk_weights, topk_ids = inputs(row_types.num_rows)
    with ops.step_row_types(row_types):
        run_a8(ops.moe_split, hidden, topk_weights, topk_ids, a8_layer, "counted")
    assert ops.ROW_COUNTERS.snapshot() == {("counted", W4A16): 5, ("counted", A8): 10}
    assert ops.DEVICE_ROW_COUNTERS.snapshot() == {
        ("counted", W4A16): 5,
        ("counted", A4): 0,
        ("counted", A8): 10,
    }
    assert ops.DEVICE_ROW_COUNTERS.kernel_calls() == {("counted", "reference"): 1}
    assert counter.shape[0] == len((W4A16, A4, A8)) + len(ops.counters.KERNEL_FAMILIES)


def test_a8_split_runs_w4a16_while_a_stream_captures(a8_layer, monkeypatch):
    """CPU stand-in for capture: the split op's capture guard keeps A8 out of captured graphs."""
    monkeypatch.setattr(moe, "is_capturing", lambda tensor: True)
    hidden, topk_weights, topk_ids = inputs(6)
    with ops.step_row_types(ops.row_types_from_query_lens([6], 1)):
        split = run_a8(ops.moe_split, hidden, topk_weights, topk_ids, a8_layer, "captured")
    assert torch.equal(split, moe_reference(hidden, topk_weights, topk_ids, a8_layer.experts, None))
    assert ops.ROW_COUNTERS.total(A8) == 0 and ops.ROW_COUNTERS.total(W4A16) == 6


def test_moe_w4a16_carries_a8_and_runs_every_row_w4a16(a8_layer):
    hidden, topk_weights, topk_ids = inputs(9)
    with ops.step_row_types(ops.row_types_from_query_lens([9], 1)):
        out = run_a8(ops.moe_w4a16, hidden, topk_weights, topk_ids, a8_layer)
    assert torch.equal(out, moe_reference(hidden, topk_weights, topk_ids, a8_layer.experts, None))
    assert ops.ROW_COUNTERS.total(A8) == 0


# -- errors ----------------------------------------------------------------------------------------------


def test_the_schema_carries_prefill_precision_as_a_string_defaulting_to_a4():
    for op in (ops.moe_w4a16, ops.moe_a4, ops.moe_split):
        argument = {a.name: a for a in op._schema.arguments}["prefill_precision"]
        assert str(argument.type) == "str" and argument.default_value == A4


@pytest.mark.parametrize("op", [ops.moe_w4a16, ops.moe_a4, ops.moe_split])
@pytest.mark.parametrize("fake", [False, True])
def test_a_bad_prefill_precision_is_an_error_naming_the_argument(a8_layer, op, fake):
    """Also under fake tensors (what torch.compile traces with): a bad value fails at compile time."""
    hidden, topk_weights, topk_ids = inputs(4)
    args = (hidden, topk_weights, topk_ids, *a8_layer.experts.tensors(), "layer")
    with pytest.raises(ValueError, match=r"prefill_precision must be one of \['a4', 'a8'\], got 'fp8'"):
        if fake:
            with FakeTensorMode() as mode:
                op(
                    *[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args],
                    prefill_precision="fp8",
                )
        else:
            op(*args, prefill_precision="fp8")


def test_a8_takes_no_a4_scales(layer):
    hidden, topk_weights, topk_ids = make_inputs(4)
    with pytest.raises(ValueError, match="prefill_precision 'a8' takes no A4 scales"):
        ops.call_moe(
            ops.moe_split,
            hidden,
            topk_weights,
            topk_ids,
            layer.experts,
            layer.a4_scales,
            "l",
            prefill_precision=A8,
        )


def test_a8_needs_hidden_and_intermediate_sizes_multiple_of_128(uncalibrated_layer):
    hidden, topk_weights, topk_ids = make_inputs(4)  # the tiny layer: H = 64, I = 32
    with pytest.raises(
        ValueError, match=r"prefill_precision 'a8': A8 needs hidden size H=64 and intermediate"
    ):
        run_a8(ops.moe_split, hidden, topk_weights, topk_ids, uncalibrated_layer)


def test_moe_a4_refuses_a8(a8_layer):
    hidden, topk_weights, topk_ids = inputs(4)
    with pytest.raises(
        ValueError, match="moe_a4 on layer 'layer' runs every row A4; got prefill_precision 'a8'"
    ):
        run_a8(ops.moe_a4, hidden, topk_weights, topk_ids, a8_layer)


# -- backends without an A8 kernel -----------------------------------------------------------------------


class A4OnlyBackend(ReferenceBackend):
    """A backend with the kernels the b12x backend has (and triton off sm_90): W4A16 and A4, no A8."""

    name = "a4-only"
    precisions = (W4A16, A4)


@pytest.mark.parametrize("backend", [B12xBackend(), A4OnlyBackend()], ids=lambda b: b.name)
def test_backends_without_an_a8_kernel_refuse_a8_naming_the_setting_and_what_to_use(backend):
    reason = backend.refuses(A8)
    assert reason is not None and "a4prefill.prefill_precision 'a8'" in reason
    assert "use prefill_precision 'a4', or A4PREFILL_BACKEND=reference" in reason
    assert backend.refuses(A4) is None and backend.refuses(W4A16) is None
    assert ReferenceBackend().refuses(A8) is None


def test_triton_refuses_a8_off_sm90_naming_the_setting_and_runs_nothing(a8_layer):
    """The triton backend's A8 kernel needs an sm_90 GPU: on the CPU ``refuses("a8", cpu)`` says
    so and names the setting (W4A16 and A4 stay accepted), and ``run`` checks the plan before any
    launch: no silent A4 or W4A16 for A8 rows."""
    cpu = torch.device("cpu")
    reason = TritonBackend().refuses(A8, cpu)
    assert reason is not None and "sm_90" in reason and "a4prefill.prefill_precision 'a8'" in reason
    assert TritonBackend().refuses(A4, cpu) is None and TritonBackend().refuses(W4A16, cpu) is None
    hidden, topk_weights, topk_ids = inputs(4)
    call = ops.MoECall(hidden, topk_weights, topk_ids, a8_layer.experts, None, None, "t", A8)
    with pytest.raises(ValueError, match=r"layer 't': the triton backend's A8 kernel runs on sm_90 GPUs"):
        TritonBackend().run(call, RowPlan.uniform(A8, 4))


def test_the_op_refuses_a8_rows_on_a_backend_without_an_a8_kernel_and_falls_back_to_nothing(
    a8_layer, monkeypatch
):
    backends.register_backend("a4-only", A4OnlyBackend, priority=-1)
    monkeypatch.setenv(backends.BACKEND_ENV, "a4-only")
    hidden, topk_weights, topk_ids = inputs(5)
    with (
        ops.step_row_types(ops.row_types_from_query_lens([1, 4], 1)),
        pytest.raises(ValueError, match="layer 'x': the a4-only backend has no A8 kernel"),
    ):
        run_a8(ops.moe_split, hidden, topk_weights, topk_ids, a8_layer, "x")
    assert ops.ROW_COUNTERS.snapshot() == {}  # nothing ran, nothing counted
    with ops.step_row_types(ops.row_types_from_query_lens([1] * 5, 1)):  # decode only: no A8 row
        out = run_a8(ops.moe_split, hidden, topk_weights, topk_ids, a8_layer, "x")
    assert torch.equal(out, moe_reference(hidden, topk_weights, topk_ids, a8_layer.experts, None))


# -- torch.library and torch.compile ---------------------------------------------------------------------


@pytest.mark.parametrize("op", [ops.moe_w4a16, ops.moe_split])
def test_opcheck_passes_with_a8(a8_layer, op):
    hidden, topk_weights, topk_ids = inputs(9)
    args = (hidden, topk_weights, topk_ids, *a8_layer.experts.tensors(), "layer")
    with ops.step_row_types(ops.row_types_from_query_lens([1, 8], 1)):
        torch.library.opcheck(
            op,
            args,
            {"prefill_precision": A8},
            test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
        )


def test_a8_compiles_without_graph_breaks_and_matches_eager(a8_layer):
    torch._dynamo.reset()
    module = TinyMoEModel([a8_layer.quantized], ops.moe_split, prefill_precision=A8)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for tokens in (13, 29):
        hidden, _, _ = inputs(tokens, seed=tokens)
        with ops.step_row_types(ops.row_types_from_query_lens([1, 2, tokens - 3], 1)):
            assert torch.equal(compiled(hidden), module(hidden))
    assert not torch._dynamo.utils.counters["graph_break"]
    assert ops.ROW_COUNTERS.total(A8) > 0 and ops.ROW_COUNTERS.total(A4) == 0
