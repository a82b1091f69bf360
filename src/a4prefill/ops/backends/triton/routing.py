"""Routing of the ``triton`` backend: a call's routes sorted by expert on the GPU, no host sync.

Routing layout shared by the kernels: routes ``r = t * top_k + j`` are sorted by expert into
``sorted_route [R]``; expert ``e`` owns sorted positions ``[seg_start[e], seg_start[e] +
seg_count[e])``; GEMM tile ``i < num_tiles[0]`` covers ``BLOCK_M`` sorted positions from
``tile_row[i]`` of expert ``tile_expert[i]``. Routes with an expert id outside ``[0, E)`` sit in
no tile and are ignored. The tile table is sized by an upper bound (``cdiv(R, BLOCK_M) + min(E,
R)`` tiles); one Triton program (``shared_kernels.route_prep_kernel``) sorts up to
:data:`SMALL_ROUTING_MAX` routes, three chunked kernels (``route_count_kernel``,
``route_offsets_kernel``, ``route_place_kernel``: :data:`CHUNK_ROUTES` routes per program) more.
The torch path (``sort``, ``scatter_add_``, ``cumsum``; ``force_torch``) is the kernels' oracle
in the tests. All three are stable: routes of one expert keep their route order.

Who may call: :mod:`fused` (every call, as its :class:`~a4prefill.ops.backends.triton.plan.CallPlan`
says), :mod:`plan` (:func:`routing_launch`), tests and benchmarks (:func:`build_routing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a4prefill.ops.backends.triton import kernel_modules
from a4prefill.ops.backends.triton.schedules import cdiv, next_pow2

# Routes sorted by the one-program Triton kernel; the chunked kernels sort more. H200
# (benchmarks/results/bench_routing.json, 2026-12-04, CUDA graph, L2 flushed): the one-program
# kernel 11.4 / 18.6 / 51.5 us at 1024 / 2048 / 4096 routes (16 warps), the chunked kernels 17.8 /
# 18.0 / 18.3 us, and 18.4 / 21.9 / 34.4 at 8192 / 32768 / 131072 routes against 165 / 160 / 188
# for the torch path they replace.
SMALL_ROUTING_MAX = 2048
# Its warps: 4 up to ROUTE_PREP_WIDE_ROUTES routes, 16 above (benchmarks/results/bench_routing.json,
# H200: 4 warps are fastest up to 512 routes, 16 take 11.6 / 18.3 / 50.1 us at 1024 / 2048 / 4096
# routes against 4 warps' 14.4 / 35.7 / 108.9 us).
ROUTE_PREP_WARPS, ROUTE_PREP_WIDE_WARPS, ROUTE_PREP_WIDE_ROUTES = 4, 16, 512
CHUNK_ROUTES = 1024  # routes per program of the chunked kernels
CHUNK_WARPS = 4  # warps of the chunked kernels' programs (the offsets kernel: one program, 8)


@dataclass(frozen=True)
class Routing:
    """Routes sorted by expert on the device (all int32), in the layout of this module's docstring."""

    sorted_route: torch.Tensor  # [R]
    seg_start: torch.Tensor  # [E]
    seg_count: torch.Tensor  # [E]
    tile_expert: torch.Tensor  # [max_tiles + 1]
    tile_row: torch.Tensor  # [max_tiles + 1]
    num_tiles: torch.Tensor  # [1]
    max_tiles: int

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """The routing arguments of the GEMM kernels, in their parameter order."""
        return (
            self.sorted_route,
            self.tile_expert,
            self.tile_row,
            self.seg_start,
            self.seg_count,
            self.num_tiles,
        )


def _routing_torch(ids: torch.Tensor, experts: int, block_m: int, max_tiles: int) -> Routing:
    device = ids.device
    routes = ids.numel()
    key = torch.where((ids >= 0) & (ids < experts), ids, experts).to(torch.int64)
    sorted_key, order = torch.sort(key, stable=True)
    hist = torch.zeros(experts + 1, dtype=torch.int64, device=device)
    hist.scatter_add_(0, key, torch.ones_like(key))
    count = hist[:experts]
    start = torch.cumsum(count, 0) - count
    tiles = (count + block_m - 1) // block_m
    tile_start = torch.cumsum(tiles, 0) - tiles
    position = torch.arange(routes, device=device)
    safe = sorted_key.clamp(max=experts - 1)
    local = position - start[safe]
    tile = tile_start[safe] + local // block_m
    is_start = (sorted_key < experts) & (local % block_m == 0)
    tile = torch.where(is_start, tile, max_tiles)
    tile_expert = torch.zeros(max_tiles + 1, dtype=torch.int64, device=device).scatter_(0, tile, sorted_key)
    tile_row = torch.zeros(max_tiles + 1, dtype=torch.int64, device=device).scatter_(0, tile, position)
    i32 = torch.int32
    return Routing(
        order.to(i32),
        start.to(i32),
        count.to(i32),
        tile_expert.to(i32),
        tile_row.to(i32),
        tiles.sum().reshape(1).to(i32),
        max_tiles,
    )


@dataclass(frozen=True)
class RoutingLaunch:
    """How :func:`build_routing` sorts a call's routes: ``block_m`` routes per tile; the
    one-program kernel with ``program_routes`` (its ``R_BLOCK``, a power of two) and ``warps``;
    or the chunked kernels with ``chunk_routes`` routes per program (a power of two; the chunk
    count is a runtime argument, so one compile serves every route count); or torch ops when
    both are 0."""

    block_m: int
    program_routes: int
    warps: int
    chunk_routes: int = 0

    def __post_init__(self) -> None:
        if self.program_routes and self.chunk_routes:
            raise ValueError(
                f"RoutingLaunch: program_routes={self.program_routes} and chunk_routes="
                f"{self.chunk_routes} both set; a call sorts with one kernel or the other"
            )


def routing_launch(
    routes: int, block_m: int, force_torch: bool = False, warps: int | None = None
) -> RoutingLaunch:
    """The :class:`RoutingLaunch` of ``routes`` routes in ``block_m``-route tiles: the one-program
    kernel up to :data:`SMALL_ROUTING_MAX` routes (``warps`` default: :data:`ROUTE_PREP_WARPS`, or
    :data:`ROUTE_PREP_WIDE_WARPS` above :data:`ROUTE_PREP_WIDE_ROUTES` routes;
    ``benchmarks/bench_routing.py`` times 4, 8 and 16), the chunked kernels above
    (:data:`CHUNK_ROUTES` routes, :data:`CHUNK_WARPS` warps per program), torch ops with
    ``force_torch``."""
    if force_torch:
        return RoutingLaunch(block_m, 0, 0)
    if routes > SMALL_ROUTING_MAX:
        return RoutingLaunch(block_m, 0, CHUNK_WARPS, CHUNK_ROUTES)
    default = ROUTE_PREP_WIDE_WARPS if routes > ROUTE_PREP_WIDE_ROUTES else ROUTE_PREP_WARPS
    return RoutingLaunch(block_m, max(16, next_pow2(routes)), warps or default)


def build_routing(
    topk_ids: torch.Tensor, experts: int, block_m: int, force_torch: bool = False, warps: int | None = None
) -> Routing:
    """Sort the routes of ``topk_ids [T, k]`` (int32) by expert on the device (no host sync), as
    :func:`routing_launch` says for ``block_m``, ``force_torch`` and ``warps``."""
    ids = topk_ids.reshape(-1)
    return sort_routes(ids, experts, routing_launch(ids.numel(), block_m, force_torch, warps))


def sort_routes(ids: torch.Tensor, experts: int, launch: RoutingLaunch) -> Routing:
    """:func:`build_routing` of the flat route ids ``ids [R]`` by ``launch``."""
    routes = ids.numel()
    max_tiles = cdiv(routes, launch.block_m) + min(experts, routes)
    if not (launch.program_routes or launch.chunk_routes):
        return _routing_torch(ids, experts, launch.block_m, max_tiles)
    device = ids.device
    i32 = torch.int32
    routing = Routing(
        torch.empty(routes, dtype=i32, device=device),
        torch.empty(experts, dtype=i32, device=device),
        torch.empty(experts, dtype=i32, device=device),
        torch.empty(max_tiles + 1, dtype=i32, device=device),
        torch.empty(max_tiles + 1, dtype=i32, device=device),
        torch.empty(1, dtype=i32, device=device),
        max_tiles,
    )
    if launch.chunk_routes:
        _sort_in_chunks(ids, experts, launch, routing)
        return routing
    kernel_modules.shared().route_prep_kernel[(1,)](
        ids,
        routing.sorted_route,
        routing.seg_start,
        routing.seg_count,
        routing.tile_expert,
        routing.tile_row,
        routing.num_tiles,
        routes,
        experts,
        BLOCK_M=launch.block_m,
        R_BLOCK=launch.program_routes,
        E_BLOCK=next_pow2(experts + 1),
        num_warps=launch.warps,
    )
    return routing


def _sort_in_chunks(ids: torch.Tensor, experts: int, launch: RoutingLaunch, routing: Routing) -> None:
    """Fill ``routing`` (allocated by :func:`sort_routes`) with the chunked kernels: per chunk of
    ``launch.chunk_routes`` routes its counts by expert, the prefix sums over chunks and experts
    in one program, then per chunk its stable sort placed at its offsets (``shared_kernels``)."""
    routes, kernels = ids.numel(), kernel_modules.shared()
    chunks, keys = cdiv(routes, launch.chunk_routes), next_pow2(experts + 1)
    scratch = torch.empty((chunks + 2, keys), dtype=torch.int32, device=ids.device)
    sizes = {"CH": launch.chunk_routes, "E_BLOCK": keys, "num_warps": launch.warps}
    kernels.route_count_kernel[(chunks,)](ids, scratch, routes, experts, **sizes)
    kernels.route_offsets_kernel[(1,)](
        scratch,
        routing.seg_start,
        routing.seg_count,
        routing.num_tiles,
        chunks,
        experts,
        BLOCK_M=launch.block_m,
        E_BLOCK=keys,
        C_TILE=8,
        num_warps=2 * launch.warps,
    )
    kernels.route_place_kernel[(chunks,)](
        ids,
        scratch,
        routing.sorted_route,
        routing.tile_expert,
        routing.tile_row,
        routes,
        experts,
        chunks,
        BLOCK_M=launch.block_m,
        **sizes,
    )
