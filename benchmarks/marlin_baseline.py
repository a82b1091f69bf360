"""vLLM's Marlin NVFP4 MoE on the package's weights: the W4A16 kernel vLLM serves ModelOpt NVFP4
experts with on Hopper, as a benchmark baseline (a helper of ``bench_moe.py``; needs CUDA vLLM).

How vLLM calls it (read in vLLM 0.26 and 0.32; docs/vllm-internals.md, section 8):
``prepare_nvfp4_moe_layer_for_marlin`` repacks the codes and block scales into Marlin's tile
order once (a second copy of the experts, which is why this is a baseline and not a backend), and
``fused_marlin_moe`` runs routing, both GEMMs, SwiGLU and the top-k combine. Marlin keeps one
global scale per expert for FC1, so the gate half's ``weight_scale_2`` stands for both halves, as
vLLM's ModelOpt method passes it; the benchmark's random weights have equal halves.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch


def marlin_moe(weights: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``fn(hidden [T, H] bf16, topk_weights [T, k], topk_ids [T, k]) -> [T, H] bf16`` over
    Marlin-repacked copies of ``weights`` (:class:`a4prefill.ops.modelopt.NvFp4MoEWeights` on
    CUDA); ``None`` when vLLM's Marlin MoE is not importable here."""
    try:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
            prepare_nvfp4_moe_layer_for_marlin,
        )
        from vllm.scalar_type import scalar_types
    except ImportError:
        return None
    experts, two_i, hidden_half = weights.w13_weight.shape
    layer = SimpleNamespace(
        num_experts=experts,
        hidden_size=2 * hidden_half,
        intermediate_size_per_partition=two_i // 2,
        params_dtype=torch.bfloat16,
    )
    w1, w1_scale, global_1, w2, w2_scale, global_2 = prepare_nvfp4_moe_layer_for_marlin(
        layer,
        weights.w13_weight,
        weights.w13_weight_scale,
        weights.w13_weight_scale_2[:, 0].contiguous(),
        weights.w2_weight,
        weights.w2_weight_scale,
        weights.w2_weight_scale_2,
        is_act_and_mul=True,
    )
    keywords: dict[str, Any] = {
        "quant_type_id": scalar_types.float4_e2m1f.id,
        "global_scale1": global_1,
        "global_scale2": global_2,
        "global_num_experts": experts,
        "activation": MoEActivation.SILU,
        "is_k_full": True,  # vLLM 0.26's MarlinExperts passes it; later versions dropped it
    }
    accepted = inspect.signature(fused_marlin_moe).parameters
    keywords = {name: value for name, value in keywords.items() if name in accepted}

    def run(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_marlin_moe(
            hidden,
            w1,
            w2,
            None,
            None,
            w1_scale,
            w2_scale,
            topk_weights.float(),
            topk_ids.to(torch.int32),
            **keywords,
        )

    return run
