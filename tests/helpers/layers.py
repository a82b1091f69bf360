"""Test helpers: the tiny layer's sizes, inputs and strategies, exact one-product cases, the
e4m3 scale-byte sets, and the tolerance of GPU backends against the reference. Imported as
``helpers.layers`` (fixtures stay in ``conftest.py``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.tools.tiny_layer import random_routing

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 6, 2
A8_HIDDEN, A8_INTERMEDIATE = 128, 128  # the A8 layer's sizes: A8 needs multiples of 128
# GPU backends vs the reference, per precision: (relative Frobenius error, fraction of elements
# off by more than two bf16 ulps). A4 rounding flips can move an FC2 input by one FP4 code.
# A kernel against its own precision's reference: A8 on the CPU interpreter (exact block sums)
# against ``moe_reference_a8`` as tight as W4A16 kernels against ``moe_reference`` (only the fp32
# sums' order differs). "a8_tensor_cores": A8 on the FP8 tensor cores, which add a block's products
# with about 14 significant bits (H200: up to 2**-11.2 of the absolute product,
# benchmarks/results/README.md, issue 28); an FC1 output one bf16 ulp off can round to the
# neighbouring e4m3 code as FC2's input, a 2**-4 step of that input, so more output elements move
# by a few ulps (H200: 14%) while the relative error stays as small as W4A16's.
BOUNDS = {"w4a16": (5e-3, 0.01), "a4": (2e-2, 0.05), "a8": (5e-3, 0.01), "a8_tensor_cores": (5e-3, 0.25)}


def make_inputs(
    tokens: int, seed: int = 0, hidden_size: int = HIDDEN
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 hidden states [T, hidden_size] and random routing for the tiny layer (example tests)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(tokens, hidden_size, generator=generator)).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(tokens, EXPERTS, TOP_K, generator)
    return hidden, topk_weights, topk_ids


def rows_of(spans) -> torch.Tensor:
    """int64 indices of every row of ``spans`` (``(start, end)`` pairs), in order."""
    return torch.tensor([r for a, b in spans for r in range(a, b)], dtype=torch.long)


@st.composite
def moe_inputs(
    draw: st.DrawFn, tokens: int, hidden_size: int = HIDDEN
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drawn bf16 hidden states [T, hidden_size] and routing (top-k of drawn router logits)."""
    values = draw(
        hnp.arrays(
            np.float32, (tokens, hidden_size), elements=st.floats(-8, 8, width=32, allow_subnormal=False)
        )
    )
    logits = draw(
        hnp.arrays(np.float32, (tokens, EXPERTS), elements=st.floats(-4, 4, width=32), unique=False)
    )
    hidden = torch.from_numpy(values).to(torch.bfloat16)
    # Ties between drawn logits are broken by a tiny per-expert offset: top-k ids stay distinct.
    scores = torch.from_numpy(logits) + torch.arange(EXPERTS) * 1e-3
    top, ids = scores.topk(TOP_K, dim=1)
    return hidden, torch.softmax(top, dim=1), ids.to(torch.int32)


def halves_case(layer, ratio: float):
    """Two parameter sets that dequantize identically: (a) gate and up global scales differ by
    ``ratio`` (a power of two) with the up block scales divided by it, (b) one global scale per
    expert with the original up block scales. Block scales are kept in [2**-5, 224] so that
    halving or doubling them stays an exact e4m3 value."""
    experts = layer.experts
    intermediate = experts.w13_weight.shape[1] // 2
    blocks = experts.w13_weight_scale.float().clamp(min=2**-5, max=224)
    uniform = dataclasses.replace(experts, w13_weight_scale=blocks.to(torch.float8_e4m3fn))
    up_blocks = blocks.clone()
    up_blocks[:, intermediate:] /= ratio
    assert torch.equal(up_blocks.to(torch.float8_e4m3fn).float(), up_blocks)  # exact
    scale_2 = experts.w13_weight_scale_2.clone()
    scale_2[:, 1] *= ratio
    halves = dataclasses.replace(
        experts, w13_weight_scale=up_blocks.to(torch.float8_e4m3fn), w13_weight_scale_2=scale_2
    )
    return halves, uniform


EVERY_SCALE_BYTE = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
SCALE_BYTE_SETS = {  # e4m3 block-scale bytes the exactness tests draw from (NaN bytes left out)
    "positive normal": EVERY_SCALE_BYTE[(EVERY_SCALE_BYTE >= 0x08) & (EVERY_SCALE_BYTE < 0x7F)],
    "subnormal and zero": EVERY_SCALE_BYTE[EVERY_SCALE_BYTE < 0x08],
    "negative": EVERY_SCALE_BYTE[EVERY_SCALE_BYTE >= 0x80],
    "every non-NaN byte": EVERY_SCALE_BYTE,
}
E2M1_TABLE = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def one_hot_case(
    scale_bytes: torch.Tensor, seed: int, hidden: int, inter: int, columns: torch.Tensor
) -> tuple[NvFp4Experts, torch.Tensor, torch.Tensor]:
    """Two experts and inputs for which every output element is one exact product per GEMM.

    FC1: random code bytes and block-scale bytes drawn from ``scale_bytes``, global scales 1.
    FC2: +1.0 at column ``n % I`` of row ``n`` (code 2, scale 1.0), zeros elsewhere, global scale
    1. Token ``t`` is the one-hot row of column ``columns[t]`` and goes to expert ``t % 2`` with
    weight 1, so ``out[t, n] = h_t[n % I]`` with ``gate, up = W13[t % 2][:, columns[t]]``.
    """
    experts = 2
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), dtype=torch.uint8, generator=generator)
    index = torch.randint(0, scale_bytes.numel(), (experts, 2 * inter, hidden // 16), generator=generator)
    w13_scale = scale_bytes[index].view(torch.float8_e4m3fn)
    w2_codes = torch.zeros(hidden, inter, dtype=torch.uint8)
    w2_codes[torch.arange(hidden), torch.arange(hidden) % inter] = 2  # e2m1 code 2 = +1.0
    packed = w2_codes[:, 0::2] | (w2_codes[:, 1::2] << 4)
    w2 = packed.expand(experts, -1, -1).contiguous()
    w2_scale = torch.full((experts, hidden, inter // 16), 1.0).to(torch.float8_e4m3fn)
    weights = NvFp4Experts(w13, w13_scale, torch.ones(experts, 2), w2, w2_scale, torch.ones(experts))
    tokens = len(columns)
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    x[torch.arange(tokens), columns] = 1.0
    ids = (torch.arange(tokens) % experts).to(torch.int32).reshape(tokens, 1)
    return weights, x, ids


def one_hot_expected(weights: NvFp4Experts, columns: torch.Tensor) -> torch.Tensor:
    """The output of :func:`one_hot_case` from the literal e2m1 table and torch's e4m3 decoding,
    with the reference epilogue (bf16 gate and up, bf16 SiLU, bf16 product)."""
    inter = weights.w13_weight.shape[1] // 2
    hidden = weights.w2_weight.shape[1]
    codes = torch.stack((weights.w13_weight & 15, weights.w13_weight >> 4), dim=-1).flatten(-2).long()
    scales = weights.w13_weight_scale.float().repeat_interleave(16, dim=-1)
    w13 = E2M1_TABLE[codes] * scales  # [2, 2I, H], exact in fp32
    token = torch.arange(len(columns))
    gate_up = w13[token % 2, :, columns]  # [T, 2I]
    gate = gate_up[:, :inter].to(torch.bfloat16).float()
    up = gate_up[:, inter:].to(torch.bfloat16).float()
    h = ((gate / (1 + torch.exp(-gate))).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    return h[:, torch.arange(hidden) % inter]


def assert_close_to_reference(result: torch.Tensor, expected: torch.Tensor, precision: str) -> None:
    """``result`` is within ``BOUNDS[precision]`` of the reference output ``expected``."""
    rel_frob, flip_fraction = BOUNDS[precision]
    result, expected = result.float().cpu(), expected.float().cpu()
    assert torch.isfinite(result).all()
    error = float((result - expected).norm() / expected.norm().clamp(min=1e-30))
    ulp = torch.exp2(torch.floor(torch.log2(expected.abs().clamp(min=2**-60))) - 7)
    flips = float(((result - expected).abs() > 2 * ulp).float().mean())
    assert error < rel_frob, f"{precision}: relative Frobenius error {error:.2e} >= {rel_frob}"
    assert flips <= flip_fraction, f"{precision}: {flips:.2%} of elements off by > 2 ulps"
