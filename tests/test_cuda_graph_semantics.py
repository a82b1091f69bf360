"""CUDA-graph semantics on a GPU with real torch.compile and real CUDA graphs (no vLLM).

A two-block NVFP4 MoE model is compiled with the split-prefill pass (captured limit
``DECODE_TOKENS``) once for a captured decode size and once for a large prefill size:

- the decode-size graph keeps W4A16; it is captured with ``torch.cuda.CUDAGraph`` on a step that
  holds prefill rows too, and every replay equals the eager W4A16 model bit for bit (never A4);
- the large graph runs the split: prefill rows A4, decode rows W4A16, each matching the reference
  backend per precision, with no device-to-host synchronisation (sync debug mode "error").
"""

from __future__ import annotations

import pytest
import torch

from a4prefill import SplitPrefillPass, ops
from a4prefill.ops.backends import BACKEND_ENV
from a4prefill.ops.counters import A4, W4A16
from a4prefill.settings import A4PrefillSettings
from a4prefill.tools.tiny_layer import TinyMoEModel, make_tiny_layer
from helpers.layers import assert_close_to_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, BLOCKS = 16, 256, 128, 2, 2
DECODE_TOKENS, PREFILL_TOKENS = 8, 512
# A captured step may hold a short prompt: 5 decode rows and one 3-token prefill.
CAPTURED_ROWS = ops.row_types_from_query_lens([1, 1, 1, 1, 1, 3], 1)
# An uncaptured step: 3 decode rows, two prompts, 2 padding rows.
LARGE_ROWS = ops.row_types_from_query_lens([1, 300, 1, 1, 207], 1, PREFILL_TOKENS)


@pytest.fixture(autouse=True)
def _fresh_compile():
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model_weights():
    layers = [
        make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=30 + i, calibration_tokens=256).quantized
        for i in range(BLOCKS)
    ]
    return TinyMoEModel(layers, ops.moe_w4a16, top_k=TOP_K).state_dict(), layers


def make_model(model_weights, op):
    state, layers = model_weights
    model = TinyMoEModel(layers, op, top_k=TOP_K)
    model.load_state_dict(state)
    return model.cuda()


def hidden_states(tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(tokens, HIDDEN, generator=generator)).to(torch.bfloat16).cuda()


def rows_mask(row_types) -> torch.Tensor:
    """bool [num_rows] on the GPU: True for the prefill rows."""
    mask = torch.zeros(row_types.num_rows, dtype=torch.bool)
    for start, end in row_types.prefill:
        mask[start:end] = True
    return mask.cuda()


class ReferenceModels:
    """The model compiled without the pass (same router kernels, so the same routing as the
    model under test), its MoE calls run by the torch reference backend: the oracle per op."""

    def __init__(self, model_weights) -> None:
        self.compiled = {
            op: torch.compile(make_model(model_weights, op), fullgraph=True, dynamic=False)
            for op in (ops.moe_w4a16, ops.moe_split)
        }

    def __call__(self, op, hidden, row_types, monkeypatch) -> torch.Tensor:
        with monkeypatch.context() as patch, ops.step_row_types(row_types):
            patch.setenv(BACKEND_ENV, "reference")
            return self.compiled[op](hidden)


def assert_rows_ran(precision, out, w4a16, split) -> None:
    """``out`` matches the oracle of ``precision`` and is clearly farther from the other one."""
    same, other = (w4a16, split) if precision == "w4a16" else (split, w4a16)
    assert_close_to_reference(out, same, precision)
    to_same = (out.float() - same.float()).norm()
    to_other = (out.float() - other.float()).norm()
    assert to_same < 0.5 * to_other, f"{precision} rows: {to_same:.3g} vs {to_other:.3g} to the other oracle"


def test_decode_graph_is_captured_w4a16_and_large_graph_splits_without_sync(model_weights, monkeypatch):
    split_pass = SplitPrefillPass(A4PrefillSettings(captured_limit=DECODE_TOKENS))
    compiled = torch.compile(
        make_model(model_weights, ops.moe_w4a16),
        fullgraph=True,
        dynamic=False,
        options={"post_grad_custom_post_pass": split_pass},
    )
    oracle = ReferenceModels(model_weights)

    # Decode size: compile and warm up on a side stream (Triton compiles its kernels on first
    # launch, which capture forbids), then capture one step and replay it on new data.
    static = hidden_states(DECODE_TOKENS, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), ops.step_row_types(CAPTURED_ROWS):
        for _ in range(2):
            compiled(static)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    (decode_record,) = split_pass.records
    assert decode_record.token_range == str(DECODE_TOKENS)
    assert (decode_record.moe_nodes, decode_record.rewritten) == (BLOCKS, [])
    ops.ROW_COUNTERS.reset()
    graph = torch.cuda.CUDAGraph()
    with ops.step_row_types(CAPTURED_ROWS), torch.cuda.graph(graph):
        captured = compiled(static)
    assert ops.ROW_COUNTERS.snapshot() == {
        (f"model.layers.{i}.mlp.experts", W4A16): DECODE_TOKENS for i in range(BLOCKS)
    }
    for seed in (2, 3):
        fresh = hidden_states(DECODE_TOKENS, seed)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        ops.ROW_COUNTERS.reset()
        with ops.step_row_types(CAPTURED_ROWS):
            assert torch.equal(captured, compiled(fresh))  # the replay saw the new data
        assert ops.ROW_COUNTERS.total(A4) == 0  # the decode graph holds no split node
        w4a16 = oracle(ops.moe_w4a16, fresh, CAPTURED_ROWS, monkeypatch)
        split = oracle(ops.moe_split, fresh, CAPTURED_ROWS, monkeypatch)
        # Every row of the captured step ran W4A16, its prompt rows too (A4 would be closer to split).
        prompt = rows_mask(CAPTURED_ROWS)
        assert_rows_ran("w4a16", captured[prompt], w4a16[prompt], split[prompt])
        assert_close_to_reference(captured, w4a16, "w4a16")

    # Large size: a separate graph, rewritten by the pass, run uncaptured.
    large = hidden_states(PREFILL_TOKENS, seed=4)
    with ops.step_row_types(LARGE_ROWS):
        compiled(large)  # compile + Triton warm-up
        torch.cuda.synchronize()
        ops.ROW_COUNTERS.reset()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = compiled(large)
            with pytest.raises(RuntimeError):
                out.sum().item()  # the debug mode is live: a real sync raises
        finally:
            torch.cuda.set_sync_debug_mode("default")
    large_record = split_pass.records[-1]
    assert (large_record.token_range, len(large_record.rewritten)) == (str(PREFILL_TOKENS), BLOCKS)
    prefill_rows = LARGE_ROWS.num_prefill_rows
    assert ops.ROW_COUNTERS.total(A4) == BLOCKS * prefill_rows
    assert ops.ROW_COUNTERS.total(W4A16) == BLOCKS * (PREFILL_TOKENS - prefill_rows)

    prefill = rows_mask(LARGE_ROWS)
    split = oracle(ops.moe_split, large, LARGE_ROWS, monkeypatch)
    w4a16 = oracle(ops.moe_w4a16, large, LARGE_ROWS, monkeypatch)
    assert_rows_ran("a4", out[prefill], w4a16[prefill], split[prefill])
    assert_close_to_reference(out[~prefill], w4a16[~prefill], "w4a16")
