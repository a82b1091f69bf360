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

Rows are independent: the result of a row does not depend on the other rows of the call.
Reads ``topk_ids`` on the host (not capture-safe); any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from a4prefill.ops import nvfp4
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
    io_dtype = hidden_states.dtype
    tokens, hidden = hidden_states.shape
    output = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    if tokens == 0:
        return output.to(io_dtype)
    route_weights = topk_weights.to(torch.float32)
    fc1, fc2 = experts.fc1, experts.fc2
    # [E, 2I]: each half's decode multiplier repeated over its columns.
    fc1_scale_2 = fc1.scale_2.repeat_interleave(fc1.rows // 2, dim=1)
    if a4_scales is None:
        fc1_input = hidden_states.to(torch.float32)
        fc1_alpha = fc1_scale_2
    else:
        fc1_input = nvfp4.quantize_dequantize_blocks(hidden_states, a4_scales.fc1_encode_scale)
        fc1_alpha = fc1_scale_2 / a4_scales.fc1_encode_scale
    for expert in torch.unique(topk_ids).tolist():
        if expert < 0:
            continue
        token_index, slot_index = torch.nonzero(topk_ids == expert, as_tuple=True)
        w13 = fc1.dequantized_blocks(expert)
        gate_up = ((fc1_input[token_index] @ w13.T) * fc1_alpha[expert]).to(io_dtype)
        activated = swiglu(gate_up, swiglu_limit)
        w2 = fc2.dequantized_blocks(expert)
        if a4_scales is None:
            fc2_input = activated.to(torch.float32)
            fc2_alpha = fc2.scale_2[expert]
        else:
            fc2_scale = a4_scales.fc2_encode_scales[expert].reshape(1)
            fc2_input = nvfp4.quantize_dequantize_blocks(activated, fc2_scale)
            fc2_alpha = fc2.scale_2[expert] / fc2_scale[0]
        expert_out = ((fc2_input @ w2.T) * fc2_alpha).to(io_dtype)
        weighted = expert_out.to(torch.float32) * route_weights[token_index, slot_index].unsqueeze(1)
        output.index_add_(0, token_index, weighted)
    return output.to(io_dtype)
