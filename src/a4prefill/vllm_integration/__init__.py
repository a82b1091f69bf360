"""vLLM integration of ``a4prefill`` (the only package that imports vLLM).

``register()`` is the ``vllm.general_plugins`` entry point (run in every vLLM process). It
registers, in every process:

- the ``a4prefill_nvfp4`` quantization method (opt-in: ``--quantization a4prefill_nvfp4``);
- ``a4prefill.passes.split_prefill.SplitPrefillPass`` as a virtual subclass of vLLM's
  ``InductorPass``, so vLLM's compilation config accepts the pass object as it is;
- the split-enabled twins of vLLM's MoE ops (:mod:`.twin_ops`), so that a graph loaded from a
  warm compile cache finds them without the pass having run;
- the forward-context row provider (:func:`.row_provider.forward_context_row_types`);
- the source of the compile range the split pass intersects node ranges with
  (:func:`.compile_range.vllm_compile_range`).

Modules: ``quant_config`` (checkpoint claim, layer dispatch), ``engine`` (one engine's settings,
row policy and bound pass), ``moe_method`` (parameters, A4 scales at load time, the op call),
``row_provider`` (row types from the forward context), ``twin_ops`` and ``split_scope`` (the
split-enabled MoE ops), ``compile_range``. The tools that drive an engine live in
:mod:`a4prefill.tools`.
"""

from __future__ import annotations

QUANTIZATION_NAME = "a4prefill_nvfp4"


def register() -> None:
    """Register the quantization config, the pass class, the twin ops, the row provider and the
    compile-range source with this process (idempotent)."""
    from vllm.compilation.passes.inductor_pass import InductorPass
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    from a4prefill.ops import set_row_provider
    from a4prefill.passes.split_prefill import SplitPrefillPass
    from a4prefill.passes.token_range import set_compile_range_source
    from a4prefill.vllm_integration.compile_range import vllm_compile_range
    from a4prefill.vllm_integration.quant_config import A4PrefillNvFp4Config
    from a4prefill.vllm_integration.row_provider import forward_context_row_types
    from a4prefill.vllm_integration.twin_ops import register_twins

    if QUANTIZATION_NAME not in QUANTIZATION_METHODS:
        register_quantization_config(QUANTIZATION_NAME)(A4PrefillNvFp4Config)
    if not issubclass(SplitPrefillPass, InductorPass):
        InductorPass.register(SplitPrefillPass)
    register_twins()
    set_row_provider(forward_context_row_types)
    set_compile_range_source(vllm_compile_range)


__all__ = ["QUANTIZATION_NAME", "register"]
