"""The TTGIR interpreter's warp specialization and mbarriers (``helpers.ttgir_interpreter``), on
the small producer/consumer ring of ``helpers.ring_kernels`` compiled for sm_90a: the correct
ring gives the exact sum whatever the ring depth and step count, and each of three ordering
mistakes that a GPU may or may not show (a deadlock, a slot released before it is read, a slot
read before its copy landed) fails here, in the partition order that exposes it. What these
tests rely on about Triton's lowering (one arrival per partition for ``mbarrier.arrive``, one
per thread for ``cp.async.mbarrier.arrive.noinc``) is checked in the compiled PTX too."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.markers import needs_gluon

pytestmark = [pytest.mark.slow, needs_gluon]

BLOCK = 32


def compiled_ring(depth: int, mistake: int) -> object:
    from helpers.gluon_on_cpu import compile_sm90
    from helpers.ring_kernels import ring_sum_kernel

    signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", "steps": "i32"}
    constexprs = {"BLOCK": BLOCK, "DEPTH": depth, "MISTAKE": mistake}
    return compile_sm90(ring_sum_kernel, signature, constexprs, 4, {"x_ptr", "out_ptr"})


def run_ring(steps: int, depth: int, mistake: int = 0, default_first: bool = False) -> torch.Tensor:
    from helpers.ttgir_interpreter import Kernel

    kernel = Kernel.from_ttgir(compiled_ring(depth, mistake).asm["ttgir"])
    kernel.default_partition_first = default_first
    # small integers: the fp32 sums are exact in any order
    x = torch.arange(steps * BLOCK, dtype=torch.float32) % 7 + torch.arange(steps * BLOCK) // BLOCK
    out = torch.zeros(BLOCK)
    kernel.launch((1,), [x, out, steps])
    return out - x.reshape(steps, BLOCK).sum(0)


@settings(max_examples=6, deadline=None)
@given(steps=st.integers(1, 9), depth=st.sampled_from([2, 3]), default_first=st.booleans())
def test_a_correct_ring_sums_every_block_in_either_partition_order(steps, depth, default_first):
    assert run_ring(steps, depth, default_first=default_first).abs().max() == 0


def test_an_empty_barrier_counting_one_arrival_per_consumer_thread_deadlocks():
    from helpers.ttgir_interpreter import Deadlock

    with pytest.raises(Deadlock, match="partition 1 waits for the phase of parity"):
        run_ring(steps=5, depth=2, mistake=1)
    # no wrap of the ring, no wait on a refill: the same counts finish
    assert run_ring(steps=2, depth=2, mistake=1).abs().max() == 0


def test_a_slot_released_before_it_is_read_is_refilled_first():
    assert run_ring(steps=5, depth=2, mistake=2).abs().max() > 0


def test_a_consumer_that_does_not_wait_for_the_copies_is_caught():
    """Run before the producer, it reads slots no copy has filled, and its releases move the
    ``empty`` phases on before the producer waits on them, so the producer then waits for a
    phase that never completes. Run after it, it happens to read landed data (as it may on a
    GPU): which order a GPU takes is not fixed, so the default-first order is the one to test."""
    from helpers.ttgir_interpreter import Deadlock

    with pytest.raises(Deadlock, match="partition 1 waits"):
        run_ring(steps=2, depth=2, mistake=3, default_first=True)
    assert run_ring(steps=2, depth=2, mistake=3).abs().max() == 0


def test_the_arrivals_are_those_of_tritons_lowering():
    """``mbarrier.arrive`` of a partition: a barrier of its warps, then one predicated thread;
    ``cp.async.mbarrier.arrive.noinc``: every thread of the producer warp."""
    ptx = compiled_ring(2, 0).asm["ptx"]
    assert re.search(r"bar\.sync\s+\d+, 128;\s*(?://.*\s*)*@%p\d+ mbarrier\.arrive\.shared::cta\.b64", ptx)
    assert re.search(r"^\s*cp\.async\.mbarrier\.arrive\.noinc\.shared\.b64", ptx, re.MULTILINE)
