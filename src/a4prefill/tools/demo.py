"""The built-in default job: a random NVFP4 MoE layer through the custom ops, numerics table.

Runs ``moe_w4a16``, ``moe_a4`` and ``moe_split`` (on a batch of decode and prefill requests)
and compares them with fp32 dense computations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a4prefill import ops
from a4prefill.ops.modelopt import dequantize_experts
from a4prefill.ops.scales import derive_a4_scales
from a4prefill.tools.numerics.layer_metrics import relative_error
from a4prefill.tools.tiny_layer import dense_moe_fp32, make_tiny_layer, random_routing


@dataclass(frozen=True)
class NumericsRow:
    name: str
    rel_error_vs_float: float
    rel_error_vs_dequantized: float
    max_abs_error_vs_dequantized: float


def run_demo(tokens: int = 96, seed: int = 0, device: str = "cpu") -> list[NumericsRow]:
    """Run the three ops on a random layer; return one numerics row per op."""
    layer = make_tiny_layer(seed=seed)
    experts = layer.experts.to(device)
    scales = derive_a4_scales(layer.quantized.w13_input_scale, layer.quantized.w2_input_scale).to(device)
    generator = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(tokens, layer.hidden_size, generator=generator).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(tokens, layer.num_experts, layer.top_k, generator)
    w13_dq, w2_dq = dequantize_experts(layer.experts)
    float_ref = dense_moe_fp32(hidden, topk_weights, topk_ids, layer.w13, layer.w2)
    dequant_ref = dense_moe_fp32(hidden, topk_weights, topk_ids, w13_dq, w2_dq)
    # A quarter of the rows are decode requests (one row each), the rest three prompts.
    prompt_rows = tokens - tokens // 4
    query_lens = [1] * (tokens // 4) + [
        prompt_rows // 3,
        prompt_rows // 3,
        prompt_rows - 2 * (prompt_rows // 3),
    ]
    row_types = ops.row_types_from_query_lens(query_lens, max_decode_len=1)
    args = (hidden.to(device), topk_weights.to(device), topk_ids.to(device), experts, scales, "demo.layer0")
    results = {"W4A16": ops.call_moe(ops.moe_w4a16, *args), "A4": ops.call_moe(ops.moe_a4, *args)}
    with ops.step_row_types(row_types):
        results[f"split ({row_types.num_decode_rows} decode + {row_types.num_prefill_rows} prefill rows)"] = (
            ops.call_moe(ops.moe_split, *args)
        )
    return [
        NumericsRow(
            name,
            relative_error(out.cpu(), float_ref),
            relative_error(out.cpu(), dequant_ref),
            float((out.cpu().float() - dequant_ref).abs().max()),
        )
        for name, out in results.items()
    ]


def format_table(rows: list[NumericsRow]) -> str:
    """A plain-text table of the numerics rows."""
    header = (
        f"{'op':<40} {'rel.err vs fp32 float W':>24} {'rel.err vs fp32 dequant W':>26} {'max abs err':>12}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row.name:<40} {row.rel_error_vs_float:>24.4%} {row.rel_error_vs_dequantized:>26.4%} "
            f"{row.max_abs_error_vs_dequantized:>12.4g}"
        )
    return "\n".join(lines)
