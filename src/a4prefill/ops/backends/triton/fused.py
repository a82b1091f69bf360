"""The ``triton`` backend's MoE call (:func:`fused_moe`): grouped NVFP4 MoE GEMMs in Triton on any
CUDA GPU.

Per call (``T`` tokens, top-k ``k``, ``R = T * k`` routes, weights as loaded, no second copy):

1. routing on the GPU (:func:`routing.sort_routes`): routes sorted by expert id, per-expert segments
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
:data:`schedules.DECODE_MAX_ROWS_PER_EXPERT` routes per active expert (decode sizes) run steps 3
and 4's GEMMs in :mod:`decode_kernels` instead (weights on the MMA's M side, codes loaded straight
into MMA registers), when the shapes fit its schedule (:class:`schedules.DecodeTiles`) and the GPU
is sm_80+; same routing, A4 quantization, combine and numerics contract. Calls with bf16
activations on an sm_90 GPU and at least :data:`schedules.PREFILL_MIN_ROWS_PER_EXPERT` routes per
expert (mean) run them in :mod:`prefill_kernels` (wgmma, weights dequantized on the way in)
instead, decode sizes above that included, in every precision mode (the A4 rows quantized by
the same pass first). What a call launches is its
:class:`plan.CallPlan`.

Out-of-range expert ids (``< 0`` or ``>= E``): those routes are ignored (they contribute
nothing to the output); no error is raised, since checking would need a host sync.

Who may call: :class:`~a4prefill.ops.backends.triton.backend.TritonBackend`, :mod:`warmup`, tests
and benchmarks.
"""

from __future__ import annotations

from typing import Any

import torch

from a4prefill.ops.backends.triton import kernel_modules
from a4prefill.ops.backends.triton.plan import CallPlan, plan_call
from a4prefill.ops.backends.triton.prefill import launch_prefill_gemm
from a4prefill.ops.backends.triton.quantize import quantize_rows
from a4prefill.ops.backends.triton.routing import RoutingLaunch, sort_routes
from a4prefill.ops.backends.triton.schedules import DecodeGemm, DecodeTiles, GemmConfig, cdiv, next_pow2
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.precision import MODE_A4, MODE_SPLIT, MODE_W4A16
from a4prefill.ops.rows import RowTypes
from a4prefill.ops.scales import A4Scales


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
    aligned copies: the kernels a call launches depend on its :class:`plan.CallPlan` and mode only."""
    tokens, hidden = hidden_states.shape
    fc1, fc2 = experts.fc1, experts.fc2
    num_experts, inter = fc1.experts, fc1.rows // 2
    top_k = topk_ids.shape[1]
    routes = tokens * top_k
    output = torch.empty_like(hidden_states)
    if tokens == 0:
        return output
    hidden_states = _aligned(hidden_states)
    topk_weights = _aligned(topk_weights.to(torch.float32))
    topk_ids = _aligned(topk_ids.to(torch.int32))
    kernels = kernel_modules.tiled()
    plan = plan_call(
        tokens, top_k, num_experts, hidden, inter, hidden_states.dtype, hidden_states.device, config
    )
    cfg = plan.config
    if a4_scales is None:
        mode, fc1_input = MODE_W4A16, hidden_states
        gs1 = gs2 = fc2.scale_2  # unused
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
    if plan.prefill is not None:
        precision = (mode, (gs1, gs2), row_flags)
        _fused_moe_prefill(fc1_input, topk_weights, topk_ids, experts, swiglu_limit, plan, output, precision)
        return output
    routing = sort_routes(topk_ids.reshape(-1), num_experts, plan.routing)
    ptx = plan.ptx
    flags = row_flags if row_flags is not None else routing.seg_count  # unused unless MODE_SPLIT
    h = torch.empty(routes, inter, dtype=hidden_states.dtype, device=hidden_states.device)
    limit = float(swiglu_limit or 0.0)
    common = routing.kernel_args()
    split1, split2 = plan.split_k
    f32 = torch.float32
    device = hidden_states.device
    acc1 = torch.zeros(routes, fc1.rows, dtype=f32, device=device) if split1 > 1 else h
    scalars = (gs1, gs2, flags)
    fc1_grid = (routing.max_tiles, cdiv(inter, cfg.fc1_n), split1)
    kernels.fc1_kernel[fc1_grid](
        fc1_input,
        fc1.codes,
        fc1.scale_bytes(),
        fc1.scale_2,
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
            fc1.scale_2,
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
    kernels.fc2_kernel[(routing.max_tiles, cdiv(hidden, cfg.fc2_n), split2)](
        h,
        fc2.codes,
        fc2.scale_bytes(),
        fc2.scale_2,
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
    """``output [T, H] = sum_j topk_weights[:, j] * y[route]`` (:func:`shared_kernels.combine_kernel`;
    ``y`` fp32 split-K sums when ``from_acc``, else io rows; ``gs2``/``flags`` read for A4 only)."""
    tokens, hidden = output.shape
    block_h = min(1024, next_pow2(hidden))
    kernel_modules.shared().combine_kernel[(tokens, cdiv(hidden, block_h))](
        y,
        topk_weights,
        topk_ids,
        output,
        experts.fc2.scale_2,
        gs2,
        flags,
        hidden,
        experts.fc1.experts,
        topk_ids.shape[1],
        FROM_ACC=from_acc,
        MODE=mode,
        PTX=ptx,
        BH=block_h,
        num_warps=4,
    )


def _fused_moe_prefill(
    fc1_input: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: NvFp4Experts,
    swiglu_limit: float | None,
    plan: CallPlan,
    output: torch.Tensor,
    precision: tuple[int, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None],
) -> None:
    """The MoE through the Hopper prefill GEMMs (``plan.prefill``, bf16 io, sm_90): FC1 with the
    SwiGLU epilogue into ``h [R, I]`` (sorted positions), FC2 with the alpha epilogue into ``y [R,
    H]`` (by route), then the top-k sum into ``output``. ``precision`` is ``(mode, (gs1, gs2),
    row_flags)`` as :func:`fused_moe` derived them: ``fc1_input`` holds the A4 rows already
    quantized, the epilogues apply the A4 routes' multipliers and FC1 re-quantizes their ``h``
    (``prefill.launch_prefill_gemm``). Same routing contract and numerics as the tiled path (only
    the fp32 additions' order differs)."""
    assert plan.prefill is not None and plan.prefill_routing is not None
    mode, encode_scales, row_flags = precision
    fc1, fc2 = experts.fc1, experts.fc2
    routes, top_k = topk_ids.numel(), topk_ids.shape[1]
    routing = sort_routes(topk_ids.reshape(-1), fc1.experts, plan.prefill_routing)
    device = fc1_input.device
    modes: dict[str, Any] = {"mode": mode, "row_flags": row_flags, "routes_per_token": top_k}
    if mode != MODE_W4A16:
        modes["encode_scales"] = encode_scales
    fc1_gemm, fc2_gemm = plan.prefill.fc1, plan.prefill.fc2
    h = torch.empty(routes, fc1.rows // 2, dtype=torch.bfloat16, device=device)
    # FC1 writes h in the register-weights FC2's column order: no gather of h between the two
    h_mma_order = fc2_gemm.register_weights
    launch_prefill_gemm(
        fc1_input,
        fc1.codes,
        fc1.scale_bytes(),
        routing,
        h,
        fc1_gemm,
        top_k,
        epilogue="swiglu",
        scale2=fc1.scale_2,
        swiglu_limit=swiglu_limit,
        out_mma_order=h_mma_order,
        **modes,
    )
    y = torch.empty(routes, fc2.rows, dtype=torch.bfloat16, device=device)
    launch_prefill_gemm(
        h,
        fc2.codes,
        fc2.scale_bytes(),
        routing,
        y,
        fc2_gemm,
        None,
        epilogue="alpha",
        scale2=fc2.scale_2,
        x_mma_order=h_mma_order,
        **modes,
    )
    flags = routing.seg_count  # not read: y holds finished rows
    _combine(y, topk_weights, topk_ids, output, experts, fc2.scale_2, flags, MODE_W4A16, False, False)


def _decode_launch_args(gemm: DecodeGemm, routes: int) -> dict[str, Any]:
    """The schedule constexprs and launch options of one :mod:`decode_kernels` GEMM schedule with
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
    """The MoE through the decode kernels (bf16 io; ``launch`` is the :class:`plan.CallPlan`'s decode
    schedule, which fits the shapes, routing and overlap): ``fc1_input
    [T, H]`` as :func:`fused_moe` forms it (A4 rows already quantized), ``mode`` one of
    ``MODE_*``, ``encode_scales = (gs1 [1], gs2 [E])`` and ``row_flags [T]`` read only for the
    A4 rows of ``MODE_A4`` / ``MODE_SPLIT``.

    Same routing, combine and numerics as :func:`fused_moe`; FC1 and FC2 are
    :mod:`decode_kernels`'s kernels on activations permuted into their K order. Writes ``output``.
    """
    decode = kernel_modules.decode()
    tokens, hidden = fc1_input.shape
    fc1, fc2 = experts.fc1, experts.fc2
    inter = fc1.rows // 2
    top_k = topk_ids.shape[1]
    routes = tokens * top_k
    schedule, routing_plan, overlap = launch
    routing = sort_routes(topk_ids.reshape(-1), fc1.experts, routing_plan)
    device = fc1_input.device
    x = torch.empty_like(fc1_input)
    block_h = min(1024, next_pow2(hidden))
    decode.permute_k_kernel[(tokens, cdiv(hidden, block_h))](fc1_input, x, hidden, BH=block_h, num_warps=4)
    gs1, gs2 = encode_scales
    flags = row_flags if row_flags is not None else routing.seg_count  # unused unless MODE_SPLIT
    common = routing.kernel_args()
    h = torch.empty(routes, inter, dtype=torch.bfloat16, device=device)
    decode.fc1_decode_kernel[(routing.max_tiles, inter // schedule.fc1.rows_per_cta)](
        x,
        fc1.code_words(),
        fc1.scale_pairs(),
        fc1.scale_2,
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
        fc2.code_words(),
        fc2.scale_pairs(),
        fc2.scale_2,
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
