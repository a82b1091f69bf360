"""The b12x backend's kernels compiled for SM120 and SM121 on the CPU (``a4prefill.tools.b12x_compile``,
b12x's own compile pool with the device faked), and the b12x internals that relies on.

What runs: the package's translation and plans, b12x's weight preparation, its default
configuration and compile jobs for the target, its CuTe DSL and Triton compilers, then Triton's
``cuobjdump`` on the device code. What does not: any kernel (no SM120 GPU here).
CI compiles the tiny layer for SM121 and the GLM-5.3-Flash TP2 experts for SM120 (both plans
each: every target and both shapes once, about 100 s a case on 2 cores);
``scripts/compile_b12x.sh`` compiles every combination.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from helpers.markers import NEEDS_B12X

pytest.importorskip("b12x.moe.fused_moe", reason=NEEDS_B12X)

from a4prefill.tools import b12x_compile
from a4prefill.tools.b12x_compile import SHAPES, TARGETS, compile_layer, placeholder_layer

pytestmark = pytest.mark.slow
MAX_TOKENS = 8192  # the backend's default call capacity (A4PREFILL_B12X_MAX_TOKENS)
# What each plan's preparation compiles (CuTe programs), and a kernel of each
CUTE_PROGRAMS = {
    "w4a16": {"moe.w4a16.fused_moe", "moe.w4a16.topk_sum"},
    "a4": {"integration.tp_moe.dynamic"},
}
KERNELS = {"w4a16": ("W4A16FusedMoeKernel", "W4A16TopKSumKernel"), "a4": ("MoEDynamicKernel",)}


@pytest.fixture(autouse=True)
def _fresh_caches(tmp_path_factory, monkeypatch):
    """Every compile here is real: b12x's and Triton's disk caches start empty (per module)."""
    root = tmp_path_factory.getbasetemp() / "b12x-compile-caches"
    monkeypatch.setenv("B12X_COMPILE_CACHE_DIR", str(root / "b12x"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(root / "triton"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.parametrize(("shape", "arch"), [("tiny", "sm_121a"), ("glm-tp2", "sm_120a")], ids=str)
def test_every_program_of_both_plans_is_device_code_for_the_target(shape, arch):
    """Both plans of a calibrated layer: every CuTe object embeds CUDA code for exactly ``arch``
    and every Triton program is a cubin for it; the kernels are b12x's W4A16 and A4 MoE. Each
    declaration has one variant (the capacity): decode-size and prefill-size calls bind it, so
    these kernels are what both run."""
    experts, hidden, intermediate, top_k = SHAPES[shape]
    weights, scales = placeholder_layer(experts, hidden, intermediate)
    compilations = compile_layer(weights, scales, top_k, MAX_TOKENS, arch)
    assert [c.plan for c in compilations] == ["w4a16", "a4"]
    for compilation in compilations:
        print(f"{shape} {arch} {compilation.plan}: {compilation.seconds:.1f} s, {compilation.summary}")
        assert compilation.variants == (MAX_TOKENS,)
        cute = {p.name for p in compilation.programs if p.dialect == "cute"}
        assert cute == CUTE_PROGRAMS[compilation.plan]
        for program in compilation.programs:
            assert program.archs and set(program.archs) == {arch}, program
        kernels = " ".join(k for p in compilation.programs for k in p.kernels)
        assert all(kernel in kernels for kernel in KERNELS[compilation.plan]), kernels


def test_an_uncalibrated_layer_compiles_the_w4a16_plan_only():
    experts, hidden, intermediate, top_k = SHAPES["tiny"]
    weights, _ = placeholder_layer(experts, hidden, intermediate)
    (only,) = compile_layer(weights, None, top_k, 64, "sm_120a")
    assert only.plan == "w4a16" and {p.name for p in only.programs if p.dialect == "cute"} == {
        "moe.w4a16.fused_moe",
        "moe.w4a16.topk_sum",
    }


def test_b12x_cannot_plan_w4a16_below_its_tile_sizes():
    """b12x 1.5.1's W4A16 kernels have no tile for H=64, I=32 (the conftest layer): a layer that
    small cannot be served by the b12x backend; planning says so (on an SM120 GPU too)."""
    from a4prefill.ops.backends import b12x_plans
    from a4prefill.ops.backends.b12x_weights import translate_weights

    weights, scales = placeholder_layer(6, 64, 32)
    geometry = b12x_plans.check_geometry(weights.w13_weight, weights.w2_weight, 2, MAX_TOKENS)
    plan = b12x_plans.plan_weights(geometry, "w4a16", torch.bfloat16, None)
    target = TARGETS["sm_120a"]
    with b12x_compile._device_properties(target):
        prepared = b12x_plans.prepare_weights(plan, translate_weights(weights, scales))
    declaration = b12x_plans.plan_execution(prepared, geometry)
    jobs = b12x_compile.compile_jobs(declaration, target)
    with pytest.raises(ValueError, match="no valid W4A16 tile config"):
        b12x_compile._describe(jobs, target)


def test_an_unknown_target_is_refused_by_name():
    weights, scales = placeholder_layer(8, 256, 128)
    with pytest.raises(ValueError, match="arch must be one of"):
        compile_layer(weights, scales, 2, 64, "sm_100a")


def test_the_b12x_internals_the_offline_compile_uses_are_still_there():
    """Pinned (b12x 1.5.1): a b12x that renames or reshapes any of these fails here first."""
    from b12x._lib import compile_pool, compiler, utils
    from b12x.preparation.device import DetectedDevice
    from b12x.preparation.types import DeviceIdentity

    target = (
        "device_ordinal",
        "compute_capability",
        "device_uuid",
        "product_name",
        "sm_count",
        "max_shared_memory_per_block",
        "max_shared_memory_per_multiprocessor",
    )
    assert list(inspect.signature(compile_pool._initialize_worker).parameters) == [*target, "activity"]
    assert {*target, "workers"} <= set(inspect.signature(compile_pool.CompilePool).parameters)
    assert all(hasattr(compile_pool.CompilePool, name) for name in ("submit_plans", "wait", "summary"))
    assert callable(compile_pool.describe_compilation) and callable(
        compile_pool._offline_compiler_spawn_environment
    )
    assert {"job", "programs"} <= set(compile_pool.CompilationPlan.__dataclass_fields__)
    assert callable(compiler._cache_object_path) and isinstance(utils._num_sm_cache, dict)
    assert {
        "ordinal",
        "identity",
        "uuid",
        "max_shared_memory_per_block",
        "max_shared_memory_per_multiprocessor",
    } <= set(inspect.signature(DetectedDevice).parameters)
    assert {"vendor", "compute_capability", "sm_count", "product_name"} <= set(
        inspect.signature(DeviceIdentity).parameters
    )
    experts, hidden, intermediate, top_k = SHAPES["tiny"]
    weights, scales = placeholder_layer(experts, hidden, intermediate)
    from a4prefill.ops.backends import b12x_plans
    from a4prefill.ops.backends.b12x_weights import translate_weights

    geometry = b12x_plans.check_geometry(weights.w13_weight, weights.w2_weight, top_k, 64)
    prepared = b12x_plans.prepare_weights(
        b12x_plans.plan_weights(geometry, "a4", torch.bfloat16, None), translate_weights(weights, scales)
    )
    declaration = b12x_plans.plan_execution(prepared, geometry)
    (plan,) = b12x_compile.declaration_variants(declaration).values()
    assert all(hasattr(plan, name) for name in ("contract", "query", "override", "_compile_jobs"))
    assert {"device", "override", "search"} <= set(inspect.signature(plan.contract.configure).parameters)
