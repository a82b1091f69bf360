"""The split-prefill graph pass: which graphs it rewrites, settings, uuid, idempotence,
Inductor's cache, and the vLLM-op rewrite through vLLM's own pass manager."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from a4prefill import SplitPrefillPass, ops
from a4prefill.ops.counters import A4, A8
from a4prefill.settings import A4PrefillSettings
from a4prefill.tools.tiny_layer import TinyMoEModel
from helpers.layers import A8_HIDDEN, HIDDEN, make_inputs

LIMIT = 16


def compile_and_run(module, split_pass, tokens, dynamic=None, bounds=None, hidden_size=HIDDEN):
    """Compile ``module`` with the pass, run it on ``tokens`` rows (1 decode + a prompt)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    hidden, _, _ = make_inputs(tokens, seed=tokens, hidden_size=hidden_size)
    if bounds:
        torch._dynamo.mark_dynamic(hidden, 0, min=bounds[0], max=bounds[1])
    compiled = torch.compile(
        module, fullgraph=True, dynamic=dynamic, options={"post_grad_custom_post_pass": split_pass}
    )
    with ops.step_row_types(ops.row_types_from_query_lens([1, tokens - 1], 1)):
        out = compiled(hidden)
    assert not torch._dynamo.utils.counters["graph_break"]
    return hidden, out


@pytest.fixture(autouse=True)
def _no_inductor_cache():
    # A cache hit skips the passes (no records). Inductor reads the environment only when it is
    # first imported, so patch its config rather than the variable.
    with torch._inductor.config.patch(force_disable_caches=True):
        yield


@pytest.mark.parametrize(
    ("tokens", "dynamic", "bounds", "rewritten", "expected_range"),
    [
        (8, False, None, 0, "8"),
        (40, False, None, 1, "40"),
        (40, True, None, 1, "[2, inf]"),
        (12, None, (2, LIMIT), 0, f"[2, {LIMIT}]"),
        (40, None, (2, 64), 1, "[2, 64]"),
    ],
    ids=["static-small", "static-large", "dynamic", "dynamic-bounded-within", "dynamic-bounded-beyond"],
)
def test_rewrites_exactly_the_graphs_that_can_run_uncaptured(
    layer, tokens, dynamic, bounds, rewritten, expected_range
):
    split_pass = SplitPrefillPass(A4PrefillSettings(captured_limit=LIMIT))
    module = TinyMoEModel([layer.quantized], ops.moe_w4a16)
    hidden, out = compile_and_run(module, split_pass, tokens, dynamic, bounds)
    (record,) = split_pass.records
    assert (record.moe_nodes, len(record.rewritten), record.token_range) == (1, rewritten, expected_range)
    eager_op = ops.moe_split if rewritten else ops.moe_w4a16
    with ops.step_row_types(ops.row_types_from_query_lens([1, tokens - 1], 1)):
        eager = TinyMoEModel([layer.quantized], eager_op)
        eager.load_state_dict(module.state_dict())
        expected = eager(hidden)
    assert torch.equal(out, expected)
    assert (ops.ROW_COUNTERS.total(A4) > 0) == bool(rewritten)


def test_excluded_and_disabled_layers_are_left_alone(layer):
    module = TinyMoEModel([layer.quantized], ops.moe_w4a16)
    for settings, reason in [
        (A4PrefillSettings(captured_limit=LIMIT, excluded_layers=(r"layers\.0\.",)), "excluded by"),
        (A4PrefillSettings(enabled=False, captured_limit=LIMIT), "disabled"),
    ]:
        split_pass = SplitPrefillPass(settings)
        compile_and_run(module, split_pass, 40)
        (record,) = split_pass.records
        assert record.rewritten == [] and reason in record.kept[0][1]
        assert ops.ROW_COUNTERS.total(A4) == 0


def test_a8_nodes_need_no_a4_scales_and_keep_their_precision_through_the_rewrite(a8_layer):
    """An uncalibrated layer's node carrying prefill precision A8 is rewritten where its range
    reaches beyond the captured limit (A8 needs no A4 scales) and the split node runs A8 on the
    prompt rows (at A4 the same node, without A4 scales, is kept: ``test_inspect_graphs``)."""
    tokens = 40
    split_pass = SplitPrefillPass(A4PrefillSettings(captured_limit=LIMIT, prefill_precision="a8"))
    module = TinyMoEModel([a8_layer.quantized], ops.moe_w4a16, prefill_precision=A8)
    hidden, out = compile_and_run(module, split_pass, tokens, hidden_size=A8_HIDDEN)
    (record,) = split_pass.records
    rewritten = tokens > LIMIT
    assert len(record.rewritten) == int(rewritten)
    eager = TinyMoEModel(
        [a8_layer.quantized], ops.moe_split if rewritten else ops.moe_w4a16, prefill_precision=A8
    )
    eager.load_state_dict(module.state_dict())
    with ops.step_row_types(ops.row_types_from_query_lens([1, tokens - 1], 1)):
        expected = eager(hidden)
    assert torch.equal(out, expected)
    assert ops.ROW_COUNTERS.total(A4) == 0
    assert ops.ROW_COUNTERS.total(A8) == 2 * (tokens - 1)  # the prompt's rows, compiled and eager


def _post_grad_graph(layer, tokens=40):
    """The post-grad graph of the module, captured by a recording pass."""
    graphs = []

    class Recorder(SplitPrefillPass):
        def __call__(self, graph):
            graphs.append(copy.deepcopy(graph.owning_module).graph)

    compile_and_run(
        TinyMoEModel([layer.quantized], ops.moe_w4a16), Recorder(A4PrefillSettings(enabled=False)), tokens
    )
    return graphs[0]


def test_second_application_changes_nothing_and_meta_stays_valid(layer):
    graph = _post_grad_graph(layer)
    split_pass = SplitPrefillPass(A4PrefillSettings(captured_limit=LIMIT))
    split_pass(graph)
    once = str(graph)
    split_pass(graph)
    assert str(graph) == once
    assert split_pass.records[1].rewritten == [] and split_pass.records[1].kept[0][1] == "already split"
    (node,) = [n for n in graph.nodes if n.target is ops.moe_split]
    hidden = node.args[0].meta["val"]
    assert node.meta["val"].shape == hidden.shape and node.meta["val"].dtype == hidden.dtype
    graph.lint()


def test_graphs_without_moe_nodes_are_untouched():
    graph = torch.fx.symbolic_trace(torch.nn.Linear(4, 4)).graph
    before = str(graph)
    split_pass = SplitPrefillPass(A4PrefillSettings(captured_limit=0))
    split_pass(graph)
    assert str(graph) == before and split_pass.records == []


def test_uuid_changes_with_each_setting_and_not_otherwise():
    base = A4PrefillSettings(captured_limit=LIMIT)
    uuids = {
        SplitPrefillPass(settings).uuid()
        for settings in (
            base,
            A4PrefillSettings(captured_limit=LIMIT + 1),
            A4PrefillSettings(enabled=False, captured_limit=LIMIT),
            A4PrefillSettings(captured_limit=LIMIT, excluded_layers=("mtp",)),
            A4PrefillSettings(captured_limit=LIMIT, prefill_precision="a8"),
        )
    }
    assert len(uuids) == 5
    assert SplitPrefillPass(base).uuid() == SplitPrefillPass(A4PrefillSettings(captured_limit=LIMIT)).uuid()


class StaticSideCall(torch.nn.Module):
    """One MoE call on the dynamic token rows and one on a fixed 8-row input, same layer."""

    def __init__(self, layer):
        super().__init__()
        self.model = TinyMoEModel([layer.quantized], ops.moe_w4a16)

    def forward(self, hidden, fixed):
        return self.model.block(0, hidden), self.model.block(0, fixed)


def test_token_range_is_decided_per_moe_node(layer):
    """A static 8-row node in a dynamic graph is its own range: kept W4A16, and the step's row
    types (which describe the token rows) are never asked for its 8 rows."""
    split_pass = SplitPrefillPass(A4PrefillSettings(captured_limit=LIMIT))
    module = StaticSideCall(layer)
    torch._dynamo.reset()
    hidden, _, _ = make_inputs(40, seed=1)
    fixed, _, _ = make_inputs(8, seed=2)
    torch._dynamo.mark_dynamic(hidden, 0, min=2, max=64)
    compiled = torch.compile(module, fullgraph=True, options={"post_grad_custom_post_pass": split_pass})
    with ops.step_row_types(ops.row_types_from_query_lens([1, 39], 1)):
        out_tokens, out_fixed = compiled(hidden, fixed)
        a4_rows = ops.ROW_COUNTERS.total(A4)
        eager_tokens = TinyMoEModel([layer.quantized], ops.moe_split)
        eager_tokens.load_state_dict(module.model.state_dict())
        expected_tokens = eager_tokens.block(0, hidden)
    (record,) = split_pass.records
    assert len(record.rewritten) == 1 and len(record.kept) == 1, record.summary()
    assert sorted(record.node_ranges.values()) == ["8", "[2, 64]"]
    assert "token range 8 within captured limit 16" in record.kept[0][1]
    # The 39 prompt rows ran A4 and nothing else did: the fixed node kept moe_w4a16 (a split op
    # there would have failed on the 40-row step types). Outputs match eager up to Inductor's
    # own router arithmetic.
    assert a4_rows == 39
    torch.testing.assert_close(out_tokens, expected_tokens, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out_fixed, module.model.block(0, fixed), rtol=2e-2, atol=2e-2)


CACHE_CHILD = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from helpers.layers import A8_HIDDEN, HIDDEN, make_inputs, EXPERTS, HIDDEN, INTERMEDIATE, TOP_K
    from a4prefill import SplitPrefillPass, ops
    from a4prefill.settings import A4PrefillSettings
    from a4prefill.tools.tiny_layer import TinyMoEModel, make_tiny_layer
    low, high = int(sys.argv[1]), int(sys.argv[2])
    layer = make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=3, calibration_tokens=128)
    torch.manual_seed(0)
    module = TinyMoEModel([layer.quantized], ops.moe_w4a16)
    split_pass = SplitPrefillPass(A4PrefillSettings(captured_limit={limit}))
    hidden, _, _ = make_inputs(12)
    torch._dynamo.mark_dynamic(hidden, 0, min=low, max=high)
    compiled = torch.compile(module, fullgraph=True, options={{"post_grad_custom_post_pass": split_pass}})
    with ops.step_row_types(ops.row_types_from_query_lens([1, 11], 1)):
        compiled(hidden)
    print("A4_ROWS", ops.ROW_COUNTERS.total("a4"))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "order", [((2, 64), (2, LIMIT)), ((2, LIMIT), (2, 64))], ids=["beyond-first", "within-first"]
)
def test_inductor_cache_never_serves_a_graph_rewritten_for_another_range(tmp_path, order):
    script = tmp_path / "child.py"
    script.write_text(CACHE_CHILD.format(tests=str(Path(__file__).parent), limit=LIMIT))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_FORCE_DISABLE_CACHES"}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
    )
    for low, high in order:
        done = subprocess.run(
            [sys.executable, str(script), str(low), str(high)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        a4_rows = int(done.stdout.split("A4_ROWS")[-1])
        assert (a4_rows > 0) == (high > LIMIT), done.stdout + done.stderr[-2000:]
    assert any((tmp_path / "cache").rglob("*")), "the cache directory stayed empty: caching was off"


def test_the_cache_key_covers_every_package_module_the_pass_decides_with():
    """``uuid()`` hashes the source of ``DECIDING_MODULES``: every package module whose code the
    pass module uses must be there (process_state only registers the records)."""
    import types

    from a4prefill.passes import split_prefill

    used = {
        value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", "")
        for value in vars(split_prefill).values()
        if isinstance(value, types.ModuleType) or callable(value)
    }
    used = {name for name in used if name.startswith("a4prefill")} - {"a4prefill.process_state"}
    assert used <= set(split_prefill.DECIDING_MODULES), used - set(split_prefill.DECIDING_MODULES)
