"""The MoE in plain torch for both precisions: the numerics oracle (docs/numerics.md, section 4).

Per route (token t, slot j, expert e), with ``io`` the activation dtype (bf16 or fp16):

- FC1: ``gate_up = io(acc1 * alpha1[e, half])`` where ``acc1`` is the fp32 product of the FC1
  input and ``e2m1 * block_scale`` of ``w13_weight[e]``, and ``half`` is 0 for the gate columns
  [0, I) and 1 for the up columns [I, 2I);
  W4A16: input = hidden row, ``alpha1 = w13_weight_scale_2[e, half]``;
  A4: input = ``e2m1 * block_scale`` of the hidden row quantized with the shared ``gs1``,
  ``alpha1 = w13_weight_scale_2[e, half] / gs1``;
- activation: optional clamp (gate <= L, -L <= up <= L), ``io(io(silu(gate)) * up)``;
- FC2: ``y = io(acc2 * alpha2[e])``; W4A16: ``alpha2 = w2_weight_scale_2[e]``;
  A4: input re-quantized with ``gs2[e]``, ``alpha2 = w2_weight_scale_2[e] / gs2[e]``;
- output: ``io(sum_j fp32(topk_weights[t, j]) * fp32(y))``, experts summed in ascending order.

A8 (:func:`moe_reference_a8`, docs/numerics.md section 8): the same steps with FP8 operands.

Rows are independent: the result of a row does not depend on the other rows of the call.
Reads ``topk_ids`` on the host (not capture-safe); any device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from a4prefill.ops import fp8, nvfp4
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.scales import A4Scales


def swiglu(gate_up: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """``io(io(silu(gate)) * up)`` over ``gate_up [N, 2I]`` (gate first), with the optional clamp."""
    intermediate = gate_up.shape[1] // 2
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    activated = F.silu(gate.to(torch.float32)).to(gate_up.dtype)
    return (activated.to(torch.float32) * up.to(torch.float32)).to(gate_up.dtype)


def moe_reference(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: NvFp4Experts,
    a4_scales: A4Scales | None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Run the MoE on ``hidden_states [T, H]``: W4A16 when ``a4_scales`` is None, else A4.

    ``topk_weights [T, k]``, ``topk_ids [T, k]`` (ids in [0, E), or -1: a route whose expert
    another expert-parallel rank holds, which contributes nothing); returns ``[T, H]`` in the
    dtype of ``hidden_states``. Arguments are assumed validated (see ``checks``).
    """
    fc1, fc2 = experts.fc1, experts.fc2
    # [E, 2I]: each half's decode multiplier repeated over its columns.
    fc1_scale_2 = fc1.scale_2.repeat_interleave(fc1.rows // 2, dim=1)
    if a4_scales is None:
        fc1_input = hidden_states.to(torch.float32)
        fc1_alpha = fc1_scale_2
    else:
        fc1_input = nvfp4.quantize_dequantize_blocks(hidden_states, a4_scales.fc1_encode_scale)
        fc1_alpha = fc1_scale_2 / a4_scales.fc1_encode_scale

    def fc1_product(token_index: torch.Tensor, expert: int) -> torch.Tensor:
        return (fc1_input[token_index] @ fc1.dequantized_blocks(expert).T) * fc1_alpha[expert]

    def fc2_product(activated: torch.Tensor, expert: int) -> torch.Tensor:
        w2 = fc2.dequantized_blocks(expert)
        if a4_scales is None:
            return (activated.to(torch.float32) @ w2.T) * fc2.scale_2[expert]
        fc2_scale = a4_scales.fc2_encode_scales[expert].reshape(1)
        fc2_input = nvfp4.quantize_dequantize_blocks(activated, fc2_scale)
        return (fc2_input @ w2.T) * (fc2.scale_2[expert] / fc2_scale[0])

    return _route_loop(hidden_states, topk_weights, topk_ids, fc1_product, fc2_product, swiglu_limit)


def moe_reference_a8(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: NvFp4Experts,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """The MoE with every row A8 (docs/numerics.md section 8, :mod:`a4prefill.ops.fp8`): FC1 on
    the hidden rows quantized to e4m3 with one scale per row, FC2 on each route's bf16 ``h``
    quantized the same way, both against the NVFP4 weights converted to e4m3 per row and
    128-column block, products promoted per block; ``scale_2`` and the bf16 roundings where
    W4A16 has them. H and I must be multiples of 128. Same arguments and result as
    :func:`moe_reference`, without encode scales (A8 scales are dynamic)."""
    fc1, fc2 = experts.fc1, experts.fc2
    fc1_scale_2 = fc1.scale_2.repeat_interleave(fc1.rows // 2, dim=1)
    codes, scales = fp8.quantize_rows(hidden_states)

    def fc1_product(token_index: torch.Tensor, expert: int) -> torch.Tensor:
        weights, exponents = fp8.weights(fc1.codes[expert], fc1.block_scales[expert])
        product = fp8.block_product(codes[token_index], scales[token_index], weights, exponents)
        return product * fc1_scale_2[expert]

    def fc2_product(activated: torch.Tensor, expert: int) -> torch.Tensor:
        weights, exponents = fp8.weights(fc2.codes[expert], fc2.block_scales[expert])
        return fp8.block_product(*fp8.quantize_rows(activated), weights, exponents) * fc2.scale_2[expert]

    return _route_loop(hidden_states, topk_weights, topk_ids, fc1_product, fc2_product, swiglu_limit)


def _route_loop(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fc1_product: Callable[[torch.Tensor, int], torch.Tensor],
    fc2_product: Callable[[torch.Tensor, int], torch.Tensor],
    swiglu_limit: float | None,
) -> torch.Tensor:
    """The experts in ascending order: per expert, ``gate_up = io(fc1_product(token_index, e))``
    (fp32 ``[n, 2I]``, the multipliers applied), :func:`swiglu`, ``y = io(fc2_product(activated,
    e))``, then ``output[t] += fp32(topk_weights[t, j]) * fp32(y)``; returns ``io(output)``."""
    io_dtype = hidden_states.dtype
    tokens, hidden = hidden_states.shape
    output = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    if tokens == 0:
        return output.to(io_dtype)
    route_weights = topk_weights.to(torch.float32)
    for expert in torch.unique(topk_ids).tolist():
        if expert < 0:
            continue
        token_index, slot_index = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate_up = fc1_product(token_index, expert).to(io_dtype)
        activated = swiglu(gate_up, swiglu_limit)
        expert_out = fc2_product(activated, expert).to(io_dtype)
        weighted = expert_out.to(torch.float32) * route_weights[token_index, slot_index].unsqueeze(1)
        output.index_add_(0, token_index, weighted)
    return output.to(io_dtype)
