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
- The first ``get_quant_method`` call of a config instance (one per engine; model construction,
  a vLLM config is current) sets the engine up (:func:`.engine.engine_setup`: settings resolved,
  split pass bound, row policy); invalid settings fail there, before any weight is loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.attention import Attention, MLAAttention
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.platforms import current_platform

from a4prefill.vllm_integration import QUANTIZATION_NAME
from a4prefill.vllm_integration.engine import EngineSetup, engine_setup
from a4prefill.vllm_integration.moe_method import A4PrefillModelOptNvFp4MoEMethod

SUPPORTED_ALGOS = ("NVFP4", "W4A16_NVFP4")


class A4PrefillNvFp4Config(ModelOptNvFp4Config):
    """ModelOpt NVFP4 config whose MoE experts run through the ``a4prefill`` ops."""

    _setup: EngineSetup | None = None

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
        setup = self.engine()  # the first call validates the settings, before any weight is loaded
        if isinstance(layer, Attention | MLAAttention) or self.is_layer_excluded(prefix):
            return super().get_quant_method(layer, prefix)
        if isinstance(layer, RoutedExperts):
            return A4PrefillModelOptNvFp4MoEMethod(layer.moe_config, prefix, setup)
        if isinstance(layer, LinearBase) and current_platform.is_cpu():
            raise ValueError(
                f"{QUANTIZATION_NAME}: layer {prefix!r} is an NVFP4-quantized linear layer, and "
                f"vLLM has no NVFP4 linear kernel on {current_platform.device_name}; serve a "
                "checkpoint whose linear layers are excluded from quantization (exclude_modules)"
            )
        return super().get_quant_method(layer, prefix)

    def engine(self) -> EngineSetup:
        """This engine's setup, made on first use (model construction: a vLLM config is current)."""
        if self._setup is None:
            vllm_config = get_current_vllm_config_or_none()
            if vllm_config is None:
                raise RuntimeError(f"{QUANTIZATION_NAME}: layers must be built under a current vLLM config")
            self._setup = engine_setup(vllm_config)
        return self._setup
