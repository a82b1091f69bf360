"""A router + NVFP4 MoE module for compile tests (not a test file)."""

from __future__ import annotations

import torch

from a4prefill import ops
from conftest import EXPERTS, HIDDEN, TOP_K


class TinyMoE(torch.nn.Module):
    """Router + one NVFP4 MoE op, as a model would use it."""

    def __init__(self, weights: ops.NvFp4MoEWeights, op, layer_name: str = "model.layers.0.mlp.experts"):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, dtype=torch.bfloat16)
        self.op = op
        self.layer_name = layer_name
        self.weight_names = list(weights.named_tensors())
        for name, tensor in weights.named_tensors().items():
            self.register_buffer(name, tensor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.router(hidden).float()
        topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
        weights = ops.NvFp4MoEWeights(*(getattr(self, name) for name in self.weight_names))
        return ops.call_moe(self.op, hidden, topk_weights, topk_ids.to(torch.int32), weights, self.layer_name)
