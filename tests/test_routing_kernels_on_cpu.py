"""The chunked routing kernels (``shared_kernels.route_count_kernel``, ``route_offsets_kernel``,
``route_place_kernel``: what sorts a call of more than ``routing.SMALL_ROUTING_MAX`` routes)
against the torch routing (``force_torch``), their contract: the same sorted routes (stable by
route index), segments, tile count and live tile table. They run in Triton's CPU interpreter,
which must be chosen before Triton is imported, hence a subprocess (``helpers.routing_checks``:
hypothesis draws the ids, expert count, tile size and chunk size there; the one-program kernel
is checked on the same routes)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from a4prefill.ops.backends.triton import routing
from a4prefill.ops.backends.triton.routing import RoutingLaunch, routing_launch
from helpers.markers import needs_gluon

TESTS = Path(__file__).parent


@needs_gluon
def test_the_chunked_kernels_sort_as_the_torch_routing():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    command = [sys.executable, "-c", "from helpers.routing_checks import main; main()"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "routing checks passed" in result.stdout


def test_calls_above_the_one_program_kernel_take_the_chunked_kernels():
    """The launch of a call: one program up to ``SMALL_ROUTING_MAX`` routes, the chunked kernels
    above (the torch path only when forced); a launch cannot name both kernels."""
    small = routing_launch(routing.SMALL_ROUTING_MAX, 128)
    large = routing_launch(routing.SMALL_ROUTING_MAX + 1, 128)
    assert small.program_routes and not small.chunk_routes
    assert large == RoutingLaunch(128, 0, routing.CHUNK_WARPS, routing.CHUNK_ROUTES)
    assert routing_launch(10**6, 128, force_torch=True) == RoutingLaunch(128, 0, 0)
    with pytest.raises(ValueError, match="program_routes=16 and chunk_routes=1024 both set"):
        dataclasses.replace(large, program_routes=16)
