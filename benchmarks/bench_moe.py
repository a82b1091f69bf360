"""Benchmark the ``triton`` NVFP4 MoE backend against bf16 and vLLM's Marlin NVFP4 MoE (a script).

Usage (CUDA GPU): ``PYTHONPATH=src python benchmarks/bench_moe.py --out DIR [--quick] [--sweep
[all|decode|focus|prefill]]``;
plot an existing result anywhere: ``python benchmarks/bench_moe.py --plot DIR/bench_moe.json``;
print it as markdown tables: ``python benchmarks/bench_moe.py --table DIR/bench_moe.json``.

For each shape and token count, with random top-k routing (one routing per token count, shared
by every variant): W4A16 (the default choice: the decode kernels at decode sizes, the Hopper
prefill GEMMs from ``schedules.PREFILL_MIN_ROWS_PER_EXPERT`` routes per expert on sm_90), W4A16
tiled (at decode sizes, the tiled kernels the default replaced), A4 (emulated: FP4 activations
dequantized for a bf16 MMA), A8 (on sm_90: FP8 activations and weights converted to e4m3 on the
FP8 tensor cores, ``fused_a8``; its error against the fp32 W4A16 reference is A8's quantization
error; ``a8_t256``: 256-route tiles, two wgmmas on each step's converted weights,
``schedules.A8_PREFILL_WIDE``; ``a8_rs``, ``a8_t256_rs``: ``a8`` and ``a8_t256`` with the
converted weights in the wgmma's A registers, ``schedules.A8_PREFILL_RS``,
``A8_PREFILL_WIDE_RS``, and their two-halves forms ``a8_rs_h2``, ``a8_t256_rs_h2``; results of
the eighteenth and nineteenth rounds also hold ``a8_x2``, a schedule since removed), split
(first half of the rows decode/W4A16, second half prefill/A4) and bf16 (``torch._grouped_mm``
on bf16 copies of the weights, same routing: sort, gather, two grouped GEMMs, SwiGLU, weighted
sum) and, when vLLM is importable, marlin (vLLM's ``fused_marlin_moe`` on Marlin-repacked copies of the same
weights, ``marlin_baseline.py``) and, when ``humming-kernels`` is importable, humming (vLLM 0.32+'s
SM90 default for NVFP4 MoE, W4A16, on humming-repacked copies, ``humming_baseline.py``; a
baseline that fails to set up or run is a table cell with its error, the other columns stay).
Accuracy: relative L2 error of W4A16, Marlin and Humming against the
package's ``moe_reference`` (fp32 math) at up to 4096 tokens, fed fp32 activations (the exact
MoE of the NVFP4 weights) and bf16 activations (the same bf16 roundings a bf16 kernel makes).
Every variant is captured in a CUDA graph; each replay is timed with CUDA events after the L2
cache is flushed (a 256 MiB write), median of the repeats. Effective bandwidth counts the bytes
of the experts actually hit (distinct experts x weights + block scales) plus the activations in
and out; TFLOP/s counts ``6 * routes * H * I``, and its share of a dense bf16 8192^3 matmul
timed in the same run (the tensor cores' measured rate). Clocks: with ``nvidia-smi`` on the
machine, each variant's ``<variant>_clocks`` (and a size's ``sweep_clocks``) hold the SM clock,
power, temperature and clock-event reasons sampled while its replays were timed
(``gpu_clocks.py``; the table's last column: W4A16's SM clock).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from a4prefill.ops.backends.triton.schedules import A8_SCHEDULES
from a4prefill.tools.numerics.layer_metrics import relative_error
from gpu_clocks import ClockSampler
from marlin_baseline import marlin_moe

A8_LABELS = tuple(A8_SCHEDULES)  # the A8 columns: "a8", then one per other A8 schedule

SHAPES = {
    "glm53flash_tp2": {"hidden": 4096, "intermediate": 1024, "experts": 288, "top_k": 8},
    "small": {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8},
}
TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 8192, 16384]
ACCURACY_TOKENS = 4096  # relative errors against the fp32 reference up to this many tokens


def random_weights(experts: int, hidden: int, inter: int, device: str) -> Any:
    """Random ModelOpt NVFP4 parameters (random codes, e4m3 block scales around 1, calibrated)."""
    from a4prefill.ops.modelopt import NvFp4MoEWeights

    def stack(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=device)
        scales = (torch.rand(experts, n, k // 16, device=device) * 1.5 + 0.25).to(torch.float8_e4m3fn)
        return codes, scales

    w13, w13_s = stack(2 * inter, hidden)
    w2, w2_s = stack(hidden, inter)
    s2_13 = torch.full((experts, 2), 0.01 / math.sqrt(hidden), device=device)
    s2_2 = torch.full((experts,), 0.01 / math.sqrt(inter), device=device)
    in13 = torch.full((experts, 2), 8.0 / 2688, device=device)
    in2 = torch.full((experts,), 4.0 / 2688, device=device)
    return NvFp4MoEWeights(w13, w13_s, s2_13, in13, w2, w2_s, s2_2, in2)


def random_routing(tokens: int, hidden: int, experts: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """CUDA ``hidden [T, H]`` bf16, ``topk_weights [T, k]`` fp32 and ``topk_ids [T, k]`` int32
    (softmax of random logits, top-k)."""
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda")
    topk_w, topk_ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, topk_w, topk_ids.to(torch.int32)


def bf16_weights(weights: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 copies ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (same bytes per element as a bf16 model)."""
    from a4prefill.ops import nvfp4

    out = []
    for codes, scales in (
        (weights.w13_weight, weights.w13_weight_scale),
        (weights.w2_weight, weights.w2_weight_scale),
    ):
        chunks = [
            nvfp4.dequantize_blocks(codes[e : e + 32], scales[e : e + 32]).to(torch.bfloat16)
            for e in range(0, codes.shape[0], 32)
        ]
        out.append(torch.cat(chunks))
    return out[0], out[1]


def bf16_moe(
    x: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The bf16 baseline with ``torch._grouped_mm`` (capture-safe: no host reads)."""
    tokens, hidden = x.shape
    experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, ids, torch.ones_like(ids, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // top_k]
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    gate, up = gate_up.chunk(2, dim=1)
    h = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    routed = torch.empty_like(y)
    routed[order] = y
    return (routed.view(tokens, top_k, hidden).float() * topk_w.unsqueeze(-1)).sum(1).to(torch.bfloat16)


def time_graph(fn: Callable[[], Any], repeats: int, flush: torch.Tensor) -> float:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph (L2 flushed)."""
    return time_graph_window(fn, repeats, flush)[0]


def time_graph_window(fn: Callable[[], Any], repeats: int, flush: torch.Tensor) -> tuple[float, float, float]:
    """:func:`time_graph`'s median, with the ``time.monotonic()`` seconds at which its timed
    replays began and ended (the window of :meth:`gpu_clocks.ClockSampler.summary`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    began = time.monotonic()
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    ended = time.monotonic()
    del graph
    return statistics.median(times), began, ended


def dense_bf16_tflops(flush: torch.Tensor) -> float:
    """The tensor cores' measured bf16 rate in TFLOP/s: a dense 8192^3 bf16 matmul, timed as the
    MoE variants are (:func:`time_graph`, 20 replays)."""
    square = [torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    dense_us = time_graph(functools.partial(torch.matmul, *square), 20, flush)
    return 2 * 8192**3 / dense_us / 1e6


def copy_bandwidth() -> float:
    """Measured device copy bandwidth in GB/s (read + write of a 2 GiB buffer)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    return 2 * src.numel() / seconds / 1e9


# triton.schedules.DecodeGemm fields (warps, block_k, split, rows, prefetch) of FC1, then FC2; 8-route tiles
DECODE_SWEEP = [
    ((4, 128), (2, 128)),
    ((2, 256), (2, 128)),
    ((4, 256, "rows"), (4, 128, "rows")),
    ((4, 256, "rows"), (4, 256, "rows")),
    ((2, 256, "rows"), (2, 256, "rows")),
    ((4, 128, "rows"), (4, 128, "rows")),
    ((2, 128, "rows"), (2, 128, "rows")),
    ((4, 128, "rows", 32), (4, 128, "rows", 32)),
    ((2, 128, "rows", 32), (2, 128, "rows", 32)),
    ((4, 128, "rows", 32), (4, 128, "rows")),
    ((2, 256, "rows", 32), (2, 128, "rows", 32)),
    ((4, 128, "k", 32), (2, 128, "k", 32)),
    ((2, 128, "k", 32), (2, 128, "k", 32)),
    ((4, 256, "k", 32), (4, 128, "k", 32)),
    ((4, 128, "k", 32), (4, 128, "rows", 32)),
    ((1, 128, "rows", 32), (1, 128, "rows", 32)),
    ((8, 128), (4, 128)),
    ((8, 128, "rows"), (8, 128, "rows")),
    ((4, 128, "k", 16, True), (2, 128, "k", 16, True)),
    ((8, 128, "k", 16, True), (4, 128, "k", 16, True)),
    ((2, 128, "k", 16, True), (2, 128, "k", 16, True)),
    ((4, 128, "rows", 16, True), (4, 128, "rows", 16, True)),
    ((4, 256, "rows", 16, True), (4, 128, "rows", 16, True)),
    ((4, 128, "rows", 32, True), (4, 128, "rows", 32, True)),
    ((4, 256, "rows"), (4, 128, "rows", 16, True)),
    ((4, 128), (2, 128, "k", 16, True)),
    ((4, 128, "k", 16, True), (4, 128, "rows", 16, True)),
    ((4, 256, "rows", 16, False, 3), (4, 128, "rows", 16, False, 4)),
    ((4, 256, "rows", 16, False, 4), (4, 128, "rows", 16, False, 6)),
    ((4, 128, "rows", 16, False, 4), (4, 128, "rows", 16, False, 4)),
    ((2, 256, "rows", 16, False, 3), (2, 256, "rows", 16, False, 3)),
    ((4, 128, "k", 16, False, 4), (2, 128, "k", 16, False, 4)),
    ((8, 128, "rows", 16, False, 4), (8, 128, "rows", 16, False, 4)),
    ((4, 128, "rows", 32, False, 3), (4, 128, "rows", 32, False, 3)),
    ((4, 256, "rows", 16, False, 3), (4, 128, "rows", 16, True)),
    ((4, 256, "rows", 16, True), (4, 128, "rows", 16, False, 4)),
]
DECODE_SWEEP_WIDE = [  # timed with 16- and 32-route tiles where experts average more than 4 routes
    ((4, 128), (2, 128)),
    ((2, 128), (2, 128)),
    ((4, 128, "rows"), (4, 128, "rows")),
    ((4, 256, "rows"), (4, 128, "rows")),
    ((2, 128, "rows"), (2, 128, "rows")),
    ((4, 128, "rows", 16, True), (4, 128, "rows", 16, True)),
    ((4, 128, "rows", 32, True), (4, 128, "rows", 32, True)),
    ((4, 128, "rows", 16, False, 4), (4, 128, "rows", 16, False, 4)),
    ((4, 256, "rows", 16, False, 3), (4, 128, "rows", 16, False, 4)),
    ((4, 128, "rows", 32, False, 3), (4, 128, "rows", 32, False, 3)),
]
# `--sweep focus`: the default schedules by size and their variants: FC2 overlapping FC1
# (``overlap``, the last item), register caps; W4A16 and A4 timed. Items: FC1, FC2 (as in
# DECODE_SWEEP), routes per tile, overlap; 16- and 32-route tiles only where experts average more
# than 4 routes.
DECODE_SWEEP_FOCUS = [
    ((4, 128, "k", 16, True), (2, 128, "k", 16, True), 8, False),
    ((4, 128, "k", 16, True), (2, 128, "k", 16, True), 8, True),
    ((4, 256, "rows", 16, False, 3), (4, 128, "rows", 16, True), 8, False),
    ((4, 256, "rows", 16, False, 3, 128), (4, 128, "rows", 16, True), 8, False),
    ((4, 256, "rows", 16, False, 3, 128), (4, 128, "rows", 16, True), 8, True),
    ((4, 256, "rows", 16, False, 3, 128), (4, 128, "rows", 16, False, 4), 8, True),
    ((4, 256, "rows", 16, False, 3, 128), (4, 128, "rows"), 8, True),
    ((4, 256, "rows", 16, False, 3, 128), (2, 128, "rows", 16, True), 8, True),
    ((4, 256, "rows"), (4, 128, "rows"), 16, False),
    ((4, 256, "rows"), (4, 128, "rows"), 16, True),
    ((4, 256, "rows", 16, False, 3, 128), (4, 128, "rows", 16, True), 16, True),
    ((4, 128, "rows", 32, True), (4, 128, "rows", 32, True), 32, False),
    ((4, 128, "rows", 32, True), (4, 128, "rows", 32, True), 32, True),
    ((4, 128, "rows", 32, True), (4, 128, "rows", 32, True, 0, 168), 32, False),
    ((4, 128, "rows", 32, True), (4, 128, "rows", 32, True, 0, 168), 16, False),
    ((4, 256, "rows"), (4, 128, "rows", 32, True, 0, 168), 16, False),
    ((4, 256, "rows"), (4, 128, "rows", 16, True), 16, False),
]
DECODE_SWEEP_MAX_ROUTES = 8192  # decode schedules are timed up to 1024 tokens at top-8, past the default
# `--sweep prefill`: the Hopper prefill GEMMs' schedules (schedules.PREFILL_SCHEDULES labels of FC1,
# then FC2, or a sweep name "ws[_w256]_t<routes>_d<depth>[_x2][_h2][_c2|_c3]": a warp-specialized
# schedule without a label, :func:`sweep_gemm`) timed as the whole MoE at every size, below
# PREFILL_MIN_ROWS_PER_EXPERT too, in W4A16, A4 and split
PREFILL_SWEEP = [
    ("rs_w128_t32_d4", "rs_w128_t32_d4"),
    ("rs_w128_t64_d4", "rs_w128_t64_d4"),
    ("rs_w128_t64_d4_r80", "rs_w128_t64_d4_r80"),
    ("rs_w128_t128_d4", "rs_w128_t128_d4"),
    ("rs_w128_t256_d4", "w128_t256_d4"),
    ("rs_w128_t64_d6_ws", "rs_w128_t64_d6_ws"),
    ("rs_w128_t128_d4_ws", "rs_w128_t128_d4_ws"),
    ("rs_w128_t128_d6_ws", "rs_w128_t128_d6_ws"),
    ("rs_w128_t256_d4_ws", "rs_w128_t256_d4_ws"),
    ("rs_w128_t128_d6_ws_h2", "rs_w128_t128_d6_ws_h2"),
    ("rs_w128_t256_d4_ws_h2", "rs_w128_t256_d4_ws_h2"),
    ("rs_w128_t128_d6_ws_x2_h2", "rs_w128_t128_d6_ws_x2_h2"),
    ("rs_w128_t256_d4_ws_x2_h2", "rs_w128_t256_d4_ws_x2_h2"),
    ("ws_t64_d10", "ws_t64_d10"),
    ("ws_t128_d8", "ws_t128_d8"),
    ("ws_t128_d8", "ws_t128_d6"),
    ("ws_t256_d5", "ws_t256_d5"),
    ("rs_w128_t32_d6_ws_c3", "rs_w128_t32_d6_ws_c3"),
    ("rs_w128_t64_d6_ws_c2", "rs_w128_t64_d6_ws_c2"),
    ("ws_t32_d6_c2", "ws_t32_d6_c2"),
    ("rs_w128_t16_d8_ws_c3", "rs_w128_t16_d8_ws_c3"),
    ("rs_w256_t32_d6_ws_c2", "rs_w256_t32_d6_ws_c2"),
    ("rs_w256_t128_d6_ws_x2_h2", "rs_w256_t128_d6_ws_x2_h2"),
    ("ws_t32_d6_x2_c2", "ws_t32_d6_x2_c2"),
]
SWEEP = {  # block_m, fc1_n, fc1_k, fc2_n, fc2_k, warps, stages, ptx_dequant, split_k
    "bm16_n32_k128_w4_triton": (16, 32, 128, 64, 128, 4, 4, False, 1),
    "bm16_n32_k128_w4": (16, 32, 128, 64, 128, 4, 4, True, 1),
    "bm16_n32_k128_w2": (16, 32, 128, 64, 128, 2, 4, True, 1),
    "bm16_n64_k128_w2": (16, 64, 128, 64, 128, 2, 4, True, 1),
    "bm16_n32_k128_w1": (16, 32, 128, 64, 128, 1, 4, True, 1),
    "bm16_n16_k128_w1": (16, 16, 128, 32, 128, 1, 4, True, 1),
    "bm16_n32_k128_w2_s3": (16, 32, 128, 64, 128, 2, 3, True, 1),
    "bm16_n32_k128_w2_s6": (16, 32, 128, 64, 128, 2, 6, True, 1),
    "bm16_n32_k128_w2_fc2n128": (16, 32, 128, 128, 128, 2, 4, True, 1),
    "bm16_n32_k128_w2_fc2n32": (16, 32, 128, 32, 128, 2, 4, True, 1),
    "bm16_n32_k64_w1_s8": (16, 32, 64, 64, 64, 1, 8, True, 1),
    "bm16_n64_k128_w4": (16, 64, 128, 64, 128, 4, 4, True, 1),
    "bm16_n32_k256_w4": (16, 32, 256, 64, 256, 4, 3, True, 1),
    "bm16_n32_k256_w4_sk2": (16, 32, 256, 64, 256, 4, 3, True, 2),
    "bm16_n32_k256_w2": (16, 32, 256, 64, 256, 2, 3, True, 1),
    "bm32_n64_k128_w4": (32, 64, 128, 64, 128, 4, 3, True, 1),
    "bm64_n64_k64_w4_triton": (64, 64, 64, 128, 64, 4, 3, False, 1),
    "bm64_n64_k64_w4": (64, 64, 64, 128, 64, 4, 3, True, 1),
    "bm64_n64_k128_w4": (64, 64, 128, 128, 128, 4, 3, True, 1),
    "bm128_n64_k64_w8_triton": (128, 64, 64, 128, 64, 8, 3, False, 1),
    "bm128_n64_k64_w8": (128, 64, 64, 128, 64, 8, 3, True, 1),
    "bm128_n64_k128_w8": (128, 64, 128, 128, 128, 8, 3, True, 1),
}


def config_fits(sizes: tuple[Any, ...], routes: int, experts: int) -> bool:
    """Sweep only plausible tiles: 16-row tiles for decode-like calls, bigger ones for prefill."""
    return (sizes[0] <= 16 and routes <= 8 * experts) or (sizes[0] > 16 and routes >= 2 * experts)


def decode_schedules(routes: int, experts: int, focus: bool = False) -> list[Any]:
    """The decode schedules the sweep times for a call of ``routes`` routes over ``experts``:
    :data:`DECODE_SWEEP` (and :data:`DECODE_SWEEP_WIDE` with wider tiles), or with ``focus``
    :data:`DECODE_SWEEP_FOCUS`."""
    from a4prefill.ops.backends.triton.schedules import DecodeGemm, DecodeTiles

    wide = routes > 4 * experts
    if focus:
        return [
            DecodeTiles(DecodeGemm(*fc1), DecodeGemm(*fc2), tile_routes, overlap)
            for fc1, fc2, tile_routes, overlap in DECODE_SWEEP_FOCUS
            if wide or tile_routes == 8
        ]
    schedules = [DecodeTiles(DecodeGemm(*fc1), DecodeGemm(*fc2)) for fc1, fc2 in DECODE_SWEEP]
    if wide:
        for tile_routes in (16, 32):
            schedules += [
                DecodeTiles(DecodeGemm(*fc1), DecodeGemm(*fc2), tile_routes) for fc1, fc2 in DECODE_SWEEP_WIDE
            ]
    return schedules


def sweep_gemm(name: str) -> Any:
    """The ``PrefillGemm`` of a :data:`PREFILL_SWEEP` name: a ``schedules.PREFILL_SCHEDULES``
    label, or ``ws[_w256]_t<routes>_d<depth>`` (warp-specialized, 128 weight rows per work item,
    256 with ``_w256``), with ``_h2`` its two-wgmmas-per-step variant, ``_x2`` two A register
    sets (the next step dequantized while the step's wgmma runs) and ``_x2_h2`` both (one wgmma
    in flight across steps), then ``_c2`` or ``_c3``: that many CTAs per SM (``ctas_per_sm``),
    then ``_tok``: FC1's rows copied by token by the producer (``rows_by_token``), then ``_la``:
    each step's bytes loaded while the step before runs its wgmma (``loads_ahead``)."""
    from a4prefill.ops.backends.triton.schedules import PREFILL_SCHEDULES, PrefillGemm

    if name in PREFILL_SCHEDULES:
        return PREFILL_SCHEDULES[name]
    match = re.fullmatch(r"ws(_w256)?_t(\d+)_d(\d+)(_x2)?(_h2)?(?:_c([23]))?(_tok)?(_la)?", name)
    if match is None:
        raise ValueError(
            "a PREFILL_SWEEP name is a PREFILL_SCHEDULES label or "
            f"ws[_w256]_t<routes>_d<depth>[_h2|_x2|_x2_h2][_c2|_c3][_tok][_la], got {name!r}"
        )
    routes, depth = int(match[2]), int(match[3])
    return PrefillGemm(
        256 if match[1] else 128,
        routes,
        depth=depth,
        register_weights=True,
        a_register_sets=2 if match[4] else 1,
        wgmmas_per_step=2 if match[5] else 1,
        warp_specialized=True,
        ctas_per_sm=int(match[6] or 1),
        rows_by_token=bool(match[7]),
        loads_ahead=bool(match[8]),
    )


def parse_prefill_tiles(names: str | None) -> list[tuple[str, str]] | None:
    """``--prefill-tiles``' ``FC1[:FC2],...`` as ``(FC1, FC2)`` name pairs (None: not given).
    Raises SystemExit naming the argument for a name :func:`sweep_gemm` does not know."""
    if not names:
        return None
    pairs = []
    for entry in names.split(","):
        fc1, _, fc2 = entry.partition(":")
        pairs.append((fc1, fc2 or fc1))
        for name in pairs[-1]:
            try:
                sweep_gemm(name)
            except ValueError as error:
                raise SystemExit(f"--prefill-tiles: {error}") from None
    return pairs


def names_in(option: str, text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """A comma list option's names (empty entries dropped), each one of ``known``; SystemExit
    naming ``option`` otherwise."""
    names = tuple(filter(None, text.split(",")))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"{option}: unknown {unknown}; expected some of {list(known)}")
    return names


def parse_a8_schedules(labels: str | None) -> tuple[str, ...]:
    """``--a8-schedules``' comma-separated :data:`A8_SCHEDULES` labels, in the order their columns
    are timed (None or empty: every schedule, in the table's order). Raises SystemExit naming the
    argument for a label it does not know."""
    if not labels:
        return A8_LABELS
    chosen = tuple(labels.split(","))
    unknown = [label for label in chosen if label not in A8_SCHEDULES]
    if unknown:
        raise SystemExit(f"--a8-schedules: unknown {unknown}; expected labels of {list(A8_LABELS)}")
    return chosen


def prefill_configs(
    routes: int, experts: int, hidden: int, inter: int, tiles: list[tuple[str, str]] | None = None
) -> dict[str, Any]:
    """``prefill_<tiles>`` -> the call's default config with each ``(FC1, FC2)`` name pair of
    ``tiles`` (default :data:`PREFILL_SWEEP`) instead of its decode schedule or tiles (those the
    shapes fit)."""
    from a4prefill.ops.backends.triton.schedules import PrefillTiles, choose_config

    default = choose_config(routes, experts, hidden, inter)
    configs = {}
    for fc1, fc2 in PREFILL_SWEEP if tiles is None else tiles:
        pair = PrefillTiles(sweep_gemm(fc1), sweep_gemm(fc2))
        if pair.fits(hidden, inter):
            configs[f"prefill_{pair}"] = dataclasses.replace(default, decode=None, prefill=pair)
    return configs


def sweep_configs(
    fn: Callable[..., Any],
    routes: int,
    experts: int,
    hidden: int,
    inter: int,
    flush: torch.Tensor,
    sweep: str,
    references: dict[str, torch.Tensor],
    mode_fns: dict[str, Callable[..., Any]] | None = None,
    prefill_tiles: list[tuple[str, str]] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
    """Median microseconds of ``fn(config=...)`` (W4A16) for each tile config in :data:`SWEEP`
    (``sweep`` ``"all"``), up to :data:`DECODE_SWEEP_MAX_ROUTES` routes each decode schedule of
    :func:`decode_schedules` (``focus`` with ``sweep == "focus"``; labels ``decode_<schedule>``;
    none with ``sweep == "prefill"``) and with ``sweep == "prefill"`` each
    :func:`prefill_configs` config of ``prefill_tiles`` (labels ``prefill_<tiles>``); per
    reference of ``references`` (suffix -> expected fp32 output), each config's relative error;
    with ``sweep`` ``"focus"`` (decode schedules) or ``"prefill"`` (prefill tiles), the time of
    each ``mode_fns`` function (mode -> ``fn(config=...)``: A4, split) by mode and label."""
    from a4prefill.ops.backends.triton.schedules import GemmConfig, choose_config

    configs = {
        label: GemmConfig(*sizes)
        for label, sizes in SWEEP.items()
        if sweep == "all" and config_fits(sizes, routes, experts)
    }
    default = choose_config(routes, experts, hidden, inter)
    if routes <= DECODE_SWEEP_MAX_ROUTES and sweep != "prefill":
        for tiles in decode_schedules(routes, experts, sweep == "focus"):
            if tiles.fits(hidden, inter):
                configs[f"decode_{tiles}"] = dataclasses.replace(default, decode=tiles)
    timed_modes = {"focus": "decode_", "prefill": "prefill_"}.get(sweep)
    if sweep == "prefill":
        configs.update(prefill_configs(routes, experts, hidden, inter, prefill_tiles))
    times: dict[str, Any] = {}
    mode_times: dict[str, dict[str, Any]] = {mode: {} for mode in mode_fns or {}}
    errors: dict[str, dict[str, float]] = {suffix: {} for suffix in references}
    for label, config in configs.items():
        try:
            times[label] = time_graph(functools.partial(fn, config=config), 20, flush)
            output = fn(config=config).float()
            for mode, mode_fn in (mode_fns or {}).items():
                if timed_modes and label.startswith(timed_modes):
                    mode_times[mode][label] = time_graph(functools.partial(mode_fn, config=config), 20, flush)
        except Exception as error:
            times[label] = repr(error)[:200]
            continue
        for suffix, expected in references.items():
            errors[suffix][label] = relative_error(output, expected)
    return times, errors, {mode: by_label for mode, by_label in mode_times.items() if by_label}


def timing_order(variants: dict[str, Any], reverse: bool) -> list[str]:
    """The order in which :func:`bench_shape` times one size's columns: as built (``w4a16``,
    ``a4``, ``bf16``, the A8 schedules, ``marlin``, ``humming``, ``split`` and its parts), or last
    to first with ``reverse`` (``--reverse-columns``): a card that heats and reaches its power
    cap over a size's columns favours the first ones, so a comparison between two columns is
    read from runs in both orders."""
    names = list(variants)
    return names[::-1] if reverse else names


def bench_shape(
    name: str,
    shape: dict[str, int],
    tokens_list: list[int],
    sweep: str | None,
    log: Any,
    dense_tflops: float | None = None,
    baselines: tuple[str, ...] = ("marlin", "humming"),
    prefill_tiles: list[tuple[str, str]] | None = None,
    sweep_modes: tuple[str, ...] = ("a4", "split"),
    clocks: ClockSampler | None = None,
    a8_labels: tuple[str, ...] = A8_LABELS,
    reverse_columns: bool = False,
) -> dict[str, Any]:
    from a4prefill.ops.backends.triton.fused import fused_moe
    from a4prefill.ops.backends.triton.fused_a8 import a8_refusal, fused_moe_a8
    from a4prefill.ops.backends.triton.schedules import choose_config
    from a4prefill.ops.reference import moe_reference
    from a4prefill.ops.scales import derive_a4_scales

    hidden, inter, experts, top_k = shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]
    torch.manual_seed(0)
    weights = random_weights(experts, hidden, inter, "cuda")
    scales = derive_a4_scales(weights.w13_input_scale, weights.w2_input_scale)
    w13_bf16, w2_bf16 = bf16_weights(weights)
    marlin = marlin_moe(weights) if "marlin" in baselines else None
    humming, humming_error = None, None
    try:
        if "humming" in baselines:
            from humming_baseline import humming_moe

            humming = humming_moe(weights, token_counts=tokens_list)
    except Exception as error:  # an import or set-up failure: the other columns stay
        humming_error = repr(error)[:300]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    a8_runs = a8_refusal(torch.device("cuda"), torch.bfloat16, hidden, inter) is None  # sm_90 only
    fp4_expert_bytes = 3 * inter * hidden * (0.5 + 1 / 16)
    bf16_expert_bytes = 3 * inter * hidden * 2
    rows = []
    for tokens in tokens_list:
        x, topk_w, topk_ids = random_routing(tokens, hidden, experts, top_k)
        hit = int(torch.unique(topk_ids).numel())
        repeats = 30 if tokens >= 4096 else 60
        act_bytes = 2 * 2 * tokens * hidden
        flops = 6 * tokens * top_k * hidden * inter
        half = tokens // 2
        flags = torch.zeros(tokens, dtype=torch.uint8, device="cuda")
        flags[half:] = 1
        result: dict[str, Any] = {"tokens": tokens, "experts_hit": hit}
        run = functools.partial(fused_moe, experts=weights.experts(), swiglu_limit=None)
        variants: dict[str, Callable[[], Any]] = {
            "w4a16": functools.partial(run, x, topk_w, topk_ids, a4_scales=None),
            "a4": functools.partial(run, x, topk_w, topk_ids, a4_scales=scales),
            "bf16": functools.partial(bf16_moe, x, topk_w, topk_ids, w13_bf16, w2_bf16),
        }
        default_config = choose_config(tokens * top_k, experts, hidden, inter)
        if default_config.decode is not None:
            tiled = dataclasses.replace(default_config, decode=None)
            variants["w4a16_tiled"] = functools.partial(
                run, x, topk_w, topk_ids, a4_scales=None, config=tiled
            )
        if a8_runs:
            for label in a8_labels:  # "a8", "a8_t256", "a8_rs", ..., timed in this order
                variants[label] = functools.partial(
                    fused_moe_a8, x, topk_w, topk_ids, weights.experts(), None, schedule=A8_SCHEDULES[label]
                )
        if marlin is not None:
            variants["marlin"] = functools.partial(marlin, x, topk_w, topk_ids)
        if humming is not None:
            variants["humming"] = functools.partial(humming, x, topk_w, topk_ids)
        elif humming_error:
            result["humming_error"] = humming_error
        references: dict[str, torch.Tensor] = {}
        if tokens <= ACCURACY_TOKENS:
            # fp32 activations: the exact MoE of the NVFP4 weights; bf16 activations: the same
            # with the kernels' own bf16 roundings (input, FC1 output) (docs/numerics.md)
            outputs: dict[str, torch.Tensor] = {}
            for variant in ("w4a16", "w4a16_tiled", "marlin", "humming", *A8_SCHEDULES):
                try:
                    if variant in variants:
                        outputs[variant] = variants[variant]().float()
                except Exception as error:  # a baseline's failure: its columns stay empty
                    result[f"{variant}_error"] = repr(error)[:300]
            for suffix, reference_input in {"": x.float(), "_bf16_io": x}.items():
                expected = moe_reference(reference_input, topk_w, topk_ids, weights.experts(), None).float()
                references[suffix] = expected
                for variant, output in outputs.items():
                    result[f"{variant}_rel_err{suffix}"] = relative_error(output, expected)
        if half:
            first, second = slice(0, half), slice(half, tokens)
            variants["split"] = functools.partial(run, x, topk_w, topk_ids, a4_scales=scales, row_flags=flags)
            variants["split_part_w4a16"] = functools.partial(
                run, x[first], topk_w[first], topk_ids[first], a4_scales=None
            )
            variants["split_part_a4"] = functools.partial(
                run, x[second], topk_w[second], topk_ids[second], a4_scales=scales
            )
        result["column_order"] = timing_order(variants, reverse_columns)
        for variant in result["column_order"]:
            try:
                result[f"{variant}_us"], began, ended = time_graph_window(variants[variant], repeats, flush)
                if clocks is not None:  # the GPU's clocks while these replays were timed
                    result[f"{variant}_clocks"] = clocks.summary(began, ended)
            except Exception as error:  # keep the rest of the table
                result[f"{variant}_us"] = None
                result[f"{variant}_error"] = repr(error)[:300]
        if sweep:
            result["default_config"] = dataclasses.asdict(default_config)
            sweep_began = time.monotonic()
            mode_fns = {"a4": variants["a4"]} if "a4" in sweep_modes else {}
            if "split" in variants and sweep == "prefill" and "split" in sweep_modes:
                mode_fns["split"] = variants["split"]
            result["sweep_w4a16_us"], errors, mode_times = sweep_configs(
                variants["w4a16"],
                tokens * top_k,
                experts,
                hidden,
                inter,
                flush,
                sweep,
                references,
                mode_fns,
                prefill_tiles,
            )
            for mode, by_label in mode_times.items():
                result[f"sweep_{mode}_us"] = by_label
            for suffix, by_label in errors.items():
                result[f"sweep_w4a16_rel_err{suffix}"] = by_label
            if clocks is not None:
                result["sweep_clocks"] = clocks.summary(sweep_began, time.monotonic())
        w4, bf, ma = result.get("w4a16_us"), result.get("bf16_us"), result.get("marlin_us")
        if w4:
            result["w4a16_GBps"] = (hit * fp4_expert_bytes + act_bytes) / (w4 * 1e-6) / 1e9
            result["w4a16_TFLOPs"] = flops / (w4 * 1e-6) / 1e12
        if ma:
            result["marlin_GBps"] = (hit * fp4_expert_bytes + act_bytes) / (ma * 1e-6) / 1e9
            if w4:
                result["w4a16_speedup_vs_marlin"] = ma / w4
            if result.get("w4a16_tiled_us"):
                result["w4a16_tiled_speedup_vs_marlin"] = ma / result["w4a16_tiled_us"]
        hu = result.get("humming_us")
        if hu:
            result["humming_TFLOPs"] = flops / (hu * 1e-6) / 1e12
            if w4:
                result["w4a16_speedup_vs_humming"] = hu / w4
        if w4 and dense_tflops:
            result["w4a16_dense_share"] = result["w4a16_TFLOPs"] / dense_tflops
        if result.get("a4_us"):
            result["a4_TFLOPs"] = flops / (result["a4_us"] * 1e-6) / 1e12
        if bf:
            result["bf16_GBps"] = (hit * bf16_expert_bytes + act_bytes) / (bf * 1e-6) / 1e9
            result["bf16_TFLOPs"] = flops / (bf * 1e-6) / 1e12
            for variant in ("w4a16", "a4", "split"):
                if result.get(f"{variant}_us"):
                    result[f"{variant}_speedup_vs_bf16"] = bf / result[f"{variant}_us"]
        if w4 and result.get("a4_us"):
            result["a4_over_w4a16"] = result["a4_us"] / w4
        for variant in A8_SCHEDULES:
            if result.get(f"{variant}_us"):
                result[f"{variant}_TFLOPs"] = flops / (result[f"{variant}_us"] * 1e-6) / 1e12
                if w4:
                    result[f"{variant}_speedup_vs_w4a16"] = w4 / result[f"{variant}_us"]
        if result.get("split_us") and result.get("split_part_w4a16_us") and result.get("split_part_a4_us"):
            result["split_over_parts"] = result["split_us"] / (
                result["split_part_w4a16_us"] + result["split_part_a4_us"]
            )
        rows.append(result)
        print(
            name,
            json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()}),
            file=log,
            flush=True,
        )
    del w13_bf16, w2_bf16, weights
    torch.cuda.empty_cache()
    return {"shape": shape, "rows": rows}


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = results["shapes"]
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 9), squeeze=False)
    for col, (name, data) in enumerate(shapes.items()):
        rows = data["rows"]
        tokens = [r["tokens"] for r in rows]
        ax = axes[0][col]
        for variant in ("bf16", "marlin", "humming", "w4a16", "w4a16_tiled", "a4", *A8_LABELS, "split"):
            points = [(r["tokens"], r[f"{variant}_us"]) for r in rows if r.get(f"{variant}_us")]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name}: time per MoE call (us)")
        ax.set_xlabel("tokens")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        ax = axes[1][col]
        roofline = results.get("copy_GBps")
        ax.plot(tokens, [r.get("w4a16_GBps", 0) for r in rows], marker="o", label="w4a16 GB/s (experts hit)")
        ax.plot(tokens, [r.get("bf16_GBps", 0) for r in rows], marker="o", label="bf16 GB/s (experts hit)")
        if any(r.get("marlin_GBps") for r in rows):
            ax.plot(
                tokens, [r.get("marlin_GBps", 0) for r in rows], marker="o", label="marlin GB/s (experts hit)"
            )
        if roofline:
            ax.axhline(roofline, color="k", linestyle="--", label=f"copy {roofline:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_title(f"{name}: effective bandwidth")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def clock_cell(row: dict[str, Any]) -> str:
    """The SM clock while a row's W4A16 replays were timed (``w4a16_clocks``, :mod:`gpu_clocks`):
    ``p10 / p50 / p90`` MHz, ``-`` for rows without it (older results, no ``nvidia-smi``, no busy
    sample)."""
    clocks = row.get("w4a16_clocks")
    if not clocks:
        return "-"
    return " / ".join(f"{mhz:.0f}" for mhz in clocks["sm_mhz_p10_p50_p90"])


def markdown_table(results: dict[str, Any]) -> str:
    """The results as markdown tables, one per shape (what ``benchmarks/results/README.md`` shows)."""

    def cell(row: dict[str, Any], key: str, digits: int = 1) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    lines = []
    for name, shape_result in results["shapes"].items():
        shape = shape_result["shape"]
        lines += [
            f"### {name} (H={shape['hidden']}, I={shape['intermediate']}, E={shape['experts']}, "
            f"top-{shape['top_k']})",
            "",
            "| tokens | experts hit | W4A16 us | W4A16 tiled us | Marlin us | Humming us | A4 us | split us "
            "| bf16 us | Marlin/W4A16 | Marlin/W4A16 tiled | Humming/W4A16 | W4A16 GB/s (% copy) "
            "| Marlin GB/s (% copy) | W4A16 TFLOP/s (% dense bf16) | bf16/W4A16 | A4/W4A16 | split/(parts) "
            "| rel err W4A16 | rel err Marlin | rel err Humming | rel err W4A16 (bf16 io) "
            "| rel err W4A16 tiled (bf16 io) | rel err Marlin (bf16 io) | rel err Humming (bf16 io) "
            "| A8 us | W4A16/A8 | A8 TFLOP/s | rel err A8 "
            + "".join(f"| {label} us | W4A16/{label} | rel err {label} " for label in A8_LABELS[1:])
            + "| SM MHz p10 / p50 / p90 |",
            "|" + "---|" * (30 + 3 * len(A8_LABELS[1:])),
        ]
        for row in shape_result["rows"]:

            def bandwidth(variant: str, row: dict[str, Any] = row) -> str:
                value = row.get(f"{variant}_GBps")
                return "-" if value is None else f"{value:.0f} ({value / results['copy_GBps'] * 100:.0f}%)"

            def error(key: str, row: dict[str, Any] = row) -> str:
                value = row.get(key)
                return "-" if value is None else f"{value:.1e}"

            share = row.get("w4a16_dense_share")
            tflops = cell(row, "w4a16_TFLOPs") + ("" if share is None else f" ({share * 100:.0f}%)")
            humming = (
                cell(row, "humming_us")
                if row.get("humming_us")
                else ("error" if row.get("humming_error") else "-")
            )
            lines.append(
                f"| {row['tokens']} | {row['experts_hit']} | {cell(row, 'w4a16_us')} "
                f"| {cell(row, 'w4a16_tiled_us')} | {cell(row, 'marlin_us')} | {humming} "
                f"| {cell(row, 'a4_us')} | {cell(row, 'split_us')} | {cell(row, 'bf16_us')} "
                f"| {cell(row, 'w4a16_speedup_vs_marlin', 2)} "
                f"| {cell(row, 'w4a16_tiled_speedup_vs_marlin', 2)} "
                f"| {cell(row, 'w4a16_speedup_vs_humming', 2)} "
                f"| {bandwidth('w4a16')} | {bandwidth('marlin')} "
                f"| {tflops} | {cell(row, 'w4a16_speedup_vs_bf16', 2)} "
                f"| {cell(row, 'a4_over_w4a16', 2)} | {cell(row, 'split_over_parts', 2)} "
                f"| {error('w4a16_rel_err')} | {error('marlin_rel_err')} | {error('humming_rel_err')} "
                f"| {error('w4a16_rel_err_bf16_io')} | {error('w4a16_tiled_rel_err_bf16_io')} "
                f"| {error('marlin_rel_err_bf16_io')} | {error('humming_rel_err_bf16_io')} "
                f"| {cell(row, 'a8_us')} | {cell(row, 'a8_speedup_vs_w4a16', 2)} | {cell(row, 'a8_TFLOPs')} "
                f"| {error('a8_rel_err')} "
                + "".join(
                    f"| {cell(row, f'{label}_us')} | {cell(row, f'{label}_speedup_vs_w4a16', 2)} "
                    f"| {error(f'{label}_rel_err')} "
                    for label in A8_LABELS[1:]
                )
                + f"| {clock_cell(row)} |"
            )
        lines.append("")
    return "\n".join(lines)


def committed_time(
    row: dict[str, Any], routes: int, shape: dict[str, int]
) -> tuple[str, float | None, float | None]:
    """The label, time and relative error (bf16 io), in a result row, of the config this
    checkout chooses for ``routes`` routes: the run's own default if it is the same config, else
    its sweep entry."""
    from a4prefill.ops.backends.triton.schedules import choose_config

    config = choose_config(routes, shape["experts"], shape["hidden"], shape["intermediate"])
    label = "tiled" if config.decode is None else f"decode_{config.decode}"
    if dataclasses.asdict(config) == row.get("default_config"):
        return label, row.get("w4a16_us"), row.get("w4a16_rel_err_bf16_io")
    time = row.get("sweep_w4a16_us", {}).get(label)
    error = row.get("sweep_w4a16_rel_err_bf16_io", {}).get(label)
    return label, time if isinstance(time, float) else None, error


def _us(time: float | None) -> str:
    return "-" if time is None else f"{time:.1f}"


def sweep_table(results: dict[str, Any]) -> str:
    """Per token count of a ``--sweep`` result: Marlin, the config this checkout chooses (timed
    in that run, :func:`committed_time`) and the fastest decode schedule of the sweep."""
    lines = []
    for name, shape_result in results["shapes"].items():
        shape = shape_result["shape"]
        rows = [
            row
            for row in shape_result["rows"]
            if any(label.startswith("decode_") for label in row.get("sweep_w4a16_us", {}))
        ]
        if not rows:
            continue
        lines += [
            f"### {name}: decode schedules (W4A16, same run as Marlin)",
            "",
            "| tokens | Marlin us | chosen config | its us | Marlin/chosen | its rel err (bf16 io) "
            "| fastest decode schedule | its us | Marlin/fastest | W4A16 tiled us |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            marlin = row.get("marlin_us")
            label, chosen, chosen_error = committed_time(row, row["tokens"] * shape["top_k"], shape)
            timed = {
                k: v
                for k, v in row["sweep_w4a16_us"].items()
                if k.startswith("decode_") and isinstance(v, float)
            }
            best = min(timed, key=timed.__getitem__) if timed else None
            tiled = row.get("w4a16_tiled_us") or (
                None if row["default_config"]["decode"] else row.get("w4a16_us")
            )

            def ratio(time: float | None, marlin: float | None = marlin) -> str:
                return "-" if not (marlin and time) else f"{marlin / time:.2f}"

            lines.append(
                f"| {row['tokens']} | {_us(marlin)} | {label.removeprefix('decode_')} | {_us(chosen)} "
                f"| {ratio(chosen)} | {'-' if chosen_error is None else f'{chosen_error:.1e}'} "
                f"| {best and best.removeprefix('decode_')} "
                f"| {_us(timed.get(best) if best else None)} | {ratio(timed.get(best) if best else None)} "
                f"| {_us(tiled)} |"
            )
        lines.append("")
    return "\n".join(lines)


def prefill_sweep_table(results: dict[str, Any]) -> str:
    """Per token count of a ``--sweep prefill`` result: the default W4A16 time (what this run's
    checkout chose) and each prefill tile pair's W4A16 time, with its A4 and split times over
    its W4A16 time."""
    lines = []
    for name, shape_result in results["shapes"].items():
        rows = [row for row in shape_result["rows"] if row.get("sweep_split_us") or row.get("sweep_a4_us")]
        labels = sorted({k for row in rows for k in row["sweep_w4a16_us"] if k.startswith("prefill_")})
        if not labels:
            continue
        header = " | ".join(label.removeprefix("prefill_") for label in labels)
        lines += [
            f"### {name}: prefill GEMM tiles as the whole MoE (W4A16 us, A4/W4A16, split/W4A16)",
            "",
            f"| tokens | default W4A16 us | {header} |",
            "|---|---|" + "---|" * len(labels),
        ]
        for row in rows:
            cells = []
            for label in labels:
                w4 = row["sweep_w4a16_us"].get(label)
                if not isinstance(w4, float):
                    cells.append("-")
                    continue
                ratios = [row.get(f"sweep_{mode}_us", {}).get(label) for mode in ("a4", "split")]
                shown = "/".join("-" if not isinstance(r, float) else f"{r / w4:.2f}" for r in ratios)
                cells.append(f"{w4:.1f} ({shown})")
            lines.append(f"| {row['tokens']} | {_us(row.get('w4a16_us'))} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="tokens 1, 64, 4096 only")
    parser.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        choices=["all", "decode", "focus", "prefill"],
        help="also time tile configs and decode schedules (W4A16); 'decode': decode schedules only; "
        "'focus': the DECODE_SWEEP_FOCUS schedules, W4A16 and A4 timed; 'prefill': the "
        "PREFILL_SWEEP prefill GEMM tiles at every size, W4A16, A4 and split timed",
    )
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", help="comma-separated token counts (overrides --quick)")
    parser.add_argument(
        "--baselines",
        default="marlin,humming",
        help="comma-separated vLLM baselines to time where importable: marlin, humming (default both)",
    )
    parser.add_argument(
        "--prefill-tiles",
        help="with --sweep prefill: comma-separated FC1[:FC2] names to time instead of PREFILL_SWEEP "
        "(a PREFILL_SCHEDULES label or ws_t<routes>_d<depth>; FC2 defaults to FC1)",
    )
    parser.add_argument(
        "--sweep-modes",
        default="a4,split",
        help="comma-separated modes the sweep also times beside W4A16: a4, split (default both; '' none)",
    )
    parser.add_argument(
        "--a8-schedules",
        help="comma-separated A8_SCHEDULES labels to time, in this order (default every one; on sm_90 "
        "only): run twice in opposite orders to see whether the card's heating favours the first",
    )
    parser.add_argument(
        "--reverse-columns",
        action="store_true",
        help="time each size's columns last to first (split, humming, marlin, ..., w4a16): with a run "
        "in the default order, shows whether the card's heating favours the first columns",
    )
    parser.add_argument("--plot", help="only plot this JSON result next to it")
    parser.add_argument("--table", help="only print this JSON result as markdown tables")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as handle:
            results = json.load(handle)
        print(markdown_table(results))
        print(sweep_table(results))
        print(prefill_sweep_table(results))
        return
    if args.plot:
        with open(args.plot) as handle:
            plot(json.load(handle), args.plot.removesuffix(".json") + ".png")
        return
    a8_labels = parse_a8_schedules(args.a8_schedules)
    shapes = names_in("--shapes", args.shapes, tuple(SHAPES))
    baselines = names_in("--baselines", args.baselines, ("marlin", "humming"))
    sweep_modes = names_in("--sweep-modes", args.sweep_modes, ("a4", "split"))
    if args.prefill_tiles and args.sweep != "prefill":
        parser.error("--prefill-tiles names the tiles of --sweep prefill: give both")
    prefill_tiles = parse_prefill_tiles(args.prefill_tiles)
    tokens = [1, 64, 4096] if args.quick else TOKENS
    if args.tokens:
        try:
            tokens = [int(t) for t in args.tokens.split(",")]
        except ValueError:
            parser.error(f"--tokens: expected a comma list of integers, got {args.tokens!r}")
        if min(tokens) < 1:
            parser.error(f"--tokens: expected token counts >= 1, got {args.tokens!r}")
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "copy_GBps": copy_bandwidth(),
        "dense_bf16_TFLOPs": dense_bf16_tflops(torch.empty(256 << 20, dtype=torch.uint8, device="cuda")),
        "split_mix": "first half of the rows decode (W4A16), second half prefill (A4)",
        "timing": "CUDA graph replay, L2 flushed before each, median; routing+combine included",
        "shapes": {},
    }
    started = time.time()
    with ClockSampler() as clocks:
        for name in shapes:
            results["shapes"][name] = bench_shape(
                name,
                SHAPES[name],
                tokens,
                args.sweep,
                sys.stdout,
                results["dense_bf16_TFLOPs"],
                baselines,
                prefill_tiles,
                sweep_modes,
                clocks,
                a8_labels,
                args.reverse_columns,
            )
    results["seconds"] = time.time() - started
    path = os.path.join(args.out, "bench_moe.json")
    with open(path, "w") as handle:
        json.dump(results, handle, indent=1)
    try:
        plot(results, os.path.join(args.out, "bench_moe.png"))
    except ImportError as error:
        print(f"no plot here ({error}); run with --plot {path} where matplotlib is installed")


if __name__ == "__main__":
    main()
