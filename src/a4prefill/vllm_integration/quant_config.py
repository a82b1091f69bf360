"""The ``a4prefill_nvfp4`` quantization config: ModelOpt NVFP4 MoE checkpoints, opt-in only.

Contract:

- Claims a checkpoint only when the user asked for it (``--quantization a4prefill_nvfp4`` /
  ``LLM(quantization="a4prefill_nvfp4")``) and the checkpoint is ModelOpt ``NVFP4`` (with
  calibrated input scales) or ``W4A16_NVFP4``; anything else is a clear error. Without the
  option vLLM's own ModelOpt config serves the checkpoint unchanged.
- MoE experts (``RoutedExperts``) get :class:`A4PrefillModelOptNvFp4MoEMethod`; attention and
  excluded layers are vLLM's (KV-cache method, unquantized linear); quantized NVFP4 linear layers
  go to vLLM's ModelOpt linear method where the platform has NVFP4 linear kernels (not on CPU:
  clear error naming the layer).
- The first ``get_quant_method`` call of a process (model construction, a vLLM config is
  current) validates ``additional_config["a4prefill"]`` and installs the forward-context row
  provider; invalid settings fail there, before any weight is loaded.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.attention import Attention, MLAAttention
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.platforms import current_platform

from a4prefill.ops.rows import set_row_provider
from a4prefill.vllm_integration.moe_method import A4PrefillModelOptNvFp4MoEMethod
from a4prefill.vllm_integration.row_provider import ForwardContextRowProvider
from a4prefill.vllm_integration.settings import effective_settings, max_decode_len

logger = logging.getLogger(__name__)

from a4prefill.vllm_integration import QUANTIZATION_NAME  # noqa: E402

SUPPORTED_ALGOS = ("NVFP4", "W4A16_NVFP4")


class A4PrefillNvFp4Config(ModelOptNvFp4Config):
    """ModelOpt NVFP4 config whose MoE experts run through the ``a4prefill`` ops."""

    _process_ready = False

    def get_name(self) -> Any:
        return QUANTIZATION_NAME

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Any, hf_config: Any = None) -> Any:
        if user_quant != QUANTIZATION_NAME:
            return None
        algo = cls._extract_modelopt_quant_algo(hf_quant_cfg)
        if algo not in SUPPORTED_ALGOS:
            raise ValueError(
                f"--quantization {QUANTIZATION_NAME} serves ModelOpt checkpoints with quant_algo "
                f"{' or '.join(SUPPORTED_ALGOS)}; this checkpoint has "
                f"{'no ModelOpt quantization config' if algo is None else 'quant_algo ' + repr(algo)}"
            )
        return QUANTIZATION_NAME

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        self._prepare_process()
        if isinstance(layer, Attention | MLAAttention) or self.is_layer_excluded(prefix):
            return super().get_quant_method(layer, prefix)
        if isinstance(layer, RoutedExperts):
            return A4PrefillModelOptNvFp4MoEMethod(layer.moe_config, prefix)
        if isinstance(layer, LinearBase) and current_platform.is_cpu():
            raise ValueError(
                f"{QUANTIZATION_NAME}: layer {prefix!r} is an NVFP4-quantized linear layer, and "
                f"vLLM has no NVFP4 linear kernel on {current_platform.device_name}; serve a "
                "checkpoint whose linear layers are excluded from quantization (exclude_modules)"
            )
        return super().get_quant_method(layer, prefix)

    @classmethod
    def _prepare_process(cls) -> None:
        """Validate the settings and install the row provider, once per process."""
        if cls._process_ready:
            return
        vllm_config = get_current_vllm_config_or_none()
        settings = effective_settings(vllm_config)  # raises ValueError naming the bad key
        parallel = getattr(vllm_config, "parallel_config", None)
        sp = bool(getattr(parallel, "use_sequence_parallel_moe", False))
        tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        sp_rank = 0
        if sp and tp_size > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            sp_rank = get_tensor_model_parallel_rank()
        set_row_provider(
            ForwardContextRowProvider(
                max_decode_len=max_decode_len(vllm_config),
                enabled=settings.enabled,
                sp_rank=sp_rank,
                sp_size=tp_size if sp else 1,
            )
        )
        cls._process_ready = True
        logger.info(
            "a4prefill: %s ready (A4 prefill %s, decode rows: query_len <= %d)",
            QUANTIZATION_NAME,
            "enabled" if settings.enabled else "disabled",
            max_decode_len(vllm_config),
        )
