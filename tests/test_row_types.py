"""Row segmentation, shard translation and the step context."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from a4prefill.ops.rows import (
    RowTypes,
    current_row_types,
    row_types_from_query_lens,
    row_types_from_query_start_loc,
    set_row_provider,
    shard_row_types,
    step_row_types,
)

query_lens = st.lists(st.integers(0, 12), max_size=12)
max_decode = st.integers(1, 4)
extra_padding = st.integers(0, 7)


def expected_labels(lens: list[int], max_decode_len: int, padding: int) -> list[str]:
    """Row labels straight from the definition, one request at a time."""
    labels: list[str] = []
    for length in lens:
        labels += ["decode" if 0 < length <= max_decode_len else "prefill"] * length
    return labels + ["padding"] * padding


@given(query_lens, max_decode, extra_padding)
def test_spans_cover_every_row_once_and_follow_the_decode_rule(lens, max_decode_len, padding):
    total = sum(lens) + padding
    row_types = row_types_from_query_lens(lens, max_decode_len, num_rows=total)
    covered = sorted(
        row
        for kind in (row_types.decode, row_types.prefill, row_types.padding)
        for start, end in kind
        for row in range(start, end)
    )
    assert covered == list(range(total))
    assert row_types.labels() == expected_labels(lens, max_decode_len, padding)


@given(query_lens, max_decode)
def test_decode_spans_hold_only_short_requests(lens, max_decode_len):
    row_types = row_types_from_query_lens(lens, max_decode_len)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for start, end in row_types.decode:
        owners = {i for i, s in enumerate(starts) for row in range(start, end) if s <= row < s + lens[i]}
        assert all(0 < lens[i] <= max_decode_len for i in owners)


@given(query_lens, max_decode, extra_padding)
def test_query_start_loc_gives_the_same_row_types_as_lengths(lens, max_decode_len, padding):
    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    total = starts[-1] + padding
    assert row_types_from_query_start_loc(torch.tensor(starts), max_decode_len, total) == (
        row_types_from_query_lens(lens, max_decode_len, total)
    )


@given(query_lens, max_decode, extra_padding, st.integers(1, 5), st.data())
def test_shard_translation_agrees_with_slicing_the_global_rows(lens, max_decode_len, padding, world, data):
    global_rows = row_types_from_query_lens(lens, max_decode_len, sum(lens) + padding)
    rank = data.draw(st.integers(0, world - 1))
    chunk = -(-global_rows.num_rows // world)
    padded = global_rows.labels() + ["padding"] * (chunk * world - global_rows.num_rows)
    shard = shard_row_types(global_rows, rank, world)
    assert shard.labels() == padded[rank * chunk : (rank + 1) * chunk]


def test_empty_batch_has_no_rows():
    assert row_types_from_query_lens([], 1) == RowTypes(0, (), (), ())
    assert row_types_from_query_lens([0, 0], 2, num_rows=3).padding == ((0, 3),)


def test_decodes_need_not_come_first():
    row_types = row_types_from_query_lens([5, 1, 1, 7, 2], max_decode_len=2)
    assert row_types.prefill == ((0, 5), (7, 14))
    assert row_types.decode == ((5, 7), (14, 16))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: row_types_from_query_lens([1, -1], 1), "query_lens must be >= 0"),
        (lambda: row_types_from_query_lens([1], 0), "max_decode_len must be >= 1"),
        (lambda: row_types_from_query_lens([4], 1, num_rows=3), "num_rows=3"),
        (lambda: row_types_from_query_start_loc([1, 3], 1), "start at 0"),
        (lambda: row_types_from_query_start_loc([0, 3, 2], 1), "non-decreasing"),
        (lambda: shard_row_types(RowTypes.all_decode(4), 2, 2), "rank"),
        (lambda: RowTypes(4, ((0, 2),), ((1, 4),), ()), "exactly once"),
        (lambda: RowTypes.from_labels(["decode", "spec"]), "row label"),
    ],
)
def test_bad_segmentation_input_raises(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "call",
    [
        lambda: row_types_from_query_lens([1, 2.5], 1),
        lambda: row_types_from_query_lens([1, 3.0], 1),
        lambda: row_types_from_query_lens([True, 4], 1),
        lambda: row_types_from_query_start_loc([0, 1, 4.5], 1),
        lambda: row_types_from_query_start_loc(torch.tensor([0.0, 1.0, 4.0]), 1),
    ],
)
def test_non_integer_query_lengths_are_an_error_not_truncated(call):
    with pytest.raises(TypeError, match=r"must (hold integers|be an integer tensor)"):
        call()


def test_without_information_every_row_is_decode_with_one_warning_per_layer(caplog):
    with caplog.at_level(logging.WARNING, logger="a4prefill.ops.rows"):
        first = current_row_types(5, "layers.0")
        current_row_types(9, "layers.0")
        current_row_types(9, "layers.1")
    assert first == RowTypes.all_decode(5)
    warned = [r.getMessage() for r in caplog.records if "no row types" in r.getMessage()]
    assert len(warned) == 2 and "layers.0" in warned[0] and "layers.1" in warned[1], warned


def test_step_block_wins_over_provider_and_sizes_must_match():
    provided = row_types_from_query_lens([3], 1)
    asked = []

    def provider(num_rows, layer_name):
        asked.append(layer_name)
        return provided if num_rows == 3 else None

    set_row_provider(provider)
    assert current_row_types(3, "layers.7") == provided and asked == ["layers.7"]
    block = row_types_from_query_lens([1, 1, 1], 1)
    with step_row_types(block):
        assert current_row_types(3, "layers.7") == block
        with pytest.raises(ValueError, match="describe 3 rows but the split op got 4"):
            current_row_types(4, "layers.7")
    assert current_row_types(3, "layers.7") == provided
