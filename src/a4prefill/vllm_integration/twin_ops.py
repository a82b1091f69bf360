"""Split-enabled twins of vLLM's opaque MoE ops, registered in every vLLM process.

``a4prefill::moe_forward_split`` and ``a4prefill::moe_forward_shared_split`` have exactly the
schemas of ``vllm::moe_forward`` / ``vllm::moe_forward_shared`` (hoisted ``layer_name``,
``hidden_dim_unpadded``) and the same tags. At run time they call vLLM's op inside
:func:`a4prefill.vllm_integration.split_scope.split_enabled`, so the layer's MoE method runs ``moe_split``
(with the layer's own A4 scales and the row provider's row types); everything else is vLLM's.

:func:`register_twins` runs when the plugin registers (the ``vllm.general_plugins`` entry point,
every process), not inside the graph pass: a graph loaded from vLLM's or Inductor's compile cache
calls the twins without the pass ever running in that process (docs/vllm-internals.md, sections 3
and 4).
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

import torch

from a4prefill.passes import rewrite_targets
from a4prefill.vllm_integration.split_scope import split_enabled

NAMESPACE = "a4prefill"
TWINS = MappingProxyType(
    {"moe_forward": "moe_forward_split", "moe_forward_shared": "moe_forward_shared_split"}
)
# vLLM's module that registers the MoE ops, and its Python implementations (whose annotations
# carry the opaque ``LayerName`` type the schema needs).
_VLLM_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
_VLLM_IMPLS = MappingProxyType({"moe_forward": "_moe_forward", "moe_forward_shared": "_moe_forward_shared"})
_library: torch.library.Library | None = None


def _forwarding_impl(vllm_op: torch._ops.OpOverload) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with split_enabled():
            return vllm_op(*args, **kwargs)

    return run


def _fake_impl(vllm_op: torch._ops.OpOverload) -> Any:
    def fake(*args: Any, **kwargs: Any) -> Any:
        return vllm_op(*args, **kwargs)

    return fake


def register_twins() -> dict[str, torch._ops.OpOverload]:
    """Define the twins of vLLM's MoE ops (once per process) and declare them to the pass.

    Returns vLLM op name -> twin overload. Raises ``ModuleNotFoundError`` if this vLLM has no
    module ``_VLLM_RUNNER`` (whose import registers the ops), ``AttributeError`` if it registers
    no ``vllm::moe_forward[_shared]``, ``RuntimeError`` if that module lacks the Python
    implementation whose schema a twin copies.
    """
    global _library
    runner = importlib.import_module(_VLLM_RUNNER)  # registers vllm::moe_forward[_shared]
    if _library is None:
        library = torch.library.Library(NAMESPACE, "FRAGMENT")
        for name, twin in TWINS.items():
            op = getattr(torch.ops.vllm, name).default
            impl = getattr(runner, _VLLM_IMPLS[name], None)
            if impl is None:
                raise RuntimeError(
                    f"cannot find vLLM's {_VLLM_RUNNER}.{_VLLM_IMPLS[name]} to copy its schema"
                )
            mutated = [arg.name for arg in op._schema.arguments if arg.is_write]
            schema = torch.library.infer_schema(impl, mutates_args=mutated)
            library.define(twin + schema, tags=tuple(op.tags))
            library.impl(twin, _forwarding_impl(op), "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{twin}", _fake_impl(op), lib=library)
        _library = library
    twins = {}
    for name, twin in TWINS.items():
        op, twin_op = getattr(torch.ops.vllm, name).default, getattr(torch.ops.a4prefill, twin).default
        rewrite_targets.register_split_twin(op, twin_op)
        twins[name] = twin_op
    return twins
