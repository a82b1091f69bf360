"""Host side of the Hopper prefill GEMMs (:mod:`~a4prefill.ops.backends.triton.prefill_kernels`):
:func:`launch_prefill_gemm` launches one GEMM with its epilogue, for ``fused._fused_moe_prefill``
(prefill calls on sm_90, chosen by ``plan.plan_call``), the tests and
``benchmarks/bench_prefill_gemm.py``; :func:`mma_column_order` is the register-weights kernel's
activation column order, :func:`a8_column_order` that of the A8 register-weights schedules.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from a4prefill.ops.backends.triton import kernel_modules
from a4prefill.ops.backends.triton.routing import Routing
from a4prefill.ops.backends.triton.schedules import (
    PREFILL_EPILOGUES,
    WS_SHARED_SM_REGISTERS,
    PrefillGemm,
    cdiv,
)
from a4prefill.ops.precision import MODE_A4, MODE_SPLIT, MODE_W4A16
from a4prefill.process_state import register_state


@functools.cache
def mma_column_order(k: int, device: torch.device) -> torch.Tensor:
    """int64 ``[k]``: the column of ``x`` that each wgmma K position of
    ``grouped_w4_gemm_rs_kernel`` multiplies. Within each 64 columns, position ``8 b + 2 q + h``
    holds column ``16 q + 8 (b // 4) + b % 4 + 4 h`` (``b`` < 8, ``q`` < 4, ``h`` < 2): thread
    ``q`` of a quad then holds the 16 columns of scale group ``q``, whose 8 code bytes (two code
    words) it reads with one load, and A register ``b`` holds nibbles ``b % 4`` and ``b % 4 + 4``
    of word ``b // 4`` (``numerics.WORD_PAIR_DEQUANT_ASM``; the ModelOpt code layout is
    unchanged). ``k`` must be a multiple of 64. Cached per ``(k, device)``; never written to."""
    if k % 64:
        raise ValueError(f"k must be a multiple of 64, got {k}")
    position = torch.arange(k, device=device)
    register, quad_lane, half = (position % 64) // 8, (position % 8) // 2, position % 2
    column = 16 * quad_lane + 8 * (register // 4) + register % 4 + 4 * half
    return position - position % 64 + column


register_state(__name__, mma_column_order.cache_clear, mma_column_order)


@functools.cache
def a8_column_order(k: int, device: torch.device) -> torch.Tensor:
    """int64 ``[k]``: the column of the e4m3 activation rows that each K position of an A8 call
    of a register-weights A8 schedule (``PrefillGemm.a8_register_weights``) multiplies. Within
    each 128 columns (one A8 block), position ``32 c + 16 h + 4 q + j`` holds column ``32 q + 8 c
    + 4 h + j`` (``c`` < 4, ``h`` < 2, ``q`` < 4, ``j`` < 4): the FP8 wgmma's A registers of lane
    ``q`` of a quad then hold the 32 columns of scale groups ``2 q`` and ``2 q + 1``, the ones it
    converts (``prefill_a8_kernels``, module docstring). ``k`` must be a multiple of 128. Cached
    per ``(k, device)``; never written to."""
    if k % 128:
        raise ValueError(f"k must be a multiple of 128, got {k}")
    position = torch.arange(k, device=device)
    chunk, half, quad_lane, nibble = (
        (position % 128) // 32,
        (position % 32) // 16,
        (position % 16) // 4,
        position % 4,
    )
    return position - position % 128 + 32 * quad_lane + 8 * chunk + 4 * half + nibble


register_state(__name__, a8_column_order.cache_clear, a8_column_order)


GATHER_ROWS_PER_PROGRAM = 64  # rows of one program of shared_kernels.gather_rows_kernel (8 KiB)
# The gather's program order (``gather_rows_kernel``'s ``BLOCKS_FIRST``): True, whole rows after
# the other, was the faster in ``benchmarks/bench_gather.py``'s one run (twenty-fifth round, H200,
# hidden 4096, top-8): the gather 541 us at 8192 tokens against 615 for False (one 64-column stripe
# of every row after the other, the order of the earlier rounds), 1085 against 1214 at 16384; the
# ``[T, K]`` column permutation (one route per token) 76.5 against 93.6 us at 8192, 143 against
# 180 at 16384, 42.5 against 51.9 at 4096 (``index_select``: 97, 186, 53).
GATHER_BLOCKS_FIRST = True


def gather_rows(
    x: torch.Tensor, sorted_route: torch.Tensor, top_k: int, blocks_first: bool = GATHER_BLOCKS_FIRST
) -> torch.Tensor:
    """bf16 ``[R, K]``: row ``p`` is ``x``'s row ``sorted_route[p] // top_k`` (``x [T, K]`` bf16,
    contiguous, ``K`` a multiple of 64) with its columns in :func:`mma_column_order`, by one
    kernel (``shared_kernels.gather_rows_kernel``; no host sync). What the warp-specialized FC1's
    TMA copies read. ``blocks_first``: the kernel's program order (its ``BLOCKS_FIRST``; the same
    result either way)."""
    routes, k = sorted_route.numel(), x.shape[1]
    rows = torch.empty(routes, k, dtype=x.dtype, device=x.device)
    if routes:
        row_programs, block_programs = cdiv(routes, GATHER_ROWS_PER_PROGRAM), k // 64
        grid = (block_programs, row_programs) if blocks_first else (row_programs, block_programs)
        kernel_modules.shared().gather_rows_kernel[grid](
            x.view(torch.int32),
            sorted_route,
            rows.view(torch.int32),
            routes,
            k // 2,
            top_k,
            BR=GATHER_ROWS_PER_PROGRAM,
            BLOCKS_FIRST=blocks_first,
            num_warps=4,
        )
    return rows


def mma_ordered_rows(x: torch.Tensor) -> torch.Tensor:
    """bf16 ``[T, K]``: ``x [T, K]`` (bf16, contiguous, ``K`` a multiple of 64) with its columns in
    :func:`mma_column_order`, by :func:`gather_rows` with each row its own route: the copy a
    ``rows_by_token`` FC1 reads its rows from. Chosen over ``x.index_select(1,
    mma_column_order(K))`` (the same bytes) by ``benchmarks/bench_gather.py`` (twenty-fifth round,
    H200, hidden 4096, :data:`GATHER_BLOCKS_FIRST`'s order: 76.5 against 97 us at 8192 tokens,
    143 against 186 at 16384), and over a Gluon kernel permuting each thread's 64-column block in
    its registers (thirty-ninth round, H100: 96.7 against 111.6 us at 8192 tokens; removed,
    ``benchmarks/results/README.md``). No host sync; allocates (the identity routes and the
    copy)."""
    identity = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    return gather_rows(x, identity, 1)


def ws_partitions(
    routes: int, one_consumer_partition: bool = False, mode: int = MODE_W4A16, ctas_per_sm: int = 1
) -> Mapping[str, int]:
    """The warp-specialized kernel's workers for ``routes``-route tiles of 128 weight rows (its
    ``PRODUCER_WARPS``, ``PRODUCER_REGISTERS`` and ``CONSUMER_REGISTERS`` constexprs; a tile of
    256 rows takes the partitions of twice its routes: the same accumulator per thread),
    registers per thread set by ``setmaxnreg``; 384 threads, one CTA per SM (unless
    ``ctas_per_sm``, below), 512 registers per thread summed over the three warpgroups at most.

    Two consumer partitions (``one_consumer_partition`` False; ``PrefillGemm.one_consumer_partition``):
    a producer warpgroup and the second consumer warpgroup as workers (the default partition, the
    first consumer, gets what they leave it).

    - Up to 128 routes: producer 80, consumers 216. With the cp.async producer (tenth round) 64
      spilled copy addresses, 80 nothing; with TMA copies (eleventh round) 56 spilled 16-32
      local loads and stores in the 128-route FC1 (Triton 3.6) and was 5% slower at 4096 tokens.
    - 256 routes: producer 56, consumers 224. A consumer's accumulator is 128 fp32 registers; at
      216 the 256-route kernel spilled in its K loop (tenth round), at 224 the W4A16 kernels spill
      nothing and the split FC1 16 local accesses outside the K loop (Triton 3.6).

    One consumer partition (two A register sets and two wgmmas per step, one always in flight):
    the producer warpgroup is the only worker (``CONSUMER_REGISTERS`` 0, not read); the default
    partition of 8 warps gets the rest. At 256 routes the producer takes 72
    registers (the default partition 216) in W4A16 and A4 calls and 56 (224) in split calls:
    with 56 the W4A16 and A4 FC1 spill 19 local accesses, with 72 none, while the split FC1
    spills 35 with 72 and 4 with 56 (Triton 3.6, none in the K loop; mode ``precision.MODE_*``).
    Up to 128 routes 80, as with two partitions.

    Two or three CTAs per SM (``ctas_per_sm``; ``PrefillGemm.ctas_per_sm``, accumulators of at
    most 64 and 32 routes): the producer and consumer registers of
    ``schedules.WS_SHARED_SM_REGISTERS`` (40 and 96, 32 and 64), under the launch cap there.

    Checked offline by ``tests/test_triton_prefill_on_cpu.py``. A producer of 8 warps (64
    registers, consumers 192) was 5% slower at 4096 tokens on the H200 (tenth round)."""
    if ctas_per_sm > 1:
        _, producer, consumer = WS_SHARED_SM_REGISTERS[ctas_per_sm]
        return MappingProxyType(
            {"PRODUCER_WARPS": 4, "PRODUCER_REGISTERS": producer, "CONSUMER_REGISTERS": consumer}
        )
    if one_consumer_partition:
        producer = 80 if routes <= 128 else 56 if mode == MODE_SPLIT else 72
        partitions = {"PRODUCER_WARPS": 4, "PRODUCER_REGISTERS": producer, "CONSUMER_REGISTERS": 0}
        return MappingProxyType(partitions)
    if routes > 128:
        return MappingProxyType({"PRODUCER_WARPS": 4, "PRODUCER_REGISTERS": 56, "CONSUMER_REGISTERS": 224})
    return MappingProxyType({"PRODUCER_WARPS": 4, "PRODUCER_REGISTERS": 80, "CONSUMER_REGISTERS": 216})


@functools.cache
def persistent_programs(device: torch.device) -> int:
    """Programs per CTA of an SM that a persistent kernel (the warp-specialized one) is launched
    with on ``device`` (the launch multiplies by ``PrefillGemm.ctas_per_sm``): its SM count on a
    CUDA device, 2 elsewhere (the TTGIR interpreter on the CPU, so that each program runs several
    work items). Cached per device."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


register_state(__name__, persistent_programs.cache_clear, persistent_programs)


def schedule_kernel(schedule: PrefillGemm) -> Any:
    """The Gluon kernel that runs ``schedule``: ``grouped_w4_gemm_ws_kernel`` (warp-specialized),
    ``grouped_w4_gemm_rs_kernel`` (register weights) or ``grouped_w4_gemm_kernel``. Imports them
    (Triton 3.6+ with Gluon)."""
    if schedule.warp_specialized:
        return kernel_modules.prefill_ws().grouped_w4_gemm_ws_kernel
    kernels = kernel_modules.prefill()
    return kernels.grouped_w4_gemm_rs_kernel if schedule.register_weights else kernels.grouped_w4_gemm_kernel


def schedule_constexprs(schedule: PrefillGemm, mode: int = MODE_W4A16) -> dict[str, int | bool]:
    """The constexprs that ``schedule`` sets on :func:`schedule_kernel` in precision mode ``mode``:
    the tile (``BT``, ``DEPTH`` and, but for the warp-specialized kernel, ``BW``), then per kernel
    ``WEIGHT_AHEAD``, ``A_SETS``, ``WGMMAS`` (register weights), :func:`ws_partitions`,
    ``WGMMAS``, ``A_SETS``, ``ITEM_ROWS``, ``LOADS_AHEAD`` and with ``scale_sectors``
    ``SCALE_GROUPS`` (warp-specialized) or ``BK``. What
    :func:`launch_prefill_gemm` compiles; the tests compile the same offline."""
    constexprs: dict[str, int | bool] = {"BT": schedule.routes, "DEPTH": schedule.depth}
    if schedule.warp_specialized:
        constexprs.update(
            ws_partitions(
                schedule.accumulator_routes, schedule.one_consumer_partition, mode, schedule.ctas_per_sm
            )
        )
        constexprs["ITEM_ROWS"] = schedule.weight_rows
        # A8's route quarters: four wgmma groups a step (prefill_a8_kernels.mainloop_a8_quarters)
        constexprs["WGMMAS"] = 4 if schedule.a8_route_quarters else schedule.wgmmas_per_step
        constexprs["A_SETS"] = schedule.a_register_sets
        constexprs["LOADS_AHEAD"] = schedule.loads_ahead
        if schedule.scale_sectors:
            constexprs["SCALE_GROUPS"] = schedule.scale_ring_groups
    elif schedule.register_weights:
        constexprs["BW"] = schedule.weight_rows
        constexprs["WEIGHT_AHEAD"] = schedule.weights_ahead
        constexprs["A_SETS"] = schedule.a_register_sets
        constexprs["WGMMAS"] = schedule.wgmmas_per_step
    else:
        constexprs["BW"] = schedule.weight_rows
        constexprs["BK"] = schedule.block_k
    return constexprs


def launch_prefill_gemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    routing: Routing,
    out: torch.Tensor,
    schedule: PrefillGemm,
    top_k: int | None,
    kernel: Any = None,
    epilogue: str = "none",
    scale2: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    mode: int = MODE_W4A16,
    encode_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    row_flags: torch.Tensor | None = None,
    routes_per_token: int | None = None,
    x_mma_order: bool = False,
    out_mma_order: bool = False,
    x_row_scales: torch.Tensor | None = None,
) -> None:
    """``out[p] = x[row(p)] @ dequant(W[e(p)])^T`` for every sorted position ``p`` of
    ``routing`` (fp32 accumulation), then the ``epilogue``, without a host sync.

    ``x`` bf16 ``[T, K]`` with ``row(p) = sorted_route[p] // top_k`` (FC1: tokens), or, with
    ``top_k=None``, ``[R, K]`` with ``row(p) = p`` (FC2: rows already in sorted order). ``codes``
    uint8 ``[E, N, K / 2]`` and ``scales`` (e4m3 bytes as uint8) ``[E, N, K / 16]``, the ModelOpt
    layout as loaded. ``epilogue`` (:data:`PREFILL_EPILOGUES`):

    - ``"none"``: ``out`` bf16 ``[R, N]`` at the sorted positions, the bf16-rounded product;
    - ``"swiglu"`` (FC1, ``N = 2 I``, gate rows then up rows): ``out`` bf16 ``[R, I]`` at the sorted
      positions, ``swiglu(gate * scale2[e, 0], up * scale2[e, 1])`` clamped by ``swiglu_limit``,
      ``scale2`` fp32 ``[E, 2]``;
    - ``"alpha"`` (FC2): ``out`` bf16 ``[R, N]`` by route (``out[sorted_route[p]]``), the product
      times ``scale2[e]``, ``scale2`` fp32 ``[E]``.

    ``mode`` (``precision.MODE_*``) with the MoE epilogues: in ``MODE_A4`` and ``MODE_SPLIT`` the A4
    routes' multipliers divide by the encode scales ``encode_scales = (gs1 [1], gs2 [E])`` fp32 and
    FC1 re-quantizes their ``h`` with ``gs2[e]`` (``x`` of A4 rows already quantized, as
    ``quantize.quantize_rows`` gives it); ``MODE_SPLIT`` reads each route's precision from
    ``row_flags`` uint8 ``[T]`` (1 = A4) at its token, ``route // routes_per_token``
    (``routes_per_token`` defaults to ``top_k``; FC2 passes it since its ``top_k`` is None).

    Column orders (:func:`mma_column_order`, per 64 columns): ``x_mma_order`` says ``x``'s columns
    are already in that order (a register-weights schedule then skips its gather; only those take
    it; in A8 calls of ``a8_register_weights`` schedules: :func:`a8_column_order`, per 128
    columns, as ``fused_a8.quantize_rows(mma_order=True)`` writes them), ``out_mma_order`` writes
    ``out``'s columns in it (FC1's ``h`` for a register-weights FC2; ``out``'s row length a
    multiple of 64).

    ``routing`` was built with ``block_m = schedule.routes``. ``N`` must be a multiple of
    ``schedule.weight_rows`` and ``K`` of ``schedule.block_k``. With ``schedule.register_weights``
    ``x`` is first copied with its columns in :func:`mma_column_order` (one gather of ``x``, timed
    with the GEMM by the benchmark; a fused producer of ``x`` could write that order directly); a
    warp-specialized FC1 (bf16) takes its rows in sorted order and that column order from one
    copy, :func:`gather_rows`, or with ``schedule.rows_by_token`` copies them by token itself
    from ``x`` in that column order (a ``[T, K]`` copy unless ``x_mma_order``; A8 rows too, their
    scales still gathered into sorted order).
    A8 (``x_row_scales`` given; issue 28, docs/numerics.md section 8): every route A8, ``x``
    float8_e4m3fn codes and ``x_row_scales`` fp32 ``[rows]`` their scales, one per row
    (``fp8.quantize_rows``), rows indexed as ``x``'s; the weights converted to e4m3 in the kernel
    (``prefill_a8_kernels``; with 256 routes two wgmmas of 128 routes a step on the same
    converted weights; with ``a8_register_weights`` the weights converted into the wgmma's A
    registers and ``x``'s columns taken in :func:`a8_column_order`, by a copy of ``x`` unless
    ``x_mma_order``). Needs a warp-specialized schedule of 128 or 256 routes with one A register
    set, 128 weight rows and one wgmma per step (or two with ``a8_register_weights``: a step
    converted in two K halves), ``mode`` W4A16 (the epilogues' W4A16 multipliers), ``K`` a
    multiple of 128 and no ``out_mma_order``. The activation scales reach the kernel in
    sorted order (``[R]``). Without ``x_row_scales`` an ``a8_register_weights`` schedule is refused.

    ``kernel`` replaces the schedule's Gluon kernel (tests: the TTGIR interpreter); by default it is
    imported (Triton 3.6+ with Gluon, an sm_90 GPU). It is compiled with the register cap
    ``schedule.max_registers(mode)`` where that is not 0 (split calls of 128-route tiles)."""
    experts, n, half_k = codes.shape
    k = 2 * half_k
    if epilogue not in PREFILL_EPILOGUES:
        raise ValueError(f"epilogue must be one of {sorted(PREFILL_EPILOGUES)}, got {epilogue!r}")
    a8 = x_row_scales is not None
    x_dtype = torch.float8_e4m3fn if a8 else torch.bfloat16
    if x.dtype != x_dtype or out.dtype != torch.bfloat16:
        raise ValueError(f"x must be {x_dtype} and out bf16, got {x.dtype} and {out.dtype}")
    if x_row_scales is not None and (
        not schedule.warp_specialized
        or schedule.routes not in (128, 256)
        or schedule.a_register_sets != 1
        or schedule.weight_rows != 128
        or (schedule.wgmmas_per_step != 1 and not schedule.a8_register_weights)
        or mode != MODE_W4A16
        or k % 128
        or (x_mma_order and not schedule.a8_register_weights)
        or out_mma_order
        or x_row_scales.dtype != torch.float32
        or tuple(x_row_scales.shape) != (x.shape[0],)
    ):
        raise ValueError(
            "x_row_scales (A8) needs fp32 [x rows], a warp-specialized schedule of 128 or 256 routes "
            "with one A register set, 128 weight rows and one wgmma per step (two with "
            "a8_register_weights), "
            f"mode W4A16, K a multiple of 128 and no column order (x_mma_order only with "
            f"a8_register_weights); got {schedule}, mode {mode}, K={k}, x_mma_order={x_mma_order}, "
            f"out_mma_order={out_mma_order}, scales {x_row_scales.dtype} {tuple(x_row_scales.shape)}"
        )
    if schedule.a8_register_weights and not a8:
        raise ValueError(f"schedule {schedule} runs A8 calls only (x_row_scales), got none")
    routes = routing.sorted_route.numel()
    out_n = n // 2 if epilogue == "swiglu" else n
    if x.shape[1] != k or scales.shape != (experts, n, k // 16) or out.shape != (routes, out_n):
        raise ValueError(
            f"shapes: x [*, {k}], scales [{experts}, {n}, {k // 16}] and out [{routes}, {out_n}] expected, "
            f"got {tuple(x.shape)}, {tuple(scales.shape)}, {tuple(out.shape)}"
        )
    scale2_shape = {"none": None, "swiglu": (experts, 2), "alpha": (experts,)}[epilogue]
    if scale2_shape is not None and (
        scale2 is None or scale2.dtype != torch.float32 or tuple(scale2.shape) != scale2_shape
    ):
        got = None if scale2 is None else (scale2.dtype, tuple(scale2.shape))
        raise ValueError(f"scale2 must be fp32 {list(scale2_shape)} for epilogue {epilogue!r}, got {got}")
    if mode not in (MODE_W4A16, MODE_A4, MODE_SPLIT):
        raise ValueError(f"mode must be one of MODE_W4A16, MODE_A4, MODE_SPLIT, got {mode!r}")
    if mode != MODE_W4A16:
        if epilogue == "none" or encode_scales is None:
            raise ValueError(
                "mode A4 or split needs the swiglu or alpha epilogue and encode_scales=(gs1, gs2)"
            )
        token_routes = routes_per_token or top_k
        if mode == MODE_SPLIT and (
            row_flags is None or row_flags.dtype != torch.uint8 or token_routes is None
        ):
            raise ValueError("mode split needs row_flags (uint8 [T]) and routes_per_token (or top_k)")
    for name, tensor in (("x", x), ("codes", codes), ("scales", scales), ("out", out)):
        if not tensor.is_contiguous() or tensor.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned (cp.async copies 16 bytes)")
    if not schedule.fits(k, n):
        raise ValueError(f"schedule {schedule} does not divide K={k} and N={n}")
    if a8 and schedule.scale_sectors:
        raise ValueError(f"schedule {schedule}: scale_sectors serves W4A16, A4 and split calls, not A8")
    if schedule.scale_sectors and scales.numel() >= 2**31:
        raise ValueError(
            f"schedule {schedule} (scale_sectors) addresses scales by int32 offsets: scales must have "
            f"fewer than 2**31 elements, got {tuple(scales.shape)}"
        )
    if x_mma_order and not schedule.register_weights:
        raise ValueError(f"x_mma_order needs a register-weights schedule (rs_), got {schedule}")
    if out_mma_order and out_n % 64:
        raise ValueError(f"out_mma_order needs out's row length ({out_n}) to be a multiple of 64")
    constexprs = {
        **schedule_constexprs(schedule, mode),
        "EPILOGUE": PREFILL_EPILOGUES[epilogue],
        "MODE": mode,
        "HAS_LIMIT": swiglu_limit is not None,
        "OUT_MMA_ORDER": out_mma_order,
    }
    gather_in_order = schedule.warp_specialized and top_k is not None and not a8 and not x_mma_order
    # FC1's producer copies its rows by token (from x in MMA column order), int32 element offsets
    by_token = schedule.warp_specialized and schedule.rows_by_token and top_k is not None
    if by_token and x.numel() >= 2**31:
        raise ValueError(
            f"schedule {schedule} (rows_by_token) addresses x by int32 offsets: x must have fewer than "
            f"2**31 elements, got {tuple(x.shape)}"
        )
    if schedule.register_weights and not x_mma_order and not a8 and not gather_in_order:
        x = x.index_select(1, mma_column_order(k, x.device))
    if schedule.a8_register_weights and not x_mma_order:  # e4m3 as bytes: index_select has no float8
        x = x.view(torch.uint8).index_select(1, a8_column_order(k, x.device)).view(x.dtype)
    if kernel is None:
        kernel = schedule_kernel(schedule)
    grid: tuple[int, ...] = (n // schedule.weight_rows, routing.max_tiles)
    operands: tuple[Any, ...] = (x, codes)
    gather: dict[str, Any] = {"GATHER": top_k is not None}
    if schedule.warp_specialized:  # persistent: ctas_per_sm programs per SM, looping over the work
        grid = (min(persistent_programs(x.device) * schedule.ctas_per_sm, grid[0] * grid[1]),)
        # its TMA copies take a tile's rows as one box: FC1's rows gathered in sorted order first,
        # bf16 rows in MMA column order in the same pass (e4m3 rows as bytes: index_select has no
        # float8 kernels)
        token = None if top_k is None or gather_in_order else routing.sorted_route // top_k
        if by_token:  # x itself, its columns in MMA order; the descriptor gives the slots' layout
            rows = x if a8 or x_mma_order else mma_ordered_rows(x)
        elif gather_in_order and top_k is not None:
            rows = gather_rows(x, routing.sorted_route, top_k)
        elif token is not None:
            rows = x.view(torch.uint8).index_select(0, token).view(x.dtype)
        else:
            rows = x
        operands = kernel_modules.prefill_ws().tma_descriptors(
            rows, codes, schedule.routes, epilogue == "swiglu", a8, schedule.weight_rows
        )
        gather = {"x_rows_ptr": rows, "X_BY_TOKEN": True} if by_token else {}
        if x_row_scales is not None:
            row_scales = x_row_scales if token is None else x_row_scales.index_select(0, token)
            gather |= {"xs_ptr": row_scales.contiguous(), "A8": schedule.a8_constexpr}
    kernel[grid](
        *operands,
        scales,
        out,
        scale2 if scale2 is not None else routing.seg_count,  # not read by the "none" epilogue
        *(encode_scales or (routing.seg_count, routing.seg_count)),  # read in A4 and split modes only
        row_flags if row_flags is not None else routing.seg_count,  # read in split mode only
        routing.sorted_route,
        routing.tile_expert,
        routing.tile_row,
        routing.seg_start,
        routing.seg_count,
        routing.num_tiles,
        n,
        k,
        routes,
        top_k or routes_per_token or 1,
        float(swiglu_limit or 0.0),
        **gather,
        **constexprs,
        num_warps=schedule.warps,
        **({"maxnreg": cap} if (cap := schedule.max_registers(mode)) else {}),
    )
