"""Which ops the split pass rewrites, and into what: a small registry the integrations fill.

The pass itself knows only the package's own pair (``a4prefill::moe_w4a16`` ->
``a4prefill::moe_split``). An engine integration registers its opaque MoE ops with their
split-enabled twins (the vLLM plugin: ``vllm::moe_forward`` -> ``a4prefill::moe_forward_split``,
``vllm::moe_forward_shared`` -> ``a4prefill::moe_forward_shared_split``) when it registers, in
every process, so that a graph loaded from a compile cache finds every op it calls.

The registry holds op pairs only (which op is the split form of which); it decides nothing about
precision. Who may call :func:`register_split_twin`: integrations at registration time.
"""

from __future__ import annotations

import torch

from a4prefill.ops import moe as moe_ops
from a4prefill.process_state import register_state

_BUILTIN = ((moe_ops.moe_w4a16, moe_ops.moe_split),)
_twins: dict[torch._ops.OpOverload, torch._ops.OpOverload] = dict(_BUILTIN)


def _forget_integrations() -> None:
    """Back to the package's own pair (an integration registers its pairs again when it registers)."""
    _twins.clear()
    _twins.update(_BUILTIN)


register_state(__name__, _forget_integrations, _twins)


def register_split_twin(op: torch._ops.OpOverload, twin: torch._ops.OpOverload) -> None:
    """Declare ``twin`` the split form of ``op`` (same schema; idempotent)."""
    known = _twins.get(op)
    if known is not None and known is not twin:
        raise ValueError(f"{op} already has the split twin {known}, not {twin}")
    _twins[op] = twin


def split_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """The split form of ``op`` (``KeyError`` if ``op`` has none)."""
    return _twins[op]


def rewritable_ops() -> frozenset[torch._ops.OpOverload]:
    """Ops the pass may rewrite."""
    return frozenset(_twins)


def split_ops() -> frozenset[torch._ops.OpOverload]:
    """Ops that already are split forms."""
    return frozenset(_twins.values())
