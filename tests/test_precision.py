"""The precision vocabulary (``a4prefill.ops.precision``): row plans and their spans."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from a4prefill.ops.precision import A4, A8, PRECISIONS, SPLIT, W4A16, RowPlan
from a4prefill.ops.rows import RowTypes

LABELS = st.lists(st.sampled_from(["decode", "prefill", "padding"]), min_size=1, max_size=40)


@given(labels=LABELS)
def test_a_plan_for_row_types_gives_each_row_its_precision_once(labels):
    rows = RowTypes.from_labels(labels)
    plan = RowPlan.for_rows(rows)
    precision_of = {}
    for precision in (W4A16, A4):
        for start, end in plan.spans(precision):
            for row in range(start, end):
                assert row not in precision_of
                precision_of[row] = precision
    assert precision_of == {i: A4 if label == "prefill" else W4A16 for i, label in enumerate(labels)}
    assert plan.rows(A4) == labels.count("prefill") and plan.rows(W4A16) == len(labels) - plan.rows(A4)
    mixed = 0 < labels.count("prefill") < len(labels)
    assert plan.kind == (SPLIT if mixed else A4 if labels.count("prefill") else W4A16)


@given(labels=LABELS)
def test_an_a8_plan_gives_prefill_rows_a8_and_no_row_a4(labels):
    rows = RowTypes.from_labels(labels)
    plan = RowPlan.for_rows(rows, A8)
    precision_of = {}
    for precision in PRECISIONS:
        for start, end in plan.spans(precision):
            for row in range(start, end):
                assert row not in precision_of
                precision_of[row] = precision
    assert precision_of == {i: A8 if label == "prefill" else W4A16 for i, label in enumerate(labels)}
    assert plan.rows(A4) == 0 and plan.rows(A8) == labels.count("prefill")
    mixed = 0 < labels.count("prefill") < len(labels)
    assert plan.kind == (SPLIT if mixed else A8 if labels.count("prefill") else W4A16)
    assert plan.precisions == ((W4A16, A8) if mixed else (plan.kind,))


def test_bad_plans_name_what_is_wrong():
    rows = RowTypes.from_labels(["decode", "prefill"])
    with pytest.raises(ValueError, match="kind must be one of"):
        RowPlan("fp8", 2)
    with pytest.raises(ValueError, match="row_types are given with kind 'split' and only then"):
        RowPlan(SPLIT, 2)
    with pytest.raises(ValueError, match="row_types are given with kind 'split' and only then"):
        RowPlan(A4, 2, rows)
    with pytest.raises(ValueError, match="row_types cover 2 rows, the call has 3"):
        RowPlan(SPLIT, 3, rows)
    with pytest.raises(ValueError, match="precision must be one of"):
        RowPlan.uniform(SPLIT, 2)
    with pytest.raises(ValueError, match=r"RowPlan.prefill must be one of \['a4', 'a8'\], got 'w4a16'"):
        RowPlan(SPLIT, 2, rows, prefill=W4A16)
    with pytest.raises(ValueError, match="a uniform 'a8' plan has prefill 'a8', got 'a4'"):
        RowPlan(A8, 2)
    with pytest.raises(ValueError, match=r"prefill must be one of \['a4', 'a8'\], got 'fp8'"):
        RowPlan.for_rows(rows, "fp8")


def test_a_call_on_some_rows_keeps_the_layer():
    from a4prefill.ops.precision import MoECall

    hidden, weights, ids = torch.zeros(5, 16), torch.ones(5, 2), torch.zeros(5, 2, dtype=torch.int32)
    call = MoECall(hidden, weights, ids, experts=None, layer_name="x")  # type: ignore[arg-type]
    part = call.select(slice(1, 3))
    assert part.num_rows == 2 and part.layer_name == "x" and part.topk_ids.shape == (2, 2)
