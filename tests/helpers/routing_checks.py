"""Checks of the chunked routing kernels (``shared_kernels.route_count_kernel``,
``route_offsets_kernel``, ``route_place_kernel``) against the torch routing, for a process that
runs Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before Triton is imported: the
interpreter is chosen when a kernel is decorated). ``tests/test_routing_kernels_on_cpu.py`` runs
:func:`main` in such a process; a failing check raises (with hypothesis' falsifying example).

Small chunks (16 or 32 routes per program) give many chunks from few routes, so every case
crosses chunk boundaries and most end in a partial chunk."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a4prefill.ops.backends.triton.routing import Routing, RoutingLaunch, sort_routes


def chunked(ids: torch.Tensor, experts: int, block_m: int, chunk: int) -> Routing:
    """The chunked kernels' routing of ``ids`` with ``chunk`` routes per program."""
    return sort_routes(ids, experts, RoutingLaunch(block_m, 0, 4, chunk))


def assert_same_routing(got: Routing, want: Routing) -> None:
    """Sorted routes, segments, tile count and the live tiles of the table equal."""
    for name in ("sorted_route", "seg_start", "seg_count", "num_tiles"):
        assert torch.equal(getattr(got, name), getattr(want, name)), (
            name,
            getattr(got, name),
            getattr(want, name),
        )
    live = int(want.num_tiles)
    assert torch.equal(got.tile_expert[:live], want.tile_expert[:live]), "tile_expert"
    assert torch.equal(got.tile_row[:live], want.tile_row[:live]), "tile_row"


@settings(max_examples=int(os.environ.get("ROUTING_EXAMPLES", "30")), deadline=None, database=None)
@given(
    data=st.data(),
    experts=st.integers(1, 40),
    block_m=st.sampled_from([8, 16, 64]),
    chunk=st.sampled_from([16, 32]),
)
def check_drawn_ids(data: st.DataObject, experts: int, block_m: int, chunk: int) -> None:
    """Ids drawn from ``[-2, E + 2)``: out-of-range ids sit in no segment and no tile and sort
    after every expert's routes, as in the torch path. The one-program kernel
    (``route_prep_kernel``, which shares the key computation) on the same routes too."""
    ids = data.draw(st.lists(st.integers(-2, experts + 1), min_size=1, max_size=200))
    flat = torch.tensor(ids, dtype=torch.int32)
    want = sort_routes(flat, experts, RoutingLaunch(block_m, 0, 0))
    assert_same_routing(chunked(flat, experts, block_m, chunk), want)
    one_program = RoutingLaunch(block_m, max(16, 1 << (len(ids) - 1).bit_length()), 4)
    assert_same_routing(sort_routes(flat, experts, one_program), want)


def check_one_expert_across_every_chunk() -> None:
    """All 100 routes on expert 3 of 5: sorted routes 0..99 in order across 7 chunks of 16, tiles
    every 16 sorted positions."""
    got = chunked(torch.full((100,), 3, dtype=torch.int32), 5, 16, 16)
    assert torch.equal(got.sorted_route, torch.arange(100, dtype=torch.int32))
    assert got.seg_count.tolist() == [0, 0, 0, 100, 0] and got.seg_start.tolist() == [0, 0, 0, 0, 100]
    assert int(got.num_tiles) == 7
    assert got.tile_row[:7].tolist() == list(range(0, 100, 16)) and set(got.tile_expert[:7].tolist()) == {3}


def check_the_production_chunk_size() -> None:
    """The sizes calls launch: ``CHUNK_ROUTES`` routes per chunk and 288 experts (``E_BLOCK``
    512), 128-route tiles, 3000 top-8-like routes (three chunks, the last partial) with a few
    out-of-range ids."""
    from a4prefill.ops.backends.triton.routing import CHUNK_ROUTES

    generator = torch.Generator().manual_seed(3000)
    ids = torch.randint(0, 288, (3000,), generator=generator, dtype=torch.int32)
    ids[::97] = -1
    want = sort_routes(ids, 288, RoutingLaunch(128, 0, 0))
    assert_same_routing(chunked(ids, 288, 128, CHUNK_ROUTES), want)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    check_one_expert_across_every_chunk()
    check_the_production_chunk_size()
    check_drawn_ids()
    print("routing checks passed")
