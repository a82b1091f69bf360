"""The humming baseline's CPU-checkable parts (``benchmarks/humming_baseline.py``): its torch
alignment gives vLLM's ``moe_align_block_size`` format (the indexed-GEMM routing humming reads),
checked against a plain loop, and the baseline is absent, not an error, without humming or sm_90."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers.scripts import load_benchmark


@pytest.fixture(scope="module")
def baseline():
    return load_benchmark("humming_baseline")


def loop_alignment(ids: list[int], block: int, experts: int) -> tuple[list[int], list[int]]:
    """The format as humming's reference builds it (testing/data.py): each expert's route ids in
    order, padded to a multiple of ``block`` with ``len(ids)``; one expert id per block."""
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for expert in range(experts):
        routes = [route for route, e in enumerate(ids) if e == expert]
        blocks = -(-len(routes) // block)
        sorted_ids += routes + [len(ids)] * (blocks * block - len(routes))
        expert_ids += [expert] * blocks
    return sorted_ids, expert_ids


@st.composite
def routings(draw):
    experts = draw(st.integers(1, 12))
    top_k = draw(st.integers(1, min(experts, 4)))
    tokens = draw(st.integers(1, 20))
    rows = [draw(st.permutations(range(experts)))[:top_k] for _ in range(tokens)]
    block = draw(st.sampled_from([1, 2, 3, 8, 16, 24]))
    return torch.tensor(rows, dtype=torch.int32), block, experts


@given(routings())
def test_the_torch_alignment_is_vllms_format(baseline, routing):
    topk_ids, block, experts = routing
    sorted_ids, expert_ids, padded = baseline.align_block_size(topk_ids, block, experts)
    routes = topk_ids.numel()
    expected_sorted, expected_experts = loop_alignment(topk_ids.reshape(-1).tolist(), block, experts)
    assert sorted_ids.dtype == expert_ids.dtype == padded.dtype == torch.int32
    assert padded.shape == (1,) and int(padded) == len(expected_sorted)
    capacity = routes + experts * (block - 1)
    if routes < experts:
        capacity = min(capacity, routes * block)
    assert sorted_ids.shape == (capacity,)  # the length vLLM allocates
    assert expert_ids.shape == (-(-capacity // block),)
    assert sorted_ids[: len(expected_sorted)].tolist() == expected_sorted
    assert (sorted_ids[len(expected_sorted) :] == routes).all()
    assert expert_ids[: len(expected_experts)].tolist() == expected_experts
    assert (expert_ids[len(expected_experts) :] == -1).all()


def test_no_baseline_without_humming_or_sm90(baseline, monkeypatch):
    weights = SimpleNamespace(w13_weight=torch.zeros(1, 2, 8, dtype=torch.uint8))
    monkeypatch.setitem(sys.modules, "humming", None)  # humming not importable
    assert baseline.humming_moe(weights) is None
    assert not baseline.on_sm90(torch.device("cpu"))
