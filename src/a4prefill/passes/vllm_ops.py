"""Split-enabled twins of vLLM's opaque MoE ops (registered only where vLLM is imported).

``a4prefill::moe_forward_split`` and ``a4prefill::moe_forward_shared_split`` have exactly the
schemas of ``vllm::moe_forward`` / ``vllm::moe_forward_shared`` (hoisted ``layer_name``,
``hidden_dim_unpadded``). At run time they call vLLM's op inside
:func:`a4prefill.ops.split_scope.split_enabled`; everything else is vLLM's behaviour.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from a4prefill.ops.split_scope import split_enabled

TWINS = {"moe_forward": "moe_forward_split", "moe_forward_shared": "moe_forward_shared_split"}
# vLLM's Python implementations, whose annotations carry the opaque ``LayerName`` type.
_VLLM_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
_VLLM_IMPLS = {"moe_forward": "_moe_forward", "moe_forward_shared": "_moe_forward_shared"}
_library: torch.library.Library | None = None


def vllm_moe_ops() -> dict[str, torch._ops.OpOverload]:
    """vLLM's MoE ops that exist in this process, by name ({} when vLLM registered none)."""
    namespace = getattr(torch.ops, "vllm", None)
    found = {}
    for name in TWINS:
        try:
            found[name] = getattr(namespace, name).default
        except (AttributeError, RuntimeError):
            continue
    return found


def _forwarding_impl(vllm_op: torch._ops.OpOverload) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with split_enabled():
            return vllm_op(*args, **kwargs)

    return run


def _fake_impl(vllm_op: torch._ops.OpOverload) -> Any:
    def fake(*args: Any, **kwargs: Any) -> Any:
        return vllm_op(*args, **kwargs)

    return fake


def registered_twins() -> list[torch._ops.OpOverload]:
    """The twins registered so far (empty until :func:`split_twin` first ran)."""
    if _library is None:
        return []
    return [
        getattr(torch.ops.a4prefill, twin).default
        for twin in TWINS.values()
        if hasattr(torch.ops.a4prefill, twin)
    ]


def split_twin(vllm_op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """The ``a4prefill`` twin of a vLLM MoE op, registering the twins on first use."""
    global _library
    if _library is None:
        library = torch.library.Library("a4prefill", "FRAGMENT")
        runner = sys.modules.get(_VLLM_RUNNER)
        for name, op in vllm_moe_ops().items():
            impl = getattr(runner, _VLLM_IMPLS[name], None)
            if impl is None:
                raise RuntimeError(
                    f"cannot find vLLM's {_VLLM_RUNNER}.{_VLLM_IMPLS[name]} to copy its schema"
                )
            mutated = [arg.name for arg in op._schema.arguments if arg.is_write]
            schema = torch.library.infer_schema(impl, mutates_args=mutated)
            library.define(TWINS[name] + schema, tags=tuple(op.tags))
            library.impl(TWINS[name], _forwarding_impl(op), "CompositeExplicitAutograd")
            torch.library.register_fake(f"a4prefill::{TWINS[name]}", _fake_impl(op), lib=library)
        _library = library
    return getattr(torch.ops.a4prefill, TWINS[vllm_op._opname]).default
