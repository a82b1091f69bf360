"""A8 accuracy by activation-scale granularity (issue 28, docs/numerics.md section 8), on the CPU.

``moe_reference_a8`` with the contract's activation scales (one per row, ``fp8.quantize_rows``)
against the same MoE with one scale per row and 128-column block (the contract before
2026-12-05, :func:`quantize_rows_per_block` below: the comparison baseline, not used by the
package), both as relative L2 error against the exact MoE of the NVFP4 weights (fp32
activations, ``moe_reference``), and W4A16 with bf16 activations beside them. Random layers of
the tiny-layer generator (random NVFP4 weights, calibrated), 64 tokens, top-2, Gaussian
activations with ``--outlier-channels`` channels scaled by each ``--outliers`` factor (LLM
hidden states carry a few such channels). Numerics, not speed: no GPU needed.

Writes ``a8_scale_granularity.json`` (per shape and outlier factor, each seed's errors) and
``a8_scale_granularity.png`` into ``--out``."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from a4prefill.ops import fp8, reference
from a4prefill.ops.reference import moe_reference, moe_reference_a8
from a4prefill.tools.numerics.layer_metrics import relative_error
from a4prefill.tools.tiny_layer import make_tiny_layer, random_routing


def quantize_rows_per_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The A8 activations of the earlier contract: ``fp8.quantize_rows``' arithmetic per row and
    128-column block, in the form ``fp8.block_product`` takes: ``(values fp32 [M, K], ones
    [M])``, each value its e4m3 code times its block's scale. The product then sums each block's
    decoded values against the weights, the earlier contract's numbers up to the fp32 rounding
    of the block sums."""
    rows, k = x.shape
    blocks = x.to(torch.float32).reshape(rows, k // fp8.A8_BLOCK, fp8.A8_BLOCK)
    amax = blocks.abs().amax(dim=2)
    floored = amax.clamp(min=fp8.AMAX_FLOOR)
    e4m3_max = torch.full_like(floored, fp8.E4M3_MAX)
    codes = (blocks * (e4m3_max / floored)[..., None]).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.FP8)
    block_scales = torch.where(amax > 0, floored / e4m3_max, 0.0)
    decoded = codes.to(torch.float32) * block_scales[..., None]
    return decoded.reshape(rows, k), torch.ones(rows)


def relative_errors(
    hidden: int, intermediate: int, outlier: float, channels: int, seed: int
) -> dict[str, float]:
    """Relative L2 errors of one random layer and call against the exact MoE."""
    layer = make_tiny_layer(8, hidden, intermediate, 2, seed=seed, calibration_tokens=64)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(64, hidden, generator=generator)
    x[:, torch.randperm(hidden, generator=generator)[:channels]] *= outlier
    x = x.bfloat16()
    weights, ids = random_routing(64, 8, 2, generator)
    exact = moe_reference(x.float(), weights, ids, layer.experts, None).float()

    def error(output: torch.Tensor) -> float:
        return relative_error(output, exact)

    per_row = error(moe_reference_a8(x, weights, ids, layer.experts))
    contract = fp8.quantize_rows
    reference.fp8.quantize_rows = quantize_rows_per_block  # type: ignore[assignment]
    try:
        per_block = error(moe_reference_a8(x, weights, ids, layer.experts))
    finally:
        reference.fp8.quantize_rows = contract  # type: ignore[assignment]
    w4a16 = error(moe_reference(x, weights, ids, layer.experts, None))
    return {"a8_per_row": per_row, "a8_per_block": per_block, "w4a16_bf16": w4a16}


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    labels = [f"H{r['hidden']} x{r['outlier']:g}" for r in results]
    positions = range(len(results))
    for offset, key in ((-0.2, "a8_per_block"), (0.0, "a8_per_row"), (0.2, "w4a16_bf16")):
        means = [sum(seed[key] for seed in r["seeds"]) / len(r["seeds"]) for r in results]
        axis.bar([p + offset for p in positions], means, width=0.2, label=key)
    axis.set_xticks(list(positions), labels, rotation=30)
    axis.set_ylabel("relative L2 error vs exact MoE")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--shapes", default="1024x256,2048x512", help="HIDDENxINTERMEDIATE, comma-separated")
    parser.add_argument("--outliers", default="1,30,100,1000", help="outlier channel factors")
    parser.add_argument("--outlier-channels", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3, help="random layers and inputs per point (>= 1)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds: expected at least 1, got {args.seeds}")
    shapes = []
    for shape in args.shapes.split(","):
        try:
            hidden, intermediate = (int(v) for v in shape.split("x"))
        except ValueError:
            parser.error(f"--shapes: expected HIDDENxINTERMEDIATE entries, got {shape!r}")
        if hidden % 128 or intermediate % 128 or hidden < 1 or intermediate < 1:
            parser.error(f"--shapes: A8 needs HIDDEN and INTERMEDIATE multiples of 128, got {shape!r}")
        shapes.append((hidden, intermediate))
    results = []
    for hidden, intermediate in shapes:
        for outlier in (float(v) for v in args.outliers.split(",")):
            seeds = [
                relative_errors(hidden, intermediate, outlier, args.outlier_channels, seed)
                for seed in range(1, args.seeds + 1)
            ]
            results.append(
                {"hidden": hidden, "intermediate": intermediate, "outlier": outlier, "seeds": seeds}
            )
            means = {key: sum(s[key] for s in seeds) / len(seeds) for key in seeds[0]}
            print(
                hidden, intermediate, f"x{outlier:g}", {key: f"{value:.4f}" for key, value in means.items()}
            )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "a8_scale_granularity.json"), "w") as handle:
        json.dump({"experts": 8, "top_k": 2, "tokens": 64, "results": results}, handle, indent=1)
    plot(results, os.path.join(args.out, "a8_scale_granularity.png"))


if __name__ == "__main__":
    main()
