"""Process state registers itself (``a4prefill.process_state``): every runtime module's
module-level mutable state is declared with its reset, and resetting restores import-time state."""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.util
import pkgutil
import types

import pytest

import a4prefill
from a4prefill import process_state

CONTAINERS = (dict, list, set, bytearray, collections.deque)


def runtime_modules() -> list[types.ModuleType]:
    """Every module of the package but the tools (and the vLLM integration without vLLM)."""
    names = ["a4prefill"] + [info.name for info in pkgutil.walk_packages(a4prefill.__path__, "a4prefill.")]
    skipped = ("a4prefill.tools", "a4prefill.cli", "a4prefill.__main__")
    if importlib.util.find_spec("vllm") is None:
        skipped += ("a4prefill.vllm_integration",)
    if importlib.util.find_spec("triton") is None:
        kernel_modules = (
            "numerics",
            "shared_kernels",
            "tiled_kernels",
            "decode_kernels",
            "decode_layouts",
            "decode_asm",
        )
        skipped += tuple(f"a4prefill.ops.backends.triton.{name}" for name in kernel_modules)
    return [importlib.import_module(n) for n in names if not n.startswith(skipped)]


def undeclared_state(module: types.ModuleType, declared: dict[int, str]) -> list[str]:
    """Module-level mutable containers, function caches and package objects holding containers
    that no :func:`register_state` declared."""
    found = []
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, types.ModuleType | type):
            continue
        if module is process_state and name == "_resets":
            continue  # the registry of resets itself
        if isinstance(value, (*CONTAINERS, functools._lru_cache_wrapper)):
            if id(value) not in declared:
                found.append(f"{module.__name__}.{name}")
        elif type(value).__module__.startswith("a4prefill") and hasattr(value, "__dict__"):
            if id(value) in declared:
                continue
            for attribute, inner in vars(value).items():
                if isinstance(inner, CONTAINERS) and id(inner) not in declared:
                    found.append(f"{module.__name__}.{name}.{attribute}")
    return found


def test_every_piece_of_process_state_is_declared_with_its_reset():
    modules = runtime_modules()  # first: importing a module registers its state
    declared = process_state.registered_state()
    undeclared = [item for module in modules for item in undeclared_state(module, declared)]
    assert not undeclared, f"register these with a4prefill.process_state.register_state: {undeclared}"


def test_the_check_finds_an_undeclared_container():
    module = types.ModuleType("a4prefill.fake_stateful")
    module.cache = {}
    assert undeclared_state(module, process_state.registered_state()) == ["a4prefill.fake_stateful.cache"]


def test_resetting_restores_registrations_counters_and_records():
    from a4prefill import ops
    from a4prefill.ops import backends
    from a4prefill.ops.backends.reference import ReferenceBackend
    from a4prefill.passes import rewrite_targets
    from a4prefill.passes.split_prefill import PassRecord, split_prefill_pass

    backends.register_backend("extra", ReferenceBackend, priority=-5)
    rewrite_targets.register_split_twin(ops.moe_a4, ops.moe_split)
    ops.ROW_COUNTERS.record("layer", "w4a16", 3)
    split_prefill_pass.records.append(PassRecord("#0", "[1, 2]", 0))
    ops.set_row_provider(lambda rows, layer: None)
    logger = __import__("logging").getLogger("test")
    assert process_state.warn_once(logger, ("k",), "once")
    process_state.reset_process_state()
    assert backends.registered_backends() == ["b12x", "triton", "reference"]
    assert ops.moe_a4 not in rewrite_targets.rewritable_ops()
    assert ops.moe_w4a16 in rewrite_targets.rewritable_ops()
    assert ops.ROW_COUNTERS.snapshot() == {} and split_prefill_pass.records == []
    assert ops.set_row_provider(None) is None
    assert process_state.warn_once(logger, ("k",), "once again")


@pytest.mark.parametrize("module", ["a4prefill.process_state"])
def test_the_state_module_imports_nothing_of_the_package(module):
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    with open(spec.origin) as source:
        text = source.read()
    assert "from a4prefill" not in text and "import a4prefill" not in text
