"""Schedules of the ``triton`` backend: the tile sizes of the tiled kernels and the schedules of
the decode kernels, as named objects, chosen by call size. Host arithmetic only (no triton import).

- :class:`GemmConfig`: one call's tiles (``block_m`` rows per tile shared by FC1 and FC2), its
  bf16 PTX dequantization and split-K factor, and ``decode``: the decode kernels' schedule.
- :class:`DecodeGemm`, :class:`DecodeTiles`: the schedule of one decode GEMM and of the pair.
- :class:`DecodeScheduleRule`, :data:`DECODE_SCHEDULES`: the decode schedule of each call size,
  one named rule a row; :func:`choose_decode_tiles` takes the first rule that holds a call.
- :class:`PrefillGemm`, :data:`PREFILL_SCHEDULES`: the Hopper prefill GEMM's schedule and the
  named schedules the benchmark compares; :class:`PrefillTiles` and :func:`choose_prefill_tiles`:
  the pair a prefill call runs (issue 23), from :data:`PREFILL_MIN_ROWS_PER_EXPERT` routes per
  expert, 256-route tiles from :data:`WIDE_TILE_MIN_ROWS_PER_EXPERT`.
- :data:`A8_SCHEDULES` and :func:`choose_a8_schedule`: the A8 GEMMs' schedules and the one an A8
  call of a size runs (issue 28).
- :func:`choose_config`: the :class:`GemmConfig` of a call (tiles by the mean number of routes per
  active expert, and the decode schedule where the shapes fit it).

Also the block-size arithmetic of the host modules (:func:`cdiv`, :func:`next_pow2`).

Who may call: :mod:`plan` (every call's plan), :mod:`fused` (the decode kernels' launch
arguments), :mod:`fused_a8` and :mod:`warmup` (the A8 schedule of a size), :mod:`routing` and
:mod:`quantize` (block sizes), tests and benchmarks (explicit configs through
``fused_moe(..., config=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from a4prefill.ops.precision import MODE_SPLIT

DECODE_MAX_ROWS_PER_EXPERT = 32  # W4A16 calls with at most this many routes per active expert (mean)
PREFILL_MIN_ROWS_PER_EXPERT = 12  # bf16 calls on sm_90 with at least this many (mean): prefill GEMMs
WIDE_TILE_MIN_ROWS_PER_EXPERT = 160  # prefill calls with at least this many (mean): 256-route tiles
# What a prefill GEMM writes (the kernels' ``EPILOGUE`` constexpr): the raw product (benchmarks
# and tests of the GEMM core), FC1's SwiGLU, FC2's alpha by route
PREFILL_EPILOGUES = MappingProxyType({"none": 0, "swiglu": 1, "alpha": 2})


# Shared memory the warp-specialized kernel's epilogues take beside its rings: the scratch of
# their layout conversions, which Triton allocates after the rings (not reused from them). At most
# 512 bytes per route of a 128-row work item's accumulator (the A4 and split FC2, within 8 bytes:
# 68 712 of 68 720 at 32 routes; FC1's SwiGLU takes 256) and 32 KiB in all, plus 16 bytes, in
# every mode, epilogue and route tile (Triton 3.6 on the H200 and 3.9 offline). Left out of the
# estimate before 2026-12-04, 128-route tiles with 10 ring slots passed the 227 KiB check and
# failed to launch (242 856 bytes asked for).
WS_EPILOGUE_SCRATCH_BYTES = 32 * 1024 + 16
WS_EPILOGUE_SCRATCH_PER_ROUTE = 512
# An H100/H200 SM's shared memory, and what the system reserves of it per resident CTA
SM_SHARED_BYTES = 228 * 1024
CTA_RESERVED_SHARED_BYTES = 1024
# ``PrefillGemm.scale_sectors``: the steps of 64 columns whose scale bytes (4 a row each) make one
# 32-byte L2 sector of a row, copied together
SCALE_SECTOR_STEPS = 8
# The register split of the warp-specialized kernel with ``ctas_per_sm`` CTAs of 384 threads on an
# SM (65 536 registers): the launch cap per thread (``maxnreg``), the producer's and the consumer
# worker's registers (``setmaxnreg``; the default partition, the other consumer, gets the rest:
# 104 and 72). Accumulators of at most 64 and 32 routes (32 and 16 fp32 registers a thread).
WS_SHARED_SM_REGISTERS = MappingProxyType({2: (80, 40, 96), 3: (56, 32, 64)})
WS_SHARED_SM_MAX_ROUTES = MappingProxyType({2: 64, 3: 32})

# The warp-specialized kernel's ``A8`` constexpr in an A8 call (``prefill_a8_kernels``): each
# step's e4m3 weights converted into a shared buffer (the FP8 wgmma's A from shared memory), or
# into the wgmma's A registers (:attr:`PrefillGemm.a8_register_weights`)
A8_SHARED_WEIGHTS = 1
A8_REGISTER_WEIGHTS = 2


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of positive ints (grid sizes)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``; block sizes)."""
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
    decode: DecodeTiles | None = None  # W4A16, bf16 io, sm_80+: the decode kernels instead
    # bf16 io on sm_90 (explicit configs only: benchmarks and tests; choose_config leaves it None
    # and plan_call picks the prefill GEMMs by size): the Hopper prefill GEMMs instead
    prefill: PrefillTiles | None = None

    def __post_init__(self) -> None:
        if self.decode is not None and self.prefill is not None:
            raise ValueError(
                f"GemmConfig: decode={self.decode} and prefill={self.prefill} both set; a call runs "
                "the decode kernels or the prefill GEMMs, set at most one"
            )


@dataclass(frozen=True)
class DecodeGemm:
    """Schedule of one :mod:`decode_kernels` GEMM: warps per CTA (1, 2, 4 or 8), K columns per
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
    """Schedule of :mod:`decode_kernels`'s two GEMMs (FC1: K ``hidden``, ``intermediate`` rows per
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


@dataclass(frozen=True)
class DecodeScheduleRule:
    """One row of :data:`DECODE_SCHEDULES`: the decode kernels run ``tiles`` for a call of at most
    ``max_routes`` routes (None: any number) with on average at most ``max_rows_per_expert``
    routes per active expert. ``name`` says which calls those are (test ids, reports)."""

    name: str
    max_routes: int | None
    max_rows_per_expert: float
    tiles: DecodeTiles

    def holds(self, routes: int, rows_per_expert: float) -> bool:
        """Whether a call of ``routes`` routes, ``rows_per_expert`` per active expert, is this rule's."""
        fewer_routes = self.max_routes is None or routes <= self.max_routes
        return fewer_routes and rows_per_expert <= self.max_rows_per_expert


# The decode kernels' schedules by call size: each the fastest of its size (or within 1% of it)
# in the `bench_moe.py --sweep decode` runs on the H200 (GLM-5.3-Flash TP2 shape, 61 schedules)
# and the `--sweep focus` runs of their variants (tables and JSON in benchmarks/results/README.md,
# "Against vLLM's Marlin NVFP4 MoE"). One DecodeScheduleRule a row; the first rule that holds a
# call is used.
DECODE_SCHEDULES = (
    # 1-2 tokens: both GEMMs split K over the warps (4 and 2), the next step's weights loaded
    # before this one's MMAs; FC2 starts in FC1's last wave (overlap)
    DecodeScheduleRule(
        "one_or_two_tokens",
        max_routes=16,
        max_rows_per_expert=4.0,
        tiles=DecodeTiles(DecodeGemm(4, 128, prefetch=True), DecodeGemm(2, 128, prefetch=True), overlap=True),
    ),
    # up to 4 routes per active expert (3-64 tokens at top-8 over 288 experts): each warp streams
    # all of K for its own rows; FC1's code words go through shared memory two steps ahead (at
    # most 128 registers: 4 CTAs per SM in A4 and split calls too), FC2's next step is
    # prefetched in registers and FC2 starts in FC1's last wave
    DecodeScheduleRule(
        "up_to_4_per_expert",
        max_routes=None,
        max_rows_per_expert=4.0,
        tiles=DecodeTiles(
            DecodeGemm(4, 256, "rows", stages=3, max_registers=128),
            DecodeGemm(4, 128, "rows", prefetch=True),
            overlap=True,
        ),
    ),
    # up to 16 (256-512 tokens): 16-route tiles
    DecodeScheduleRule(
        "up_to_16_per_expert",
        max_routes=None,
        max_rows_per_expert=16.0,
        tiles=DecodeTiles(DecodeGemm(4, 256, "rows"), DecodeGemm(4, 128, "rows"), routes=16),
    ),
    # up to 32 (1024 tokens; on sm_90 the prefill tiles take 16 and more first,
    # choose_prefill_tiles): 32 weight rows per warp and 32-route tiles, prefetched
    DecodeScheduleRule(
        "up_to_32_per_expert",
        max_routes=None,
        max_rows_per_expert=DECODE_MAX_ROWS_PER_EXPERT,
        tiles=DecodeTiles(
            DecodeGemm(4, 128, "rows", 32, True), DecodeGemm(4, 128, "rows", 32, True), routes=32
        ),
    ),
)


def choose_decode_tiles(routes: int, rows_per_expert: float) -> DecodeTiles | None:
    """The :data:`DECODE_SCHEDULES` schedule of a call of ``routes`` routes with on average
    ``rows_per_expert`` routes per active expert (the tiles of the first rule that holds it);
    ``None`` above :data:`DECODE_MAX_ROWS_PER_EXPERT` (the tiled kernels' sizes)."""
    for rule in DECODE_SCHEDULES:
        if rule.holds(routes, rows_per_expert):
            return rule.tiles
    return None


def choose_config(routes: int, experts: int, hidden: int, intermediate: int) -> GemmConfig:
    """Tile sizes by the mean number of rows per active expert (decode: few, prefill: many).

    Up to :data:`DECODE_MAX_ROWS_PER_EXPERT` rows per expert, ``decode`` names the schedule of the
    decode kernels when the shapes fit them (bf16 io; on sm_90 the prefill tiles of
    :func:`choose_prefill_tiles` take a call of their sizes first, :func:`plan.plan_call
    <a4prefill.ops.backends.triton.plan.plan_call>`; the tiles are the fallback for other calls).
    Chosen from the H200 sweeps in ``benchmarks/results`` (GLM-5.3-Flash TP2 shape).
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


@dataclass(frozen=True)
class PrefillGemm:
    """Schedule of the Hopper prefill GEMM (:mod:`prefill_kernels`): ``weight_rows`` per CTA (the
    wgmma's M: 64, 128 or 256, one warpgroup per 64), ``routes`` of one expert per CTA (the wgmma's
    N: 64, 128 or 256, or 16, 32 with ``register_weights``; the routing's ``block_m``), K columns per
    step (``block_k``: 64 or 128) and ``depth`` ring slots of ``cp.async`` copies (3 to 8, 3 to 12
    warp-specialized: a step's code bytes, scale bytes and activation rows are copied ``depth -
    2`` steps ahead, ``depth`` warp-specialized).
    ``register_weights`` picks the kernel: weights dequantized into the wgmma's A registers
    (``grouped_w4_gemm_rs_kernel``, ``block_k`` 64 only) or into shared memory
    (``grouped_w4_gemm_kernel``). The former copies the code and scale bytes ``weight_ahead``
    steps ahead (0: ``depth - 2``, as the rows), in a ring of their own, and dequantizes into
    ``a_register_sets`` (1 or 2) sets of A registers: 1 retires each step's wgmma before the next
    step's dequantization, 2 alternates two sets with one wgmma left in flight (more registers:
    for the 256-route tiles, which have one CTA per SM anyway; ``prefill_kernels``,
    ``grouped_w4_gemm_rs_kernel``). ``wgmmas_per_step`` (1 or 2, 2 with register weights and one
    set): a step's 64 columns as that many wgmmas, each later one's A operand dequantized while
    the earlier ones run. ``register_cap`` (0, 80, 96 or 128): the register cap per thread
    (``maxnreg``) of the kernel in every precision mode, 0 for :meth:`max_registers`' default.
    ``warp_specialized`` (register weights, 128 weight rows per work item, or 256 with at most 128
    routes, no cap, routes 16 to 256): ``prefill_ws_kernels.grouped_w4_gemm_ws_kernel``,
    persistent (one program per SM, or ``ctas_per_sm``), a producer warpgroup copying ``depth``
    steps ahead and the two consumer warpgroups decoupled through mbarriers (no CTA barrier per
    step), each taking half of a work item's rows; launched with 4 warps plus its workers. There
    ``wgmmas_per_step = 2`` dequantizes each step's second half while the first half's wgmma
    runs, both retired at the step's end; ``a_register_sets = 2`` alone dequantizes the next step
    while the step's wgmma runs (``prefill_ws_kernels._mainloop_ahead``; not in A8); both
    together keep one wgmma in flight across steps, both consumer warpgroups then forming one
    8-warp partition
    (``prefill_ws_kernels._mainloop_halves``). ``ctas_per_sm`` (1, 2 or 3; more than 1 only
    warp-specialized, with two consumer partitions and an accumulator of at most 64 or 32 routes:
    :data:`WS_SHARED_SM_MAX_ROUTES`): the CTAs that share an SM, each with its own producer and
    ring, the registers split as :data:`WS_SHARED_SM_REGISTERS` says and the persistent grid that
    many times the SMs, so that more consumer warps hide each step's waits at small route tiles.
    A CTA's buffers (:attr:`shared_bytes`) must fit an H100/H200 CTA's 227 KiB of shared memory,
    and ``ctas_per_sm`` of them an SM's 228 KiB with 1 KiB reserved per CTA.
    ``a8_register_weights`` (A8 calls only: a warp-specialized schedule of 128 weight rows, 128 or
    256 routes, one A register set, one CTA per SM): each step's e4m3 weights are converted into
    the FP8 wgmma's A registers instead of a shared buffer, the activation rows' columns in
    :func:`prefill.a8_column_order <a4prefill.ops.backends.triton.prefill.a8_column_order>`
    (``prefill_a8_kernels``, module docstring); there ``wgmmas_per_step = 2`` converts a step in
    two K halves, the second while the first one's wgmmas run.
    ``a8_route_quarters`` (``a8_register_weights``, 256 routes, one wgmma per step): each step's
    converted weights multiply the tile's four quarters of 64 routes in four wgmma groups into two
    partials, each quarter promoted while the next one's wgmma runs
    (``prefill_a8_kernels.mainloop_a8_quarters``; the kernel's ``WGMMAS`` is 4).
    ``rows_by_token`` (warp-specialized): an FC1 (rows gathered by token) has the producer copy
    each tile's rows by token (``cp.async``, 16 bytes each) from ``x`` in the GEMM's column order
    (bf16: permuted once, a ``[T, K]`` copy; A8: as quantized) instead of TMA boxes of rows
    gathered before the launch (``prefill.gather_rows``, or for A8 an ``index_select``: a
    ``[routes, K]`` copy); FC2 is unchanged (the kernel's ``X_BY_TOKEN``).
    ``loads_ahead`` (warp-specialized, one A register set, W4A16 mainloop): each consumer loads
    the next step's code and scale bytes between issuing a step's wgmmas and waiting for them, so
    that their shared-memory latency runs under the tensor core's work
    (``prefill_ws_kernels._steps_loading_ahead``; with ``wgmmas_per_step = 2`` both halves of
    the step are issued before the loads).
    ``scale_sectors`` (warp-specialized, not ``a8_register_weights``; W4A16, A4 and split calls):
    the producer copies a row's scale bytes once every :data:`SCALE_SECTOR_STEPS` steps, the 32
    bytes of those steps (one L2 sector), instead of 4 bytes every step, each warp's copy
    instruction covering whole sectors of 4 rows, into a scale ring of its own
    (:attr:`scale_ring_groups` groups of those steps; ``prefill_ws_kernels._produce``). Per-step
    copies request each row's sector from L2 eight times, in instructions whose 32 lanes touch 32
    sectors: by count about half of the 512-token FC1's L2 requests (forty-first round, H100,
    Nsight Compute: L2 hit rate 68% against Humming's 15%, the ``SOLBottleneck`` rule naming L2;
    the share is counted from the copies, not measured)."""

    weight_rows: int = 128
    routes: int = 128
    block_k: int = 64
    depth: int = 4
    register_weights: bool = False
    weight_ahead: int = 0
    a_register_sets: int = 1
    wgmmas_per_step: int = 1
    register_cap: int = 0
    warp_specialized: bool = False
    ctas_per_sm: int = 1
    a8_register_weights: bool = False
    rows_by_token: bool = False
    loads_ahead: bool = False
    scale_sectors: bool = False
    a8_route_quarters: bool = False

    def __post_init__(self) -> None:
        if self.weight_rows not in (64, 128, 256):
            raise ValueError(f"PrefillGemm.weight_rows must be 64, 128 or 256, got {self.weight_rows}")
        if self.routes not in (16, 32, 64, 128, 256) or (self.routes < 64 and not self.register_weights):
            raise ValueError(
                "PrefillGemm.routes must be 64, 128 or 256 (or 16, 32 with register_weights), "
                f"got {self.routes}"
            )
        if self.block_k not in (64, 128):
            raise ValueError(f"PrefillGemm.block_k must be 64 or 128, got {self.block_k}")
        if self.register_weights and self.block_k != 64:
            raise ValueError(f"PrefillGemm.block_k must be 64 with register_weights, got {self.block_k}")
        if self.weight_ahead and (not self.register_weights or self.weight_ahead < self.depth - 2):
            raise ValueError(
                f"PrefillGemm.weight_ahead must be 0, or at least depth - 2 with register_weights, "
                f"got {self.weight_ahead}"
            )
        if self.a_register_sets not in (1, 2) or (self.a_register_sets == 2 and not self.register_weights):
            raise ValueError(
                "PrefillGemm.a_register_sets must be 1, or 2 with register_weights, "
                f"got {self.a_register_sets}"
            )
        two_sets_ok = self.a_register_sets == 1 or self.warp_specialized
        if self.wgmmas_per_step not in (1, 2) or (
            self.wgmmas_per_step == 2 and (not self.register_weights or not two_sets_ok)
        ):
            raise ValueError(
                "PrefillGemm.wgmmas_per_step must be 1, or 2 with register_weights and one A register "
                f"set (or warp_specialized), got {self.wgmmas_per_step}"
            )
        max_depth = 12 if self.warp_specialized else 8
        if not 3 <= self.depth <= max_depth:
            raise ValueError(
                f"PrefillGemm.depth must be 3 to {max_depth} (12 warp-specialized, else 8), got {self.depth}"
            )
        if self.register_cap not in (0, 80, 96, 128):
            raise ValueError(
                f"PrefillGemm.register_cap must be 0 (none), 80, 96 or 128, got {self.register_cap}"
            )
        if self.warp_specialized and not (
            self.register_weights
            and (self.weight_rows == 128 or (self.weight_rows == 256 and self.routes <= 128))
            and not self.register_cap
            and not self.weight_ahead
        ):
            raise ValueError(
                "PrefillGemm.warp_specialized needs register_weights, 128 weight rows (or 256 with at "
                f"most 128 routes), no register cap and no weight_ahead, got {self}"
            )
        if self.shared_bytes > 227 * 1024:
            raise ValueError(
                f"PrefillGemm {self} needs {self.shared_bytes} bytes of shared memory, over 227 KiB"
            )
        self._check_ctas_per_sm()
        if self.rows_by_token and not self.warp_specialized:
            raise ValueError(f"PrefillGemm.rows_by_token needs warp_specialized, got {self}")
        if self.loads_ahead and not (
            self.warp_specialized and self.a_register_sets == 1 and not self.a8_register_weights
        ):
            raise ValueError(
                "PrefillGemm.loads_ahead needs warp_specialized, one A register set and the W4A16 "
                f"mainloop (not a8_register_weights), got {self}"
            )
        if self.scale_sectors and not (self.warp_specialized and not self.a8_register_weights):
            raise ValueError(
                "PrefillGemm.scale_sectors needs warp_specialized and not a8_register_weights "
                f"(its producer stores the A8 scale bytes itself), got {self}"
            )
        if self.a8_register_weights and not (
            self.warp_specialized
            and self.weight_rows == 128
            and self.routes in (128, 256)
            and self.a_register_sets == 1
            and self.ctas_per_sm == 1
        ):
            raise ValueError(
                "PrefillGemm.a8_register_weights needs warp_specialized, 128 weight rows, 128 or 256 "
                f"routes, one A register set and one CTA per SM, got {self}"
            )
        if self.a8_route_quarters and not (
            self.a8_register_weights and self.routes == 256 and self.wgmmas_per_step == 1
        ):
            raise ValueError(
                "PrefillGemm.a8_route_quarters needs a8_register_weights, 256 routes and one wgmma per "
                f"step, got {self}"
            )

    def _check_ctas_per_sm(self) -> None:
        if self.ctas_per_sm == 1:
            return
        if self.ctas_per_sm not in WS_SHARED_SM_REGISTERS:
            raise ValueError(f"PrefillGemm.ctas_per_sm must be 1, 2 or 3, got {self.ctas_per_sm}")
        most = WS_SHARED_SM_MAX_ROUTES[self.ctas_per_sm]
        if not self.warp_specialized or self.one_consumer_partition or self.accumulator_routes > most:
            raise ValueError(
                f"PrefillGemm.ctas_per_sm={self.ctas_per_sm} needs warp_specialized with two consumer "
                f"partitions and at most {most} routes per 128 weight rows, got {self}"
            )
        per_sm = self.ctas_per_sm * (self.shared_bytes + CTA_RESERVED_SHARED_BYTES)
        if per_sm > SM_SHARED_BYTES:
            raise ValueError(
                f"PrefillGemm {self}: {self.ctas_per_sm} CTAs need {per_sm} bytes of an SM's shared "
                f"memory, over {SM_SHARED_BYTES}"
            )

    @property
    def warps(self) -> int:
        """Warps the CTA is launched with: one warpgroup (4 warps) per 64 weight rows; with
        :attr:`warp_specialized` the default partition's warpgroup (its workers add their own)."""
        if self.warp_specialized:
            return 8 if self.one_consumer_partition else 4
        return self.weight_rows // 16

    @property
    def one_consumer_partition(self) -> bool:
        """Whether the :attr:`warp_specialized` kernel runs both consumer warpgroups as one 8-warp
        partition (two A register sets and two wgmmas per step: ptxas keeps that pipeline only
        in the default partition), else as two 4-warp partitions."""
        return self.warp_specialized and self.a_register_sets == 2 and self.wgmmas_per_step == 2

    @property
    def accumulator_routes(self) -> int:
        """The routes of a 128-row tile with the same accumulator per consumer thread: ``routes``
        times ``weight_rows / 128`` (a 256-row work item's consumer holds 128 rows)."""
        return self.routes * self.weight_rows // 128

    @property
    def shared_bytes(self) -> int:
        """Bytes of the kernel's shared buffers: per ring slot a step's code bytes, scale bytes
        and bf16 activation rows, and (unless :attr:`register_weights`) 3 buffers of dequantized
        bf16 weights; with :attr:`warp_specialized` also the ring's mbarriers and
        the epilogues' scratch (:data:`WS_EPILOGUE_SCRATCH_PER_ROUTE` per accumulator route, at
        most :data:`WS_EPILOGUE_SCRATCH_BYTES`). At least what Triton allocates for the schedule's
        kernels in every mode and epilogue (checked offline, ``tests/test_triton_prefill_on_cpu.py``)."""
        rows, k = self.weight_rows, self.block_k
        weight_slot, row_slot = rows * k // 2 + rows * k // 16, self.routes * k * 2
        if self.warp_specialized:
            rings = self.depth * (weight_slot + row_slot) + 2 * self.depth * 8
            if self.scale_sectors:  # the scale bytes in a ring of their own
                rings += (self.scale_ring_groups * SCALE_SECTOR_STEPS - self.depth) * rows * k // 16
            scratch = WS_EPILOGUE_SCRATCH_PER_ROUTE * self.accumulator_routes + 16
            return rings + min(scratch, WS_EPILOGUE_SCRATCH_BYTES)
        if self.register_weights:
            return (self.weights_ahead + 1) * weight_slot + self.depth * row_slot
        return self.depth * (weight_slot + row_slot) + 3 * rows * k * 2

    def max_registers(self, mode: int) -> int:
        """The register cap per thread (``maxnreg``) of this schedule's kernel in precision mode
        ``mode`` (``precision.MODE_*``), 0 for the compiler's choice. 128 for a split call of the
        register-weights schedules of 128 weight rows and at most 128 routes, so that two CTAs of
        256 threads share an SM's 65536 registers: their W4A16 and A4 kernels compile to at most
        128 registers uncapped (capping them changes their register allocation, not measured),
        while the split FC1's epilogue (per-route flags, the select between ``h`` and its
        requantized copy) takes 145 (Triton 3.9) to 161 (Triton 3.6) uncapped, one CTA per SM.
        Capped, ptxas spills 8-24 bytes in the epilogue and none in the K loop (checked offline,
        ``tests/test_triton_prefill_on_cpu.py``). A schedule's :attr:`register_cap`, where set,
        is the cap of every mode; a :attr:`warp_specialized` one has none (``setmaxnreg`` sets
        its partitions' registers) unless it shares the SM (:attr:`ctas_per_sm`:
        :data:`WS_SHARED_SM_REGISTERS`)."""
        if self.register_cap:
            return self.register_cap
        if self.warp_specialized:  # its partitions' registers are set by setmaxnreg
            return WS_SHARED_SM_REGISTERS[self.ctas_per_sm][0] if self.ctas_per_sm > 1 else 0
        two_ctas = self.register_weights and self.weight_rows == 128 and self.routes <= 128
        return 128 if two_ctas and mode == MODE_SPLIT else 0

    @property
    def scale_ring_groups(self) -> int:
        """With :attr:`scale_sectors`, the groups of :data:`SCALE_SECTOR_STEPS` steps in the scale
        ring (the kernel's ``SCALE_GROUPS``), else 0. The producer refills a group's slot for the
        steps ``G * scale_ring_groups`` after it (``G`` the steps per group) once it waited for
        the ring slot of that step's code bytes, which the consumers released after step ``G *
        scale_ring_groups - depth`` after the group's first: that must be at least the group's
        last step, ``G - 1`` after its first, so the fewest groups with ``G * groups >= depth + G
        - 1``."""
        if not self.scale_sectors:
            return 0
        return -(-(self.depth + SCALE_SECTOR_STEPS - 1) // SCALE_SECTOR_STEPS)

    @property
    def weights_ahead(self) -> int:
        """Steps ahead that the code and scale bytes are copied."""
        return self.weight_ahead or self.depth - 2

    @property
    def a8_constexpr(self) -> int:
        """The kernel's ``A8`` constexpr of this schedule's A8 calls: :data:`A8_REGISTER_WEIGHTS`
        with :attr:`a8_register_weights`, else :data:`A8_SHARED_WEIGHTS`."""
        return A8_REGISTER_WEIGHTS if self.a8_register_weights else A8_SHARED_WEIGHTS

    def fits(self, k: int, out_rows: int) -> bool:
        """Whether K splits into steps (with :attr:`scale_sectors`, into groups of
        :data:`SCALE_SECTOR_STEPS` steps) and the output rows into CTAs."""
        group = SCALE_SECTOR_STEPS if self.scale_sectors else 1
        return k % (self.block_k * group) == 0 and out_rows % self.weight_rows == 0

    def __str__(self) -> str:
        kernel = "rs_" if self.register_weights else ""
        ahead = f"_a{self.weight_ahead}" if self.weight_ahead else ""
        sets = "_x2" if self.a_register_sets == 2 else ""
        halves = "_h2" if self.wgmmas_per_step == 2 else ""
        cap = f"_r{self.register_cap}" if self.register_cap else ""
        cap += "_ws" if self.warp_specialized else ""
        cap += f"_c{self.ctas_per_sm}" if self.ctas_per_sm > 1 else ""
        cap += "_a8rs" if self.a8_register_weights else ""
        cap += "_tok" if self.rows_by_token else ""
        cap += "_la" if self.loads_ahead else ""
        cap += "_ss" if self.scale_sectors else ""
        cap += "_q4" if self.a8_route_quarters else ""
        tile = f"w{self.weight_rows}_t{self.routes}_k{self.block_k}_d{self.depth}"
        return f"{kernel}{tile}{ahead}{sets}{halves}{cap}"


def _warp_specialized(
    routes: int,
    depth: int,
    wgmmas_per_step: int = 1,
    a_register_sets: int = 1,
    weight_rows: int = 128,
    ctas_per_sm: int = 1,
    a8_register_weights: bool = False,
    rows_by_token: bool = False,
    loads_ahead: bool = False,
    scale_sectors: bool = False,
    a8_route_quarters: bool = False,
) -> PrefillGemm:
    """The warp-specialized register-weights schedule of ``routes``-route tiles, ``depth`` ring
    slots, ``wgmmas_per_step`` wgmmas per step, ``a_register_sets``, ``weight_rows`` per work
    item, ``ctas_per_sm``, ``a8_register_weights``, ``rows_by_token``, ``loads_ahead``,
    ``scale_sectors`` and ``a8_route_quarters``."""
    return PrefillGemm(
        weight_rows,
        routes,
        depth=depth,
        register_weights=True,
        a_register_sets=a_register_sets,
        wgmmas_per_step=wgmmas_per_step,
        warp_specialized=True,
        ctas_per_sm=ctas_per_sm,
        a8_register_weights=a8_register_weights,
        rows_by_token=rows_by_token,
        loads_ahead=loads_ahead,
        scale_sectors=scale_sectors,
        a8_route_quarters=a8_route_quarters,
    )


# The prefill GEMM schedules the benchmark compares (benchmarks/bench_prefill_gemm.py). In the H200
# run of 2026-12-02 with every schedule, tree 8fa5b10 (benchmarks/results/archive/
# bench_prefill_gemm_round3.json, GLM-5.3-Flash TP2 shape), the fastest were rs_w128_t32_d4 at 512
# and 1024 tokens, rs_w128_t128_d4 at 4096, w128_t256_d4 at 8192, rs_w128_t256_d5 (FC1) and
# w128_t256_d4 (FC2) at 16384. Deeper rings (d6, a8) were slower wherever they cost a CTA per SM;
# 16-route tiles were slower than 32. The run of the fourth round (tree 7e4699f,
# bench_prefill_gemm.json: the best of these in the current tile order) kept that ranking, with
# rs_w128_t256_d4 first for FC1 at 16384. The tenth round removed 23 schedules that were slower
# in those runs and that nothing chooses (deeper rings, 64- and 256-row variants, and more of the
# weight_ahead and two-wgmma kinds); one of each kind of option stays, so that every kernel path
# keeps its tests. Their results stay in benchmarks/results/archive/. The seventeenth round added
# the warp-specialized kernel with two and three CTAs per SM for small route tiles; of those timed
# in the eighteenth (H200, 2026-12-05: 16-, 32- and 64-route tiles, two or three CTAs, one or two
# A register sets) the two that :func:`choose_prefill_tiles` takes stay, and the 16-route tiles
# with three CTAs (slower, not chosen) so that the kernel keeps a 16-route schedule under test.
# The 32-route tiles of 256 weight rows with two CTAs per SM (nineteenth round; chosen from 12 to
# 32 routes per expert since the twenty-third, after two H100 runs: ``choose_prefill_tiles``):
# the fastest of twelve small-tile schedules at 512 and 1024 tokens in W4A16 in one H200 run,
# within noise of the default in another, and 1.5-6% faster in A4 and split than the three-CTA
# 32-route tiles (benchmarks/results/README.md, "nineteenth round", item 2). With the H200's
# Triton 3.6 its kernels spill nothing in any mode; Triton 3.9 spills in its A4 and split FC2
# (offline, sm_90a; tests/test_triton_prefill_on_cpu.py).
# The 256-row work items of 128 routes as one 8-warp consumer partition (two A register sets, two
# wgmmas per step; nineteenth round; the A4 and split tiles from 64 to 160 routes per expert from
# the twenty-third round to the twenty-eighth, after one H100 run): the A4 FC1 of the two 4-warp
# partitions (``rs_w256_t128_d6_ws``) compiled to 10984 SASS instructions, two copies of the
# consumer, and lost 14% of its warp samples to instruction fetch on the H200; one partition
# compiled to 5960 (Triton 3.6, sm_90a, no spill in the K loop), as few as the 128-row A4 FC1's
# 6160. Since the twenty-sixth round's one-addition e2m1 rounding the two partitions are the
# faster form for A4 and split too (``choose_prefill_tiles``).
# The ``_tok`` forms of the defaults from 12 routes per expert (twenty-fourth round; chosen at
# every size since the twenty-fifth, after one H200 run: 2-11% faster in every mode from 512 to
# 16384 tokens, ``choose_prefill_tiles``): FC1's producer copies its rows by token
# (``rows_by_token``) instead of reading rows gathered before the launch, whose gather took 761
# of the 4000 us of a W4A16 call at 8192 tokens on the H100 (twenty-third round,
# ``benchmarks/results/archive/profile_moe_round23_h100.json``). With the H200's Triton 3.6 none
# spills more than its plain form in any mode (offline, sm_90a). The plain forms stay: the
# benchmarks' baseline, and the calls too large for the copy's int32 offsets.
# The ``_la`` forms (thirty-first round; chosen where they won on an H100, see
# ``choose_prefill_tiles``): the ``_tok`` tiles of 32 routes and of 128 routes on 256-row items
# with ``loads_ahead``. The ``_tok`` forms stay beside them as the benchmarks' baseline.
# The 32-route ``_h2`` and ``_h2_la`` forms and the 128-route ``_h2_la`` one (thirty-second
# round, candidates for 512-1024 and 4096 tokens; on an H100 in the thirty-third round they passed
# their GPU tests and were level with the ``_la`` forms or slower, so not chosen): each step as two
# wgmmas of 32 columns in each of the two consumer partitions, the second half dequantized while
# the first half's wgmma runs (one A register set, both retired at the step's end), without and
# with ``loads_ahead``. Offline (Triton 3.9, sm_90a), W4A16 FC1: at 32 routes 80 registers, no
# spill in the K loops, 241 and 246 instructions a step (``_tok`` 234, ``_la`` 243); at 128
# routes 168 registers, no spill, 244 (``_la`` 236).
# The 64-route tiles of 256 weight rows, one CTA per SM, without and with ``loads_ahead``
# (thirty-sixth round, candidates for 32-64 routes per expert, 1152-2303 tokens of the GLM TP2
# shape; not chosen after their run in the thirty-ninth round): the default there then
# (``rs_w128_t64_d6_ws_c2_tok``) runs 128-row items as two CTAs per SM, each consumer warpgroup
# 64 rows a step in 139 SASS instructions (80 registers); these give each consumer 128 rows a
# step in 238 (``_la`` 249: 168 registers, no spill; offline, Triton 3.9, sm_90a, W4A16 FC1; A4,
# split and FC2 no spill either), 14% fewer instructions per weight row, and read each
# activation row for half as many work items, with half as many consumer warps per SM to hide
# latency. The 128-route tiles made the same move at 4096 tokens and took 2674 us against 3027
# (fifteenth round, H200). Their ``_la_ss`` form (forty-seventh round, a candidate for the same
# sizes, built without a GPU, not yet timed): with the word pairs' cheaper dequantization the
# fixed part of a step weighs more, and Nsight Compute at 2048 tokens on an H100 (forty-seventh
# round, ``benchmarks/results/README.md``) had the default's FC1 execute 493 million
# instructions against Humming's 380 (FC1 1096 us against 904 at base clock). Offline (Triton
# 3.6, sm_90a, W4A16 FC1) a consumer warp's step is 233 SASS instructions for 128 weight rows
# against the default's 133 for 64, with no local memory in any mode.
# The ``_ss`` forms (``scale_sectors``; built in the forty-first round, chosen from the
# forty-second below 160 routes per expert, ``choose_prefill_tiles``): each row's scale bytes
# copied as one 32-byte sector every 8 steps. The 32-route one has 5 ring slots, not 6: its scale
# ring (16 KiB) and the A4/split FC2's epilogue scratch put two CTAs of 6 over an SM's shared
# memory; ``rs_w256_t32_d5_ws_c2_tok_la``, the earlier default's tiles with 5 slots, is its
# control (the ring depth apart from the scale copies: level with 6 slots). Nsight Compute of the
# W4A16 FC1 at 512 tokens on an H100 (forty-second round, ``benchmarks/results/README.md``): 750
# us against 837 without, L2 read sectors 59.7 against 87.7 million, L2 at 61% of its peak
# against 76%, 2.55 instructions executed a cycle against 2.31, fewer shared-store bank conflicts
# (113 against 193 thousand). ``rs_w128_t256_d4_ws_x2_h2_tok_ss``, the 256-route default's form
# (forty-second round), is the default from 160 routes per expert since the forty-third (8192 and
# 16384 tokens: 3243-3405 and 7150-7157 us against 3471-3617 and 7256-7556, H100). Half-sector
# groups (the ``_ss4`` forms, a row's 16 scale bytes every 4 steps, so that a K of 256-column
# multiples not of 512 such as an FC2 of intermediate size 768 copies in groups too; forty-third
# round) were level with the forms without on that FC2 and 2% slower where whole sectors fit
# (forty-fourth round, H100, both orders; ``benchmarks/results/README.md``): removed.
PREFILL_SCHEDULES = MappingProxyType(
    {
        "w64_t64_d6": PrefillGemm(64, 64, depth=6),
        "w128_t256_d4": PrefillGemm(128, 256, depth=4),
        "rs_w128_t64_d4": PrefillGemm(128, 64, depth=4, register_weights=True),
        "rs_w128_t64_d4_r80": PrefillGemm(128, 64, depth=4, register_weights=True, register_cap=80),
        "rs_w128_t128_d4": PrefillGemm(128, 128, depth=4, register_weights=True),
        "rs_w128_t128_d4_h2": PrefillGemm(128, 128, depth=4, register_weights=True, wgmmas_per_step=2),
        "rs_w128_t256_d4": PrefillGemm(128, 256, depth=4, register_weights=True, a_register_sets=2),
        "rs_w128_t256_d5": PrefillGemm(128, 256, depth=5, register_weights=True, a_register_sets=2),
        "rs_w128_t128_d4_a6": PrefillGemm(128, 128, depth=4, register_weights=True, weight_ahead=6),
        "rs_w128_t16_d4": PrefillGemm(128, 16, depth=4, register_weights=True),
        "rs_w128_t32_d4": PrefillGemm(128, 32, depth=4, register_weights=True),
        "rs_w64_t64_d4": PrefillGemm(64, 64, depth=4, register_weights=True),
        "rs_w256_t128_d4": PrefillGemm(256, 128, depth=4, register_weights=True),
        "rs_w128_t128_d4_ws": _warp_specialized(128, 4),
        "rs_w128_t128_d6_ws": _warp_specialized(128, 6),
        "rs_w128_t64_d6_ws": _warp_specialized(64, 6),
        "rs_w128_t256_d4_ws": _warp_specialized(256, 4),
        "rs_w128_t128_d6_ws_h2": _warp_specialized(128, 6, 2),
        "rs_w128_t256_d4_ws_h2": _warp_specialized(256, 4, 2),
        "rs_w128_t128_d6_ws_x2_h2": _warp_specialized(128, 6, 2, 2),
        "rs_w128_t256_d4_ws_x2_h2": _warp_specialized(256, 4, 2, 2),
        "rs_w128_t128_d6_ws_x2": _warp_specialized(128, 6, 1, 2),
        "rs_w256_t128_d6_ws": _warp_specialized(128, 6, weight_rows=256),
        "rs_w128_t32_d6_ws_c3": _warp_specialized(32, 6, ctas_per_sm=3),
        "rs_w128_t64_d6_ws_c2": _warp_specialized(64, 6, ctas_per_sm=2),
        "rs_w128_t16_d8_ws_c3": _warp_specialized(16, 8, ctas_per_sm=3),
        "rs_w256_t32_d6_ws_c2": _warp_specialized(32, 6, weight_rows=256, ctas_per_sm=2),
        "rs_w256_t128_d6_ws_x2_h2": _warp_specialized(128, 6, 2, 2, weight_rows=256),
        "rs_w128_t256_d4_ws_x2_h2_tok": _warp_specialized(256, 4, 2, 2, rows_by_token=True),
        "rs_w256_t128_d6_ws_tok": _warp_specialized(128, 6, weight_rows=256, rows_by_token=True),
        "rs_w256_t128_d6_ws_x2_h2_tok": _warp_specialized(128, 6, 2, 2, weight_rows=256, rows_by_token=True),
        "rs_w128_t64_d6_ws_c2_tok": _warp_specialized(64, 6, ctas_per_sm=2, rows_by_token=True),
        "rs_w256_t32_d6_ws_c2_tok": _warp_specialized(
            32, 6, weight_rows=256, ctas_per_sm=2, rows_by_token=True
        ),
        "rs_w256_t32_d6_ws_c2_tok_la": _warp_specialized(
            32, 6, weight_rows=256, ctas_per_sm=2, rows_by_token=True, loads_ahead=True
        ),
        "rs_w256_t128_d6_ws_tok_la": _warp_specialized(
            128, 6, weight_rows=256, rows_by_token=True, loads_ahead=True
        ),
        "rs_w256_t32_d6_ws_c2_tok_h2": _warp_specialized(
            32, 6, 2, weight_rows=256, ctas_per_sm=2, rows_by_token=True
        ),
        "rs_w256_t32_d6_ws_c2_tok_h2_la": _warp_specialized(
            32, 6, 2, weight_rows=256, ctas_per_sm=2, rows_by_token=True, loads_ahead=True
        ),
        "rs_w256_t128_d6_ws_tok_h2_la": _warp_specialized(
            128, 6, 2, weight_rows=256, rows_by_token=True, loads_ahead=True
        ),
        "rs_w256_t64_d6_ws_tok": _warp_specialized(64, 6, weight_rows=256, rows_by_token=True),
        "rs_w256_t64_d6_ws_tok_la": _warp_specialized(
            64, 6, weight_rows=256, rows_by_token=True, loads_ahead=True
        ),
        "rs_w256_t32_d5_ws_c2_tok_la": _warp_specialized(
            32, 5, weight_rows=256, ctas_per_sm=2, rows_by_token=True, loads_ahead=True
        ),
        "rs_w256_t32_d5_ws_c2_tok_la_ss": _warp_specialized(
            32, 5, weight_rows=256, ctas_per_sm=2, rows_by_token=True, loads_ahead=True, scale_sectors=True
        ),
        "rs_w128_t64_d6_ws_c2_tok_ss": _warp_specialized(
            64, 6, ctas_per_sm=2, rows_by_token=True, scale_sectors=True
        ),
        "rs_w256_t64_d6_ws_tok_la_ss": _warp_specialized(
            64, 6, weight_rows=256, rows_by_token=True, loads_ahead=True, scale_sectors=True
        ),
        "rs_w256_t128_d6_ws_tok_la_ss": _warp_specialized(
            128, 6, weight_rows=256, rows_by_token=True, loads_ahead=True, scale_sectors=True
        ),
        "rs_w128_t256_d4_ws_x2_h2_tok_ss": _warp_specialized(
            256, 4, 2, 2, rows_by_token=True, scale_sectors=True
        ),
    }
)


@dataclass(frozen=True)
class PrefillTiles:
    """The two Hopper prefill GEMMs of one call, in every precision mode: FC1 (SwiGLU epilogue)
    and FC2 (alpha epilogue). Both share the routing's route tiles. A schedule is a speed choice
    only: whatever the schedules, every row runs the precision of its call's mode."""

    fc1: PrefillGemm
    fc2: PrefillGemm

    def __post_init__(self) -> None:
        if self.fc1.routes != self.fc2.routes:
            raise ValueError(
                "PrefillTiles: both GEMMs of a call share the routing's tiles, "
                f"got {self.fc1.routes} and {self.fc2.routes} routes"
            )

    @property
    def routes(self) -> int:
        """Routes per tile of both GEMMs (the routing's ``block_m``)."""
        return self.fc1.routes

    def __str__(self) -> str:
        return f"fc1_{self.fc1}_fc2_{self.fc2}"

    def fits(self, hidden: int, intermediate: int) -> bool:
        """Whether FC1 (``K = hidden``, ``2 * intermediate`` rows) and FC2 (``K = intermediate``,
        ``hidden`` rows) split into the schedules' steps and CTAs."""
        return self.fc1.fits(hidden, 2 * intermediate) and self.fc2.fits(intermediate, hidden)


# The A8 rows' GEMMs (``fused_a8``, issue 28): the warp-specialized kernel's A8 mainloop on
# 128-route tiles, 6 ring slots. An A8 slot holds one 128-column block (code bytes 8 KiB, scale
# bytes 1 KiB, e4m3 rows 16 KiB and the routes' scales 0.5 KiB; ``shared_bytes`` counts bf16 slots
# of 64 columns, 20.5 KiB) plus 16 KiB of converted weights: 169 KiB in all, 201 KiB with the
# epilogue's scratch (what Triton 3.6 allocates for FC1). ``A8_PREFILL_WIDE`` (seventeenth round)
# runs 256-route tiles as two wgmmas of 128 routes on each step's converted weights
# (``prefill_a8_kernels.mainloop_a8_wide``: half the conversion per FLOP), 4 slots of 42 KiB.
# :func:`choose_a8_schedule` gives each size the faster of the two in the eighteenth round's run
# (the 128-route size ``A8_PREFILL_RS`` since the twenty-third, both sizes' ``_tok`` forms since the
# twenty-sixth: see its docstring).
# A third, ``A8_PREFILL_AHEAD`` (each step's successor converted into a second buffer while the
# step's wgmma ran, 16 KiB more), was 2-5% slower than ``A8_PREFILL`` at every size in the
# eighteenth and nineteenth rounds' runs and was removed in the twenty-first (its label ``a8_x2``
# is in the results of those runs). ``A8_PREFILL_RS`` and ``A8_PREFILL_WIDE_RS`` (twentieth
# round; timed in the twenty-third, ``A8_PREFILL_RS`` chosen): the same tiles with each step's
# e4m3 weights converted into the FP8 wgmma's A registers (``PrefillGemm.a8_register_weights``): no converted
# weights stored to and read back from shared memory, no fence and no warpgroup barrier between
# the conversion and the wgmma. Per step and SM that is 48 of the 256-route tiles' about 160 KiB
# of shared-memory traffic (16 KiB written, read by two wgmmas each) and 32 of the 128-route
# tiles' about 98 KiB. The 256-route FC1 at 8192 tokens (nineteenth round's profile): "Mem Busy"
# 58%, L1/shared throughput 61%, compute (the FP8 tensor pipe) 45%; the consumers' waits for
# their own wgmmas took 17% of the kernel's warp samples (the producer's wait for free slots 28%).
# ``A8_PREFILL_RS_H2`` and
# ``A8_PREFILL_WIDE_RS_H2`` convert each step in two K halves (each lane's two groups), the
# second while the first half's wgmmas run (as the W4A16 schedules with two wgmmas per step,
# which took A4 and split at 8192 tokens from 5140-5212 to 4295 and 3873 us in the fourteenth
# round). In all four register-weights schedules the producer stores each row's block exponent
# in the slot (twenty-first round): their consumers' K loops exchange nothing between lanes.
A8_PREFILL = _warp_specialized(128, 6)
A8_PREFILL_WIDE = _warp_specialized(256, 4)
A8_PREFILL_RS = _warp_specialized(128, 6, a8_register_weights=True)
A8_PREFILL_WIDE_RS = _warp_specialized(256, 4, a8_register_weights=True)
A8_PREFILL_RS_H2 = _warp_specialized(128, 6, wgmmas_per_step=2, a8_register_weights=True)
A8_PREFILL_WIDE_RS_H2 = _warp_specialized(256, 4, wgmmas_per_step=2, a8_register_weights=True)
# The two with FC1's rows copied by token in the producer (``rows_by_token``; twenty-fourth
# round, timed in the twenty-fifth, chosen in the twenty-sixth): no ``[routes, K]`` e4m3 gather
# before FC1.
A8_PREFILL_RS_TOK = _warp_specialized(128, 6, a8_register_weights=True, rows_by_token=True)
A8_PREFILL_WIDE_TOK = _warp_specialized(256, 4, rows_by_token=True)
# The 256-route tiles with the weights in registers, rows by token, and each step's routes as
# four wgmma groups of 64 into two partials, each quarter promoted while the next one's wgmma
# runs (``a8_route_quarters``; forty-eighth round, built without a GPU, not timed, not chosen). Why:
# in ``A8_PREFILL_WIDE_TOK`` a consumer retires each half's wgmma before promoting it, so its
# tensor-core work and its promotions alternate (the FP8 pipe 45-51% busy at 8192 tokens, 0.75
# eligible warps a scheduler, nineteenth and twenty-third rounds); two partials of 128 routes
# would take 256 fp32 registers a thread, two of 64 take 64 (with the accumulators 192, no local
# memory offline with Triton 3.6). docs/prefill-kernel-next.md, "After the forty-eighth round".
A8_PREFILL_WIDE_RS_TOK_Q4 = _warp_specialized(
    256, 4, a8_register_weights=True, rows_by_token=True, a8_route_quarters=True
)
A8_SCHEDULES = MappingProxyType(
    {
        "a8": A8_PREFILL,
        "a8_t256": A8_PREFILL_WIDE,
        "a8_rs": A8_PREFILL_RS,
        "a8_t256_rs": A8_PREFILL_WIDE_RS,
        "a8_rs_h2": A8_PREFILL_RS_H2,
        "a8_t256_rs_h2": A8_PREFILL_WIDE_RS_H2,
        "a8_rs_tok": A8_PREFILL_RS_TOK,
        "a8_t256_tok": A8_PREFILL_WIDE_TOK,
        "a8_t256_rs_tok_q4": A8_PREFILL_WIDE_RS_TOK_Q4,
    }
)


def choose_a8_schedule(routes: int, experts: int, hidden: int) -> PrefillGemm:
    """The :data:`A8_SCHEDULES` schedule of an A8 call (``fused_a8.fused_moe_a8``) of ``routes``
    routes over ``experts`` experts whose activation rows have ``hidden`` columns: 256-route tiles
    (``A8_PREFILL_WIDE_TOK``) from :data:`WIDE_TILE_MIN_ROWS_PER_EXPERT` routes per expert (mean),
    as W4A16, else 128-route tiles with each step's weights converted into the wgmma's A registers
    (``A8_PREFILL_RS_TOK``). Both copy FC1's rows by token in the producer (``rows_by_token``), as
    the W4A16 defaults do, except where ``routes * hidden`` reaches 2**31 (the copy's offsets are
    int32, the launcher refuses such an ``x``): there the forms that gather the rows first
    (``A8_PREFILL_WIDE``, ``A8_PREFILL_RS``). A speed choice only: every A8 schedule meets the
    same A8 contract (docs/numerics.md section 8; the tensor cores' accumulation order within a
    block may differ between schedules).

    The whole MoE, GLM-5.3-Flash TP2 shape, us (``benchmarks/bench_moe.py``):

    - 128 against 256 routes (H200, eighteenth round, 2026-12-05, ``A8_PREFILL`` /
      ``A8_PREFILL_WIDE``): 1703 / 2579 at 1024 tokens, 1778 / 2652 at 2048, 2037 / 2646 at 4096
      (114 routes per expert), 3825 / 3019 at 8192 (228), 7560 / 6199 at 16384;
    - converted weights in registers against shared memory at 128 routes (H100, twenty-third
      round, ``A8_PREFILL_RS`` / ``A8_PREFILL``): 1618 / 1675 at 512 tokens, 1648 / 1713 at 1024,
      2096 / 2159 at 4096, 3760 / 3946 at 8192 (the 256-route pair there: 3048 / 3147 for
      ``A8_PREFILL_WIDE_RS`` / ``A8_PREFILL_WIDE``, at 16384 6487 / 6246, the former at a
      throttled clock; not changed on one run);
    - rows copied by token against gathered (twenty-fifth round): on the H100 in two runs with the
      columns in opposite orders, ``A8_PREFILL_RS`` / ``A8_PREFILL_RS_TOK`` 1643 / 1615 and 1623 /
      1638 at 1024 tokens, 2025 / 1994 and 2039 / 1997 at 4096, ``A8_PREFILL_WIDE`` /
      ``A8_PREFILL_WIDE_TOK`` 3197 / 3090 and 3190 / 3167 at 8192; on the H200 in one run (the
      ``_tok`` columns timed last) 128 routes 1586 / 1648 at 512 tokens (the ``_tok`` column at
      1785 MHz against 1935), 1639 / 1676 at 1024, 1921 / 1710 at 2048, 1992 / 1964 at 4096, 256
      routes 3031 / 2945 at 8192, 6070 / 6302 at 16384 (power-capped, the ``_tok`` column's clock
      lower). In the H100's two runs the ``_tok`` forms win or tie at every size timed; in the
      H200's one run (``_tok`` timed last, the card's heating against it) they are 2-4% behind at
      512, 1024 and 16384 tokens and 1-11% ahead at 2048-8192."""
    # the _tok forms address x ([tokens, hidden] e4m3, tokens <= routes) by int32 offsets
    by_token = routes * hidden < 2**31
    if routes / max(1, experts) >= WIDE_TILE_MIN_ROWS_PER_EXPERT:
        return A8_PREFILL_WIDE_TOK if by_token else A8_PREFILL_WIDE
    return A8_PREFILL_RS_TOK if by_token else A8_PREFILL_RS


def _first_fitting(hidden: int, intermediate: int, *labels: str) -> PrefillTiles:
    """Each GEMM on the first of ``labels`` (:data:`PREFILL_SCHEDULES`, all of one route tile)
    whose tiles fit it (FC1: ``K = hidden``, ``2 * intermediate`` rows; FC2: ``K =
    intermediate``, ``hidden`` rows), else on the last (which :func:`choose_prefill_tiles` then
    finds not to fit)."""

    def first(k: int, out_rows: int) -> PrefillGemm:
        fitting = (PREFILL_SCHEDULES[label] for label in labels if PREFILL_SCHEDULES[label].fits(k, out_rows))
        return next(fitting, PREFILL_SCHEDULES[labels[-1]])

    return PrefillTiles(first(hidden, 2 * intermediate), first(intermediate, hidden))


def choose_prefill_tiles(routes: int, experts: int, hidden: int, intermediate: int) -> PrefillTiles | None:
    """The prefill GEMMs of a call with ``routes`` routes over ``experts`` experts (every precision
    mode), or None below :data:`PREFILL_MIN_ROWS_PER_EXPERT` routes per expert (mean) or where the
    shapes do not fit. Where the prefill kernels run, these tiles take the call before the decode
    kernels (:func:`plan.plan_call <a4prefill.ops.backends.triton.plan.plan_call>`), which keep
    the smaller calls.

    From the runs of ``benchmarks/bench_moe.py --sweep prefill`` (the whole MoE, GLM-5.3-Flash
    TP2 shape; ``benchmarks/results``; H200 unless they say H100):

    - from 12 routes per expert, below 32, the warp-specialized kernel on 32-route tiles, work
      items of 256 weight rows, two CTAs per SM (twenty-third round, 2026-12-05, two H100 runs,
      W4A16 / A4 / split in us: 512 tokens, 14 per expert, 1177 / 1206 / 1230 against the decode
      kernels' 1247 / 1269 / 1293 and 1171 / 1204 / 1228 against 1245 / 1267 / 1287; 768 tokens
      1211 / 1242 / 1270 against 1237 / 1259 / 1303 for 128-row items with three CTAs per SM,
      the choice from 16 per expert since the eighteenth round; 1024 tokens 1444 / 1481 / 1517
      against 1463 / 1528 / 1547 and 1435 / 1470 / 1498 against 1430 / 1450 / 1501; at 384
      tokens, 11 per expert, the decode kernels' 1163 / 1178 / 1193 against 1152 / 1183 / 1206;
      on the H200 in the nineteenth round 1124 against the decode kernels' 1140 at 512 and 1384
      against 1417 at 1024, W4A16; in the eighteenth the three-CTA tiles against the decode
      kernels: 768 tokens 1183 / 1209 / 1262 against 1408 / 1485 / 1519, 512 tokens 1144 against
      1115);
    - below 64, the warp-specialized kernel on 64-route tiles with two CTAs per SM (same run:
      1536 tokens 1463 / 1678 / 1526 against 1684 / 1755 / 1781 for 64-route tiles with weights
      in registers capped at 80 registers, the choice since 2026-12-03; 2048 tokens 1710 / 1964
      / 1799 against 1948 / 2018 / 2074; at 4096 tokens it took 3121 against 2237 for the
      128-route tiles below);
    - below 160, the warp-specialized kernel (TMA copies) on 128-route tiles, 6 ring slots (4096
      tokens, 114 per expert: 3160 us against 3243 for the register-weights kernel's 128-route
      tiles and 3456 for 256-route ones; 2026-12-04, eleventh round);
    - then the warp-specialized kernel on 256-route tiles, 4 ring slots (8192 tokens: 4073 us
      against 4839 for the register-weights FC1 with the shared-memory-weights FC2 on 256-route
      tiles and 5820 for 128-route warp-specialized tiles; 16384: 7843 against 8787; eleventh
      round), with two wgmmas per step (fourteenth round, 2026-12-04: W4A16 within run-to-run
      noise of one wgmma per step, 3865 against 3940-4104 us at 8192 tokens and 8148 against
      7855-8384 at 16384, while A4 took 4295 against 5140-5212 and split 3873 against
      5174-5185 at 8192, 8501 and 8466 against 10100-10173 at 16384). On 128-route tiles two
      wgmmas per step were slower (4096 tokens: 3107 against 3021 us, A4 3249 against 2861).

    Every size's FC1 copies its activation rows by token in the producer (the ``_tok`` forms,
    ``PrefillGemm.rows_by_token``; twenty-fifth round, H200, 2026-12-05, one run of each size,
    W4A16 / A4 / split in us, the form that gathers the rows before the launch against the
    ``_tok`` one): 512 tokens 1134 / 1169 / 1214 against 1099 / 1141 / 1149, 1024 1382 / 1423 /
    1458 against 1316 / 1343 / 1387, 2048 1717 / 1941 / 1840 against 1618 / 1867 / 1706, 4096
    2263 / 2599 / 2525 against 2024 / 2479 / 2337, 8192 3729 (W4A16) and 3945 (split) against
    3484 and 3526, 16384 7465 and 8256 against 7108 and 7701. At 8192 tokens the two GEMMs took
    3199 us against 2865, the gather's 603 us became a 100 us column permutation of ``x``. Where
    ``routes * hidden`` reaches 2**31 (``x`` might not fit the copy's int32 offsets) the calls
    gather as before.

    The 32-route tiles and the 256-row items of 128-route tiles load each step's code and scale
    bytes while the step before runs its wgmma (``loads_ahead``, the ``_la`` forms; thirty-first
    round, H100, 2026-12-06, one call per pair of sizes, each tree timed two or three times in
    alternating order, W4A16 us, the ``_tok`` form against the ``_la`` one): 512 tokens 1182-1192
    against 1104-1157, 1024 1387-1395 against 1323-1338, 4096 2083-2149 against 1975-2061 (A4
    2244-2367 against 2068-2231); at 2048 tokens the 64-route tiles of 128 rows took 1531-1648
    against 1600-1719 with loads ahead, so they keep the plain loop.

    Every mode's calls from 64 to 160 routes per expert run work items of 256 weight rows as two
    consumer partitions of 4 warps in each GEMM whose rows split into 256s (each activation row
    read from L2 by half as many work items as with 128 rows), and 128-row items in a GEMM whose
    rows do not. W4A16 since the fifteenth round (2026-12-04: 2674 us against 3027 at 4096 tokens;
    twenty-third round, H100: 2425 against 2482 for one 8-warp partition); A4 and split since
    the twenty-ninth (2026-12-06), once every A4 epilogue rounded to e2m1 in one addition
    (twenty-sixth round): at 4096 tokens on an H100 (twenty-eighth round, one run) A4 took 2242
    us and split 2212 as two partitions against 2530 and 2309 as one (W4A16 2159), where until
    then they had been slower as two (twenty-third round: 2995 and 2969 against 2701 and 2635).

    Every size's GEMMs, in every mode, copy each row's scale bytes once per 8 steps
    (``PrefillGemm.scale_sectors``, the ``_ss`` forms) where the rows are copied by token and
    FC1's scales stay under 2**31 bytes (below 160 routes per expert since the forty-second
    round, H100, 2026-12-07, two calls, each size's pair timed in both orders, W4A16 us, the
    forms without against the ``_ss`` ones: 512 tokens 1107-1135 against 981-994, the 32-route
    tiles on 5 ring slots without the scale change 1106-1129; 1024 1357-1380 against 1221-1235,
    2048 1580-1724 against 1521-1592, 4096 2062-2118 against 1949-2034; the 256-route tiles since
    the forty-third, H100, one call, the pair timed in both orders, W4A16 only: 8192 tokens
    3471-3617 against 3243-3405, 16384 7256-7556 against 7150-7157). Each GEMM takes the first
    form of its size that fits it (a ``_ss`` form needs K in groups of 8 steps, multiples of 512
    columns; FC1 alone on ``_ss`` at 512 tokens took 750 us against 837 in Nsight Compute), so
    with an intermediate size of 768 FC1 runs ``_ss`` and FC2 the form without (half-sector
    groups, which would fit it, were level with that form: removed); likewise a GEMM whose rows
    do not split into a form's items runs the next form."""
    rows_per_expert = routes / max(1, experts)
    if rows_per_expert < PREFILL_MIN_ROWS_PER_EXPERT:
        return None
    # the _tok forms address x ([tokens, hidden], tokens <= routes) by int32 offsets
    tok = "_tok" if routes * hidden < 2**31 else ""
    ahead = "_la" if tok else ""  # loads_ahead: timed on the _tok forms only
    # the scale_sectors (_ss) forms first (timed on _tok forms only; fits() needs K in groups of 8
    # steps; their launcher addresses FC1's scales, [experts, 2 I, H / 16], by int32 offsets),
    # then the forms without; each GEMM takes the first that fits it
    sectors = bool(tok) and experts * 2 * intermediate * hidden // 16 < 2**31
    # per size: its _ss form, then the forms without
    plain: tuple[str, ...]
    if rows_per_expert < 32:
        sectored, plain = (
            "rs_w256_t32_d5_ws_c2_tok_la_ss",
            (f"rs_w256_t32_d6_ws_c2{tok}{ahead}", "rs_w128_t32_d6_ws_c3"),
        )
    elif rows_per_expert < 64:
        sectored, plain = "rs_w128_t64_d6_ws_c2_tok_ss", (f"rs_w128_t64_d6_ws_c2{tok}",)
    elif rows_per_expert < WIDE_TILE_MIN_ROWS_PER_EXPERT:
        sectored, plain = (
            "rs_w256_t128_d6_ws_tok_la_ss",
            (f"rs_w256_t128_d6_ws{tok}{ahead}", "rs_w128_t128_d6_ws"),
        )
    else:
        sectored, plain = "rs_w128_t256_d4_ws_x2_h2_tok_ss", (f"rs_w128_t256_d4_ws_x2_h2{tok}",)
    labels = ((sectored,) if sectors else ()) + plain
    tiles = _first_fitting(hidden, intermediate, *labels)
    return tiles if tiles.fits(hidden, intermediate) else None
