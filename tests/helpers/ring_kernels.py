"""Small warp-specialized Gluon kernels for the TTGIR interpreter's tests (tests only): a producer
warp ``cp.async``-copies ``steps`` blocks of ``x`` into a ring of ``DEPTH`` shared slots and
signals each through a ``ready`` mbarrier; the default partition waits for each block, adds it
to its sum and releases the slot through an ``empty`` mbarrier. ``MISTAKE`` picks one error:

- 0: none (``out = sum of the blocks``);
- 1: ``empty`` expects one arrival per consumer thread, but a partition's ``mbarrier.arrive`` is
  one arrival: the producer waits forever for the slot (a deadlock on a GPU);
- 2: the consumer releases the slot before it reads it: the producer may refill it first;
- 3: the consumer does not wait for ``ready``: it may read a slot whose copy has not landed,
  and release a slot before the producer filled it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _produce(x_ptr, ring, ready, empty, steps, BLOCK: gl.constexpr, DEPTH: gl.constexpr):
    """The worker partition (one warp): copy block ``s`` into slot ``s % DEPTH`` once the slot is
    free, then arrive on its ``ready`` barrier when the copy lands (every thread, no increment)."""
    offsets = gl.arange(0, BLOCK, layout=gl.BlockedLayout([1], [32], [1], [0]))
    for step in range(steps):
        slot = step % DEPTH
        # the slot's previous phase: its first use finds the barrier's phase of parity 1 done
        mbarrier.wait(empty.index(slot), ((step // DEPTH) & 1) ^ 1)
        _async_load(ring.index(slot), x_ptr + step * BLOCK + offsets)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)


@gluon.jit
def _consume(
    out_ptr, ring, ready, empty, steps, BLOCK: gl.constexpr, DEPTH: gl.constexpr, MISTAKE: gl.constexpr
):
    """The default partition: wait for block ``s``, add it, release its slot (``MISTAKE``: see
    the module docstring); store the sum."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    total = gl.zeros([BLOCK], gl.float32, layout=layout)
    for step in range(steps):
        slot = step % DEPTH
        if MISTAKE != 3:
            mbarrier.wait(ready.index(slot), (step // DEPTH) & 1)
        if MISTAKE == 2:
            mbarrier.arrive(empty.index(slot))
        total += ring.index(slot).load(layout)
        if MISTAKE != 2:
            mbarrier.arrive(empty.index(slot))
    gl.store(out_ptr + gl.arange(0, BLOCK, layout=layout), total)


@gluon.jit
def ring_sum_kernel(x_ptr, out_ptr, steps, BLOCK: gl.constexpr, DEPTH: gl.constexpr, MISTAKE: gl.constexpr):
    """``out [BLOCK] = sum over s < steps of x[s * BLOCK : (s + 1) * BLOCK]`` (fp32) through a
    producer warp and a ring of ``DEPTH`` slots; one program."""
    ring = gl.allocate_shared_memory(gl.float32, [DEPTH, BLOCK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DEPTH):
        mbarrier.init(ready.index(i), count=32)  # the producer warp's threads, one arrival each
        mbarrier.init(empty.index(i), count=gl.num_warps() * 32 if MISTAKE == 1 else 1)
    gl.warp_specialize(
        [
            (_consume, (out_ptr, ring, ready, empty, steps, BLOCK, DEPTH, MISTAKE)),
            (_produce, (x_ptr, ring, ready, empty, steps, BLOCK, DEPTH)),
        ],
        [1],
        [40],
    )
