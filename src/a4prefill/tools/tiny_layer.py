"""A small random NVFP4 MoE layer with calibrated input scales (demo, tests, benchmarks).

Who may call: anything that needs a self-made layer; nothing in ``ops`` depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from a4prefill.ops.modelopt import NvFp4Experts, NvFp4MoEWeights, quantize_moe_weights
from a4prefill.ops.moe import call_moe
from a4prefill.ops.precision import A4, check_prefill_precision
from a4prefill.ops.scales import A4Scales, a4_calibration


@dataclass(frozen=True)
class TinyMoELayer:
    """Float expert weights (``w13 [E, 2I, H]`` gate first, ``w2 [E, H, I]``) and their
    ModelOpt NVFP4 quantization with input scales calibrated on random routed tokens."""

    w13: torch.Tensor
    w2: torch.Tensor
    quantized: NvFp4MoEWeights
    top_k: int

    @property
    def experts(self) -> NvFp4Experts:
        """The op's expert tensors."""
        return self.quantized.experts()

    @property
    def a4_scales(self) -> A4Scales | None:
        """The layer's A4 scales as load time derives them (None: uncalibrated)."""
        return a4_calibration(self.quantized.w13_input_scale, self.quantized.w2_input_scale).scales

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]


def random_routing(
    tokens: int, num_experts: int, top_k: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing: ``topk_weights`` fp32 [T, k] (softmax over the chosen logits,
    rows sum to 1) and distinct ``topk_ids`` int32 [T, k]."""
    logits = torch.randn(tokens, num_experts, generator=generator)
    values, ids = logits.topk(top_k, dim=1)
    return torch.softmax(values, dim=1), ids.to(torch.int32)


def make_tiny_layer(
    num_experts: int = 8,
    hidden_size: int = 256,
    intermediate_size: int = 128,
    top_k: int = 2,
    seed: int = 0,
    calibration_tokens: int = 512,
    calibrated: bool = True,
) -> TinyMoELayer:
    """Build a random layer; ``calibrated=False`` leaves the input scales at 0."""
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=generator) / hidden_size**0.5
    w2 = (
        torch.randn(num_experts, hidden_size, intermediate_size, generator=generator) / intermediate_size**0.5
    )
    fc1_amax = fc2_amax = None
    if calibrated:
        tokens = torch.randn(calibration_tokens, hidden_size, generator=generator)
        _, ids = random_routing(calibration_tokens, num_experts, top_k, generator)
        fc1_amax, fc2_amax = routed_input_amax(tokens, ids, w13)
    return TinyMoELayer(w13, w2, quantize_moe_weights(w13, w2, fc1_amax, fc2_amax), top_k)


def routed_input_amax(
    tokens: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration: per expert, the largest absolute FC1 input (of ``tokens [T, H]`` routed to
    it by ``topk_ids [T, k]``) and FC2 input (``silu(gate) * up`` with the float ``w13 [E, 2I,
    H]``), fp32 [E] each; an expert no token reaches is calibrated on all of them."""
    experts = w13.shape[0]
    fc1, fc2 = torch.zeros(experts), torch.zeros(experts)
    for expert in range(experts):
        rows = tokens[(topk_ids == expert).any(dim=1)]
        if rows.numel() == 0:
            rows = tokens
        gate, up = (rows @ w13[expert].T).chunk(2, dim=1)
        fc1[expert] = rows.abs().max()
        fc2[expert] = (F.silu(gate) * up).abs().max()
    return fc1, fc2


def dense_moe_fp32(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The MoE in fp32 with float weights ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (no quantization)."""
    x = hidden_states.to(torch.float32)
    output = torch.zeros_like(x)
    for slot in range(topk_ids.shape[1]):
        for expert in torch.unique(topk_ids[:, slot]).tolist():
            rows = topk_ids[:, slot] == expert
            gate, up = (x[rows] @ w13[expert].float().T).chunk(2, dim=1)
            y = (F.silu(gate) * up) @ w2[expert].float().T
            output[rows] += topk_weights[rows, slot, None].float() * y
    return output


class TinyMoEModel(torch.nn.Module):
    """Router + NVFP4 MoE blocks (residual), for compile demos and tests (inference only).

    ``layers``: one ``NvFp4MoEWeights`` per block, named ``model.layers.{i}.mlp.experts``; their
    A4 scales are derived here, once (load time), and kept as buffers beside the experts (a block
    without valid input scales has none and runs W4A16 only). ``op``: the MoE op the blocks call
    (``moe_w4a16`` for the pass to rewrite). ``prefill_precision``: what the blocks pass to the op
    (``"a4"``: with their A4 scales; ``"a8"``: no A4 scales, H and I multiples of 128). Input
    ``hidden [T, H]`` bf16; output ``[T, H]`` bf16.
    """

    def __init__(
        self,
        layers: list[NvFp4MoEWeights],
        op: torch._ops.OpOverload,
        top_k: int = 2,
        seed: int = 0,
        prefill_precision: str = A4,
    ):
        super().__init__()
        check_prefill_precision(prefill_precision)
        self.prefill_precision = prefill_precision
        num_experts, _, packed_hidden = layers[0].w13_weight.shape
        self.op = op
        self.top_k = top_k
        with torch.random.fork_rng(devices=[]):  # seeded routers; the caller's RNG is untouched
            torch.manual_seed(seed)
            self.routers = torch.nn.ModuleList(
                torch.nn.Linear(packed_hidden * 2, num_experts, dtype=torch.bfloat16) for _ in layers
            )
        self.expert_names = list(layers[0].experts().named_tensors())
        self.has_a4_scales = []
        for index, weights in enumerate(layers):
            for name, tensor in weights.experts().named_tensors().items():
                self.register_buffer(f"layer{index}_{name}", tensor)
            scales = a4_calibration(weights.w13_input_scale, weights.w2_input_scale).scales
            self.has_a4_scales.append(scales is not None)
            if scales is not None:
                self.register_buffer(f"layer{index}_fc1_encode_scale", scales.fc1_encode_scale)
                self.register_buffer(f"layer{index}_fc2_encode_scales", scales.fc2_encode_scales)
        self.requires_grad_(False)  # an inference model: the MoE ops have no autograd formula

    def layer_name(self, index: int) -> str:
        return f"model.layers.{index}.mlp.experts"

    def block(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Route ``hidden`` and run MoE block ``index`` (returns the MoE output, no residual)."""
        logits = self.routers[index](hidden).float()
        topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        experts = NvFp4Experts(*[getattr(self, f"layer{index}_{name}") for name in self.expert_names])
        scales = None
        if self.has_a4_scales[index] and self.prefill_precision == A4:
            scales = A4Scales(
                getattr(self, f"layer{index}_fc1_encode_scale"),
                getattr(self, f"layer{index}_fc2_encode_scales"),
            )
        return call_moe(
            self.op,
            hidden,
            topk_weights,
            topk_ids.to(torch.int32),
            experts,
            scales,
            self.layer_name(index),
            prefill_precision=self.prefill_precision,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for index in range(len(self.routers)):
            hidden = hidden + self.block(index, hidden)
        return hidden
