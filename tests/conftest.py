"""Shared fixtures: a tiny calibrated layer, an uncalibrated one, an uncalibrated one of A8 sizes
(A8 needs no calibration, H and I multiples of 128), a fresh process state per test
(helpers the tests import live in ``tests/helpers``).

Hypothesis: the ``dev`` profile explores fresh examples on every run; the ``ci`` profile (loaded
when the ``CI`` environment variable is set, as ``.ci/run`` is run) is derandomized so CI is
repeatable. Strategies draw the values under test (activations, routing, lengths, scale
bytes), never seeds.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from a4prefill.ops import reset_process_state
from a4prefill.tools.tiny_layer import TinyMoELayer, make_tiny_layer
from helpers.layers import A8_HIDDEN, A8_INTERMEDIATE, EXPERTS, HIDDEN, INTERMEDIATE, TOP_K

# Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads (one
# each for scripts/test.sh's two workers on 2 cores): the interpreted kernels' many small
# operations gain nothing from a second thread, and two workers' thread pools on 2 cores spin
# against each other. Engine subprocesses set their own threads.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

settings.register_profile("dev", deadline=None, max_examples=40)
settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# Test files that start a real vLLM engine (in process or as a server), in two groups of about
# equal time on 2 cores: under pytest-xdist (scripts/test.sh runs two workers, ``--dist
# loadgroup``) each group runs on one worker, one engine after the other (an engine's memory and
# threads; fixed paths such as test_vllm_server's README row log stay within one group), at most
# two engines at a time. Collected first, so that each worker starts with one group and the
# other tests fill in around them.
ENGINE_TEST_GROUPS = {
    "test_vllm_e2e.py": "vllm-engine-a",
    "test_warm_compile_cache.py": "vllm-engine-a",
    "test_readme_example.py": "vllm-engine-a",
    "test_numerics.py": "vllm-engine-b",
    "test_inspect_graphs.py": "vllm-engine-b",
    "test_vllm_server.py": "vllm-engine-b",
    "test_tools_environment.py": "vllm-engine-b",
    "test_split_prefill_pass.py": "vllm-engine-b",
    "test_split_prefill_pass_vllm.py": "vllm-engine-b",
}


# Test files whose tests compile many of the same kernels for sm_90a through Triton's JIT (the
# warm-ups' representatives, the default schedules): on one worker each kernel compiles once and
# later tests load it from Triton's disk cache; spread over two workers, both compiled the same
# kernels at the same time (test_triton_jit.py: 351 s of test time on a cold cache, 257 s alone).
SHARED_COMPILE_GROUPS = {"test_triton_jit.py": "triton-jit"}
XDIST_GROUPS = ENGINE_TEST_GROUPS | SHARED_COMPILE_GROUPS


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the marker into the node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = XDIST_GROUPS.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))

    def rank(item: pytest.Item) -> int:  # the longest units first: engine groups, then compile groups
        return 0 if item.path.name in ENGINE_TEST_GROUPS else 1 if item.path.name in XDIST_GROUPS else 2

    items.sort(key=rank)  # stable


@pytest.fixture(scope="session")
def layer() -> TinyMoELayer:
    return make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=3, calibration_tokens=128)


@pytest.fixture(scope="session")
def uncalibrated_layer() -> TinyMoELayer:
    return make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=4, calibrated=False)


@pytest.fixture(scope="session")
def a8_layer() -> TinyMoELayer:
    return make_tiny_layer(EXPERTS, A8_HIDDEN, A8_INTERMEDIATE, TOP_K, seed=5, calibrated=False)


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """Every test starts from the package's empty process state (counters, logged warnings,
    backend instances, row provider): the one place that resets it."""
    reset_process_state()
    yield
    reset_process_state()
