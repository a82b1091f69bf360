"""The ``triton`` backend: grouped NVFP4 MoE GEMMs in Triton on any CUDA GPU.

Per call (``T`` tokens, top-k ``k``, ``R = T * k`` routes, weights as loaded, no second copy):

1. routing on the GPU (:func:`build_routing`): routes sorted by expert id, per-expert segments
   and a tile table sized by an upper bound (``cdiv(R, BLOCK_M) + min(E, R)`` tiles); one Triton
   program for ``R <= 4096``, torch ops (``sort``, ``scatter_add_``, ``cumsum``) above;
2. A4 rows only: one pass quantizes ``hidden_states`` with the shared ``gs1`` to
   ``e2m1 * block_scale`` (bit-exact with :func:`a4prefill.ops.nvfp4.quantize_codes`);
3. FC1 + SwiGLU (+ per-expert re-quantization of A4 rows with ``gs2[e]``) -> ``h [R, I]``;
4. FC2 -> ``y [R, H]`` (one row per route), then a weighted top-k sum -> ``[T, H]``.

Weights are dequantized inside the kernels (``e2m1 * e4m3`` is exact in bf16/fp16), ``tl.dot``
accumulates in fp32 and the global scales (``alpha1``, ``alpha2``) are applied in the epilogue
with the io-dtype rounding points of :mod:`a4prefill.ops.reference`. Everything is launched
without a host sync and with sizes that depend only on input sizes, so it is CUDA-graph safe.

Calls with bf16 activations (W4A16, A4 or split) and on average at most
:data:`DECODE_MAX_ROWS_PER_EXPERT` routes per active expert (decode sizes) run steps 3 and 4's
GEMMs in :mod:`triton_decode` instead (weights on the MMA's M side, codes loaded straight into
MMA registers), when the shapes fit its schedule (:class:`DecodeTiles`) and the GPU is sm_80+;
same routing, A4 quantization, combine and numerics contract.

Out-of-range expert ids (``< 0`` or ``>= E``): those routes are ignored (they contribute
nothing to the output); no error is raised, since checking would need a host sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.precision import MODE_A4, MODE_SPLIT, MODE_W4A16
from a4prefill.ops.rows import RowTypes
from a4prefill.ops.scales import A4Scales
from a4prefill.process_state import register_state

SMALL_ROUTING_MAX = 4096  # routes sorted by the one-program Triton kernel
# Its warps: 4 up to ROUTE_PREP_WIDE_ROUTES routes, 16 above (benchmarks/results/bench_routing.json,
# H200: 4 warps are fastest up to 512 routes, 16 take 11.6 / 18.3 / 50.1 us at 1024 / 2048 / 4096
# routes against 4 warps' 14.4 / 35.7 / 108.9 us).
ROUTE_PREP_WARPS, ROUTE_PREP_WIDE_WARPS, ROUTE_PREP_WIDE_ROUTES = 4, 16, 512
DECODE_MAX_ROWS_PER_EXPERT = 32  # W4A16 calls with at most this many routes per active expert (mean)


def _kernels() -> Any:
    from a4prefill.ops.backends import triton_kernels

    return triton_kernels


def _decode_kernels() -> Any:
    from a4prefill.ops.backends import triton_decode

    return triton_decode


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_k(k: int, preferred: int) -> int:
    """The largest power of two <= ``preferred`` dividing ``k`` (``k % 16 == 0``)."""
    block = preferred
    while k % block:
        block //= 2
    return block


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of one call: ``block_m`` rows per tile (shared by FC1 and FC2)."""

    block_m: int
    fc1_n: int
    fc1_k: int
    fc2_n: int
    fc2_k: int
    warps: int
    stages: int
    ptx_dequant: bool = True  # bf16 io: dequantize in inline PTX (fp16 io always uses Triton ops)
    split_k: int = 1  # > 1: K slices summed with fp32 atomics (few-route calls: more programs)
    decode: DecodeTiles | None = None  # W4A16, bf16 io, sm_80+: triton_decode's kernels instead


@dataclass(frozen=True)
class DecodeGemm:
    """Schedule of one :mod:`triton_decode` GEMM: warps per CTA (1, 2, 4 or 8), K columns per
    warp step (128, 256 or 512: the K relabelling repeats every 128 columns), what the warps
    split (``"k"``: each streams one K slice of the same weight rows, summed at the end;
    ``"rows"``: each streams all of K for its own rows), weight rows per warp (16 or 32: one or
    two MMA tiles sharing each activation load) and ``prefetch``: each warp loads its next K
    step's weights before this step's MMAs (two steps in flight, about twice the registers).
    ``stages`` (2-6, not with ``prefetch``): the code words go through shared memory ``stages -
    1`` steps ahead instead. ``max_registers``: the kernels' register cap per thread
    (``maxnreg``); 0 for the compiler's choice."""

    warps: int
    block_k: int
    split: str = "k"
    rows: int = 16
    prefetch: bool = False
    stages: int = 0
    max_registers: int = 0

    def __post_init__(self) -> None:
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"DecodeGemm.warps must be 1, 2, 4 or 8, got {self.warps}")
        if self.block_k not in (128, 256, 512):
            raise ValueError(f"DecodeGemm.block_k must be 128, 256 or 512, got {self.block_k}")
        if self.split not in ("k", "rows"):
            raise ValueError(f"DecodeGemm.split must be 'k' or 'rows', got {self.split!r}")
        if self.rows not in (16, 32):
            raise ValueError(f"DecodeGemm.rows must be 16 or 32, got {self.rows}")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"DecodeGemm.prefetch must be a bool, got {self.prefetch!r}")
        if self.stages not in (0, 2, 3, 4, 6) or (self.stages and self.prefetch):
            raise ValueError(
                f"DecodeGemm.stages must be 0, 2, 3, 4 or 6 and 0 with prefetch, got {self.stages} "
                f"(prefetch={self.prefetch})"
            )
        if self.max_registers not in (0, 64, 72, 80, 96, 128, 168, 255):
            raise ValueError(
                f"DecodeGemm.max_registers must be 0 (no cap) or one of 64, 72, 80, 96, 128, 168, "
                f"255, got {self.max_registers}"
            )

    @property
    def rows_per_cta(self) -> int:
        """Output rows of one CTA (the grid's second axis is ``out_rows / rows_per_cta``)."""
        return self.rows * (self.warps if self.split == "rows" else 1)

    def fits(self, k: int, out_rows: int) -> bool:
        """Whether K and the output rows split evenly into the warps' steps and the CTAs."""
        step = self.block_k * (self.warps if self.split == "k" else 1)
        return k % step == 0 and out_rows % self.rows_per_cta == 0

    def __str__(self) -> str:
        split = "r" if self.split == "rows" else ""
        rows = "" if self.rows == 16 else f"m{self.rows}"
        staged = f"s{self.stages}" if self.stages else ""
        cap = f"R{self.max_registers}" if self.max_registers else ""
        prefetched = "p" if self.prefetch else ""
        return f"{self.warps}x{self.block_k}{split}{rows}{prefetched}{staged}{cap}"


@dataclass(frozen=True)
class DecodeTiles:
    """Schedule of :mod:`triton_decode`'s two GEMMs (FC1: K ``hidden``, ``intermediate`` rows per
    half; FC2: K ``intermediate``, ``hidden`` rows) and the routes of one expert per CTA that
    both share (``routes``: 8, 16 or 32, the MMA's N; each dequantized weight fragment feeds
    ``routes / 8`` MMAs). ``overlap`` (used on sm_90+ only): FC2 is launched as FC1's
    programmatic dependent (PDL): its CTAs start in the SMs FC1's last wave leaves idle, ask L2
    for their weights and wait for FC1's output there."""

    fc1: DecodeGemm
    fc2: DecodeGemm
    routes: int = 8
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.routes not in (8, 16, 32):
            raise ValueError(f"DecodeTiles.routes must be 8, 16 or 32, got {self.routes}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"DecodeTiles.overlap must be a bool, got {self.overlap!r}")

    def fits(self, hidden: int, intermediate: int) -> bool:
        """Whether both GEMMs split evenly; this also makes ``hidden`` and ``intermediate``
        multiples of 128, as the K relabelling needs."""
        return self.fc1.fits(hidden, intermediate) and self.fc2.fits(intermediate, hidden)

    def __str__(self) -> str:
        routes = "" if self.routes == 8 else f"_n{self.routes}"
        return f"fc1_{self.fc1}_fc2_{self.fc2}{routes}" + ("_pdl" if self.overlap else "")


# The decode kernels' schedules by call size: each the fastest of its size (or within 1% of it)
# in the `bench_moe.py --sweep decode` runs on the H200 (GLM-5.3-Flash TP2 shape, 61 schedules)
# and the `--sweep focus` runs of their variants (tables and JSON in benchmarks/results/README.md,
# "Against vLLM's Marlin NVFP4 MoE"). Rows: (most routes, most routes per active expert,
# schedule); the first row that holds a call is used.
DECODE_SCHEDULES = (
    # 1-2 tokens: both GEMMs split K over the warps (4 and 2), the next step's weights loaded
    # before this one's MMAs; FC2 starts in FC1's last wave (overlap)
    (
        16,
        4.0,
        DecodeTiles(DecodeGemm(4, 128, prefetch=True), DecodeGemm(2, 128, prefetch=True), overlap=True),
    ),
    # up to 4 routes per active expert (3-64 tokens at top-8 over 288 experts): each warp streams
    # all of K for its own rows; FC1's code words go through shared memory two steps ahead (at
    # most 128 registers: 4 CTAs per SM in A4 and split calls too), FC2's next step is
    # prefetched in registers and FC2 starts in FC1's last wave
    (
        None,
        4.0,
        DecodeTiles(
            DecodeGemm(4, 256, "rows", stages=3, max_registers=128),
            DecodeGemm(4, 128, "rows", prefetch=True),
            overlap=True,
        ),
    ),
    # up to 16 (256-512 tokens): 16-route tiles
    (None, 16.0, DecodeTiles(DecodeGemm(4, 256, "rows"), DecodeGemm(4, 128, "rows"), routes=16)),
    # up to 32 (1024 tokens): 32 weight rows per warp and 32-route tiles, prefetched
    (
        None,
        DECODE_MAX_ROWS_PER_EXPERT,
        DecodeTiles(DecodeGemm(4, 128, "rows", 32, True), DecodeGemm(4, 128, "rows", 32, True), routes=32),
    ),
)


def choose_decode_tiles(routes: int, rows_per_expert: float) -> DecodeTiles | None:
    """The :data:`DECODE_SCHEDULES` schedule of a call of ``routes`` routes with on average
    ``rows_per_expert`` routes per active expert; ``None`` above
    :data:`DECODE_MAX_ROWS_PER_EXPERT` (the tiled kernels' sizes)."""
    for max_routes, max_rows, tiles in DECODE_SCHEDULES:
        if (max_routes is None or routes <= max_routes) and rows_per_expert <= max_rows:
            return tiles
    return None


def _split_k(k: int, block_k: int, wanted: int) -> int:
    split = wanted
    while split > 1 and k % (split * block_k):
        split //= 2
    return split


def choose_config(routes: int, experts: int, hidden: int, intermediate: int) -> GemmConfig:
    """Tile sizes by the mean number of rows per active expert (decode: few, prefill: many).

    Up to :data:`DECODE_MAX_ROWS_PER_EXPERT` rows per expert, ``decode`` names the schedule of
    the decode kernels when the shapes fit them (used for W4A16 with bf16 io; the tiles are
    the fallback for other calls). Chosen from the H200 sweeps in ``benchmarks/results``
    (GLM-5.3-Flash TP2 shape).
    """
    rows_per_expert = routes / max(1, min(experts, routes))
    tiles = choose_decode_tiles(routes, rows_per_expert)
    decode = tiles if tiles is not None and tiles.fits(hidden, intermediate) else None
    if rows_per_expert <= 24:
        if routes <= 16:  # about one token: longer K steps keep more bytes in flight
            return GemmConfig(
                16, 32, _block_k(hidden, 256), 64, _block_k(intermediate, 256), 4, 3, decode=decode
            )
        return GemmConfig(16, 32, _block_k(hidden, 128), 64, _block_k(intermediate, 128), 2, 4, decode=decode)
    if rows_per_expert <= 96:
        return GemmConfig(64, 64, _block_k(hidden, 64), 128, _block_k(intermediate, 64), 4, 3, decode=decode)
    return GemmConfig(128, 64, _block_k(hidden, 64), 128, _block_k(intermediate, 64), 8, 3)


def decode_kernels_run(device: torch.device) -> bool:
    """Whether :mod:`triton_decode` can run on ``device``: an NVIDIA GPU with bf16 ``mma.sync``
    (sm_80+) and a Triton whose Gluon has what the kernels use (the module imports)."""
    if torch.version.hip is not None or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return _decode_kernels_import()


def grid_dependencies_run(device: torch.device) -> bool:
    """Whether ``device`` runs programmatic dependent launches (``griddepcontrol``, sm_90+): what
    ``DecodeTiles.overlap`` needs; elsewhere those schedules launch FC2 after FC1 as usual."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


@functools.cache
def _decode_kernels_import() -> bool:
    try:
        _decode_kernels()
    except (ImportError, AttributeError):
        return False
    return True


register_state(__name__, _decode_kernels_import.cache_clear, _decode_kernels_import)


def _check_decode_call(schedule: DecodeTiles, hidden: int, intermediate: int, routes: int) -> None:
    """Reject a ``GemmConfig.decode`` the call's shapes cannot take (the kernels' int32 offsets
    need ``routes * max(hidden, intermediate) < 2**31``)."""
    if not schedule.fits(hidden, intermediate):
        raise ValueError(
            f"config.decode={schedule!r} does not split hidden={hidden} and intermediate={intermediate} "
            "evenly (DecodeGemm.fits: K by the warps' steps, the output rows by the CTAs' rows)"
        )
    if routes * max(hidden, intermediate) >= 2**31:
        raise ValueError(
            f"config.decode: {routes} routes x {max(hidden, intermediate)} columns exceed the decode "
            "kernels' int32 offsets; use the tiled kernels (decode=None) for calls this large"
        )


@dataclass(frozen=True)
class Routing:
    """Routes sorted by expert on the device (all int32); see :mod:`triton_kernels`."""

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
    one-program kernel with ``program_routes`` (its ``R_BLOCK``, a power of two) and ``warps``,
    or torch ops when ``program_routes`` is 0."""

    block_m: int
    program_routes: int
    warps: int


def routing_launch(
    routes: int, block_m: int, force_torch: bool = False, warps: int | None = None
) -> RoutingLaunch:
    """The :class:`RoutingLaunch` of ``routes`` routes in ``block_m``-route tiles: the one-program
    kernel up to :data:`SMALL_ROUTING_MAX` routes (``warps`` default: :data:`ROUTE_PREP_WARPS`, or
    :data:`ROUTE_PREP_WIDE_WARPS` above :data:`ROUTE_PREP_WIDE_ROUTES` routes;
    ``benchmarks/bench_routing.py`` times 4, 8 and 16), torch ops above or with ``force_torch``."""
    if force_torch or routes > SMALL_ROUTING_MAX:
        return RoutingLaunch(block_m, 0, 0)
    default = ROUTE_PREP_WIDE_WARPS if routes > ROUTE_PREP_WIDE_ROUTES else ROUTE_PREP_WARPS
    return RoutingLaunch(block_m, max(16, _next_pow2(routes)), warps or default)


def build_routing(
    topk_ids: torch.Tensor, experts: int, block_m: int, force_torch: bool = False, warps: int | None = None
) -> Routing:
    """Sort the routes of ``topk_ids [T, k]`` (int32) by expert on the device (no host sync), as
    :func:`routing_launch` says for ``block_m``, ``force_torch`` and ``warps``."""
    ids = topk_ids.reshape(-1)
    return _sort_routes(ids, experts, routing_launch(ids.numel(), block_m, force_torch, warps))


def _sort_routes(ids: torch.Tensor, experts: int, launch: RoutingLaunch) -> Routing:
    """:func:`build_routing` of the flat route ids ``ids [R]`` by ``launch``."""
    routes = ids.numel()
    max_tiles = _cdiv(routes, launch.block_m) + min(experts, routes)
    if not launch.program_routes:
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
    _kernels().route_prep_kernel[(1,)](
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
        E_BLOCK=_next_pow2(experts + 1),
        num_warps=launch.warps,
    )
    return routing


def quantize_rows(
    x: torch.Tensor,
    encode_scale: torch.Tensor,
    row_flags: torch.Tensor | None = None,
    write_codes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Quantize ``x [T, H]`` (bf16/fp16) with the one-element fp32 ``encode_scale`` on the GPU.

    Returns ``e2m1 * block_scale`` in ``x.dtype`` ([T, H]; rows whose ``row_flags`` [T] entry is
    0 are copied unchanged) and, with ``write_codes``, packed codes uint8 [T, H/2] and block
    scales float8_e4m3fn [T, H/16] (bit-exact with :func:`a4prefill.ops.nvfp4.quantize`).
    """
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    codes = scales = None
    if write_codes:
        codes = torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(tokens, hidden // 16, dtype=torch.uint8, device=x.device)
    if tokens:
        block_h = min(256, _next_pow2(hidden))
        grid = (_cdiv(tokens, 16), _cdiv(hidden, block_h))
        _kernels().quantize_rows_kernel[grid](
            x,
            out,
            codes if codes is not None else out,
            scales if scales is not None else out,
            row_flags if row_flags is not None else out,
            encode_scale,
            tokens,
            hidden,
            MODE=MODE_A4 if row_flags is None else MODE_SPLIT,
            WRITE_CODES=write_codes,
            BT=16,
            BH=block_h,
            num_warps=4,
        )
    return out, codes, None if scales is None else scales.view(torch.float8_e4m3fn)


@dataclass(frozen=True)
class CallPlan:
    """What one :func:`fused_moe` call launches, apart from its precision mode and its sizes: the
    tiles (``config``), whether the decode kernels run (``decode``: their schedule, else None and
    the tiled kernels run), how the routes are sorted, the bf16 PTX dequantization, the split-K
    factors of FC1 and FC2 and whether FC2 overlaps FC1. A function of the call's shapes, io
    dtype and device only (:func:`plan_call`): two calls with equal plans and modes compile and
    launch the same kernels, which is what :func:`a4prefill.ops.backends.triton_warmup.warm_up`
    relies on."""

    config: GemmConfig
    decode: DecodeTiles | None
    routing: RoutingLaunch
    ptx: bool
    split_k: tuple[int, int]
    overlap: bool


def plan_call(
    tokens: int,
    top_k: int,
    experts: int,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    device: torch.device,
    config: GemmConfig | None = None,
) -> CallPlan:
    """The :class:`CallPlan` of a call of ``tokens`` tokens (top-``top_k``) on a layer of
    ``experts`` experts (``hidden``, ``intermediate``) with ``dtype`` io on ``device`` (a CUDA
    device when the decode kernels may run); ``config`` overrides :func:`choose_config`. Raises
    ``ValueError`` for a ``config.decode`` the shapes cannot take."""
    routes = tokens * top_k
    cfg = config or choose_config(routes, experts, hidden, intermediate)
    if cfg.decode is not None:
        _check_decode_call(cfg.decode, hidden, intermediate, routes)
    decode = cfg.decode if cfg.decode is not None and dtype == torch.bfloat16 else None
    if decode is not None and decode_kernels_run(device):
        overlap = decode.overlap and grid_dependencies_run(device)
        return CallPlan(cfg, decode, routing_launch(routes, decode.routes), False, (1, 1), overlap)
    # bf16 bit tricks need the bf16 exponent range; fp16 io uses the fp32 variant.
    ptx = cfg.ptx_dequant and dtype == torch.bfloat16
    split_k = (_split_k(hidden, cfg.fc1_k, cfg.split_k), _split_k(intermediate, cfg.fc2_k, cfg.split_k))
    return CallPlan(cfg, None, routing_launch(routes, cfg.block_m), ptx, split_k, False)


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy where its data is not 16-byte aligned: the kernels are compiled (and
    warmed up) for aligned pointers, as the Triton launcher specializes them."""
    return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()


def fused_moe(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: NvFp4Experts,
    a4_scales: A4Scales | None,
    swiglu_limit: float | None,
    row_flags: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The MoE on ``hidden_states [T, H]``: W4A16 (``a4_scales`` None), A4, or per row
    (``row_flags`` uint8 [T], 1 = A4) when both are given. Returns ``[T, H]`` in the io dtype.

    The router outputs reach the kernels as fp32 weights and int32 ids whatever their dtypes
    (exact: the weights are applied in fp32, ids are below ``E``), and unaligned inputs as
    aligned copies: the kernels a call launches depend on its :class:`CallPlan` and mode only."""
    tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = experts.w13_weight.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    routes = tokens * top_k
    output = torch.empty_like(hidden_states)
    if tokens == 0:
        return output
    hidden_states = _aligned(hidden_states)
    topk_weights = _aligned(topk_weights.to(torch.float32))
    topk_ids = _aligned(topk_ids.to(torch.int32))
    kernels = _kernels()
    plan = plan_call(
        tokens, top_k, num_experts, hidden, inter, hidden_states.dtype, hidden_states.device, config
    )
    cfg = plan.config
    if a4_scales is None:
        mode, fc1_input = MODE_W4A16, hidden_states
        gs1 = gs2 = experts.w2_weight_scale_2  # unused
    else:
        mode = MODE_A4 if row_flags is None else MODE_SPLIT
        gs1, gs2 = a4_scales.fc1_encode_scale, a4_scales.fc2_encode_scales
        fc1_input, _, _ = quantize_rows(hidden_states, gs1, row_flags)
    if plan.decode is not None:
        return _fused_moe_decode(
            fc1_input,
            topk_weights,
            topk_ids,
            experts,
            swiglu_limit,
            (plan.decode, plan.routing, plan.overlap),
            output,
            mode,
            (gs1, gs2),
            row_flags,
        )
    routing = _sort_routes(topk_ids.reshape(-1), num_experts, plan.routing)
    ptx = plan.ptx
    flags = row_flags if row_flags is not None else routing.seg_count  # unused unless MODE_SPLIT
    w13_scale = experts.w13_weight_scale.view(torch.uint8)
    w2_scale = experts.w2_weight_scale.view(torch.uint8)
    h = torch.empty(routes, inter, dtype=hidden_states.dtype, device=hidden_states.device)
    limit = float(swiglu_limit or 0.0)
    common = routing.kernel_args()
    split1, split2 = plan.split_k
    f32 = torch.float32
    device = hidden_states.device
    acc1 = torch.zeros(routes, two_i, dtype=f32, device=device) if split1 > 1 else h
    scalars = (gs1, gs2, flags)
    fc1_grid = (routing.max_tiles, _cdiv(inter, cfg.fc1_n), split1)
    kernels.fc1_kernel[fc1_grid](
        fc1_input,
        experts.w13_weight,
        w13_scale,
        experts.w13_weight_scale_2,
        *scalars,
        *common,
        h,
        hidden,
        inter,
        top_k,
        limit,
        HAS_LIMIT=swiglu_limit is not None,
        MODE=mode,
        BM=cfg.block_m,
        BN=cfg.fc1_n,
        BK=cfg.fc1_k,
        PTX=ptx,
        SPLIT_K=split1,
        acc_ptr=acc1,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    if split1 > 1:
        kernels.fc1_finalize_kernel[fc1_grid[:2]](
            acc1,
            experts.w13_weight_scale_2,
            *scalars,
            *common,
            h,
            inter,
            top_k,
            limit,
            HAS_LIMIT=swiglu_limit is not None,
            MODE=mode,
            BM=cfg.block_m,
            BN=cfg.fc1_n,
            PTX=ptx,
            num_warps=4,
        )
    if split2 > 1:
        y = torch.zeros(routes, hidden, dtype=f32, device=device)
    else:
        y = torch.empty(routes, hidden, dtype=hidden_states.dtype, device=device)
    kernels.fc2_kernel[(routing.max_tiles, _cdiv(hidden, cfg.fc2_n), split2)](
        h,
        experts.w2_weight,
        w2_scale,
        experts.w2_weight_scale_2,
        gs2,
        flags,
        *common,
        y,
        hidden,
        inter,
        top_k,
        MODE=mode,
        BM=cfg.block_m,
        BN=cfg.fc2_n,
        BK=cfg.fc2_k,
        PTX=ptx,
        SPLIT_K=split2,
        acc_ptr=y,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    _combine(y, topk_weights, topk_ids, output, experts, gs2, flags, mode, split2 > 1, ptx)
    return output


def _combine(
    y: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    output: torch.Tensor,
    experts: NvFp4Experts,
    gs2: torch.Tensor,
    flags: torch.Tensor,
    mode: int,
    from_acc: bool,
    ptx: bool,
) -> None:
    """``output [T, H] = sum_j topk_weights[:, j] * y[route]`` (:func:`triton_kernels.combine_kernel`;
    ``y`` fp32 split-K sums when ``from_acc``, else io rows; ``gs2``/``flags`` read for A4 only)."""
    tokens, hidden = output.shape
    block_h = min(1024, _next_pow2(hidden))
    _kernels().combine_kernel[(tokens, _cdiv(hidden, block_h))](
        y,
        topk_weights,
        topk_ids,
        output,
        experts.w2_weight_scale_2,
        gs2,
        flags,
        hidden,
        experts.w13_weight.shape[0],
        topk_ids.shape[1],
        FROM_ACC=from_acc,
        MODE=mode,
        PTX=ptx,
        BH=block_h,
        num_warps=4,
    )


def _decode_launch_args(gemm: DecodeGemm, routes: int) -> dict[str, Any]:
    """The schedule constexprs and launch options of one :mod:`triton_decode` GEMM schedule with
    ``routes``-route tiles (plain ints and bools: the kernels build their layouts from them)."""
    return {
        "WARPS": gemm.warps,
        "BK": gemm.block_k,
        "SPLIT_K": gemm.split == "k",
        "PREFETCH": gemm.prefetch,
        "STAGES": gemm.stages,
        "ROWS": gemm.rows,
        "TILE": routes,
        "num_warps": gemm.warps,
        **({"maxnreg": gemm.max_registers} if gemm.max_registers else {}),
    }


def _fused_moe_decode(
    fc1_input: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: NvFp4Experts,
    swiglu_limit: float | None,
    launch: tuple[DecodeTiles, RoutingLaunch, bool],
    output: torch.Tensor,
    mode: int,
    encode_scales: tuple[torch.Tensor, torch.Tensor],
    row_flags: torch.Tensor | None,
) -> torch.Tensor:
    """The MoE through the decode kernels (bf16 io; ``launch`` is the :class:`CallPlan`'s decode
    schedule, which fits the shapes, routing and overlap): ``fc1_input
    [T, H]`` as :func:`fused_moe` forms it (A4 rows already quantized), ``mode`` one of
    ``MODE_*``, ``encode_scales = (gs1 [1], gs2 [E])`` and ``row_flags [T]`` read only for the
    A4 rows of ``MODE_A4`` / ``MODE_SPLIT``.

    Same routing, combine and numerics as :func:`fused_moe`; FC1 and FC2 are
    :mod:`triton_decode`'s kernels on activations permuted into their K order. Writes ``output``.
    """
    decode = _decode_kernels()
    tokens, hidden = fc1_input.shape
    num_experts, two_i, _ = experts.w13_weight.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    routes = tokens * top_k
    schedule, routing_plan, overlap = launch
    routing = _sort_routes(topk_ids.reshape(-1), num_experts, routing_plan)
    device = fc1_input.device
    x = torch.empty_like(fc1_input)
    block_h = min(1024, _next_pow2(hidden))
    decode.permute_k_kernel[(tokens, _cdiv(hidden, block_h))](fc1_input, x, hidden, BH=block_h, num_warps=4)
    gs1, gs2 = encode_scales
    flags = row_flags if row_flags is not None else routing.seg_count  # unused unless MODE_SPLIT
    common = routing.kernel_args()
    h = torch.empty(routes, inter, dtype=torch.bfloat16, device=device)
    decode.fc1_decode_kernel[(routing.max_tiles, inter // schedule.fc1.rows_per_cta)](
        x,
        experts.w13_weight.view(torch.int32),
        experts.w13_weight_scale.view(torch.uint16),
        experts.w13_weight_scale_2,
        gs1,
        gs2,
        flags,
        *common,
        h,
        hidden,
        inter,
        top_k,
        routes,
        float(swiglu_limit or 0.0),
        HAS_LIMIT=swiglu_limit is not None,
        MODE=mode,
        OVERLAP=overlap,
        **_decode_launch_args(schedule.fc1, schedule.routes),
    )
    y = torch.empty(routes, hidden, dtype=torch.bfloat16, device=device)
    decode.fc2_decode_kernel[(routing.max_tiles, hidden // schedule.fc2.rows_per_cta)](
        h,
        experts.w2_weight.view(torch.int32),
        experts.w2_weight_scale.view(torch.uint16),
        experts.w2_weight_scale_2,
        gs2,
        flags,
        *common,
        y,
        hidden,
        inter,
        top_k,
        routes,
        MODE=mode,
        OVERLAP=overlap,
        launch_pdl=overlap,
        **_decode_launch_args(schedule.fc2, schedule.routes),
    )
    # y holds finished rows (FC2's epilogue applied each route's alpha2): the combine only sums
    # them, so its A4 arguments are not read
    _combine(y, topk_weights, topk_ids, output, experts, gs2, flags, MODE_W4A16, False, False)
    return output


def row_flags_for(row_types: RowTypes, device: torch.device) -> torch.Tensor:
    """uint8 [T] on ``device``: 1 for prefill rows (A4), 0 otherwise; no host sync.

    A few spans are filled on the device; many spans go through one pinned host-to-device copy.
    """
    spans = row_types.prefill
    if len(spans) <= 8 or device.type != "cuda":
        flags = torch.zeros(row_types.num_rows, dtype=torch.uint8, device=device)
        for start, end in spans:
            flags[start:end] = 1
        return flags
    host = torch.zeros(row_types.num_rows, dtype=torch.uint8)
    for start, end in spans:
        host[start:end] = 1
    return host.pin_memory().to(device, non_blocking=True)
