"""vLLM integration of ``a4prefill`` (the only package that imports vLLM).

``register()`` is the ``vllm.general_plugins`` entry point (run in every vLLM process). It
registers the ``a4prefill_nvfp4`` quantization method (opt-in: ``--quantization
a4prefill_nvfp4``) and, when the split pass module exists, declares
``a4prefill.passes.split_prefill.SplitPrefillPass`` a virtual subclass of vLLM's
``InductorPass`` so vLLM's compilation config accepts the pass object as it is.

Modules: ``quant_config`` (checkpoint claim, layer dispatch), ``moe_method`` (parameters, scale
preparation, the op call), ``row_provider`` (row types from the forward context), ``settings``
(``additional_config`` and the legacy switch), ``e2e`` (an end-to-end run on the real engine).
"""

from __future__ import annotations

QUANTIZATION_NAME = "a4prefill_nvfp4"
_registered = False


def register() -> None:
    """Register the quantization config and the pass class with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from a4prefill.vllm_integration.quant_config import A4PrefillNvFp4Config

    register_quantization_config(QUANTIZATION_NAME)(A4PrefillNvFp4Config)
    register_split_pass()
    _registered = True


def register_split_pass() -> bool:
    """Make vLLM treat ``SplitPrefillPass`` as an ``InductorPass``; False if the pass module is
    not installed (it is optional for the quantization method)."""
    try:
        from a4prefill.passes.split_prefill import SplitPrefillPass
    except ImportError:
        return False
    from vllm.compilation.passes.inductor_pass import InductorPass

    if not issubclass(SplitPrefillPass, InductorPass):
        InductorPass.register(SplitPrefillPass)
    return True


__all__ = ["QUANTIZATION_NAME", "register", "register_split_pass"]
