"""What b12x 1.5.1's own torch references compute, derived from vLLM's ModelOpt tensors (tests only).

b12x's references (``b12x.moe._shared.kernels.reference``) take b12x's tensors: the up-first
``w13``, 128x4-swizzled block scales, one FC1 alpha per expert, encode scales. This module computes
the same numbers from the tensors the package receives from vLLM (gate-first ``w13_weight``, plain
block scales, per-half ``w13_weight_scale_2``, the package's A4 scales), with b12x's order of
evaluation and rounding points, per route as b12x's loops do:

- A4 (``moe_reference_nvfp4``): the token quantized with the shared ``gs1``; ``gate, up =
  (W @ x) * alpha1`` in fp32 with ``alpha1 = fp32(weight_scale_2[half] / gs1)``; ``h =
  bf16(gate * sigmoid(gate) * up)``, the one rounding before FC2; ``h`` re-quantized with
  ``gs2[e]``; ``y = (W2 @ h) * fp32(w2_weight_scale_2 / gs2)`` in fp32, no rounding; the routes'
  ``y * router_weight`` summed in fp32, rounded to bf16 once.
- W4A16 (``moe_reference_w4a16_f32``): the same with unquantized fp32 activations, ``alpha1 =
  weight_scale_2[half]``, ``alpha2 = w2_weight_scale_2``, no rounding at all, fp32 output.

So equality with b12x's reference run on the package's translation checks the translation (half
order, swizzle, the per-half scale fold, alphas, encode scales) bit for bit. The package's own
contract (:mod:`a4prefill.ops.reference`) rounds more often (gate and up, silu, each route's
``y``): docs/numerics.md, section 7, says what that costs against b12x's references.
"""

from __future__ import annotations

import torch

from a4prefill.ops import nvfp4
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.scales import A4Scales


def b12x_reference_from_modelopt(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: NvFp4Experts,
    a4_scales: A4Scales | None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """b12x's reference output for ``hidden_states [T, H]`` (see the module docstring): A4 with
    ``a4_scales`` (bf16 ``[T, H]``), else W4A16 (fp32 ``[T, H]``). CPU, tiny shapes only."""
    tokens, hidden = hidden_states.shape
    inter = experts.w13_weight.shape[1] // 2
    dequantized: dict[int, tuple[torch.Tensor, ...]] = {}
    output = torch.zeros(tokens, hidden, dtype=torch.float32)
    for t in range(tokens):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e not in dequantized:
                w13 = nvfp4.dequantize_blocks(experts.w13_weight[e], experts.w13_weight_scale[e])
                w2 = nvfp4.dequantize_blocks(experts.w2_weight[e], experts.w2_weight_scale[e])
                dequantized[e] = (w13[:inter], w13[inter:], w2)
            gate_w, up_w, w2 = dequantized[e]
            scale_2 = experts.w13_weight_scale_2[e]
            if a4_scales is None:
                x = hidden_states[t].float()
                alphas = (float(scale_2[0]), float(scale_2[1]), float(experts.w2_weight_scale_2[e]))
            else:
                gs1, gs2 = a4_scales.fc1_encode_scale, a4_scales.fc2_encode_scales[e].reshape(1)
                x = nvfp4.quantize_dequantize_blocks(hidden_states[t : t + 1], gs1)[0]
                alphas = (
                    float(scale_2[0] / gs1[0]),
                    float(scale_2[1] / gs1[0]),
                    float(experts.w2_weight_scale_2[e] / gs2[0]),
                )
            gate = (gate_w @ x) * alphas[0]
            up = (up_w @ x) * alphas[1]
            if swiglu_limit is not None:
                gate = gate.clamp(max=swiglu_limit)
                up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
            h = gate * torch.sigmoid(gate) * up
            if a4_scales is not None:
                h = nvfp4.quantize_dequantize_blocks(h.to(torch.bfloat16)[None], gs2)[0]
            y = (w2 @ h) * alphas[2]
            output[t] += y * float(topk_weights[t, k])
    return output if a4_scales is None else output.to(torch.bfloat16)
