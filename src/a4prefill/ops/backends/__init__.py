"""Backend registry: pick the fastest backend that supports a device.

Backends register a factory with a priority; :func:`backend_for` returns the supported backend
with the highest priority for a device, or the one named by ``A4PREFILL_BACKEND``
(``auto`` | a registered name). The op definitions never name a backend.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from a4prefill.ops.backends.b12x_moe import B12xBackend
from a4prefill.ops.backends.base import MoEBackend
from a4prefill.ops.backends.reference import ReferenceBackend
from a4prefill.ops.backends.triton.backend import TritonBackend
from a4prefill.process_state import register_state

logger = logging.getLogger(__name__)

BACKEND_ENV = "A4PREFILL_BACKEND"

_factories: dict[str, tuple[int, Callable[[], MoEBackend]]] = {}
_instances: dict[str, MoEBackend] = {}
_selected: dict[tuple[str, str], MoEBackend] = {}


def register_backend(name: str, factory: Callable[[], MoEBackend], priority: int) -> None:
    """Register ``factory`` under ``name``; higher ``priority`` wins when several support a device."""
    _factories[name] = (priority, factory)
    _instances.pop(name, None)
    _selected.clear()


def reset_backends() -> None:
    """Forget backend instances (and what they prepared) and the per-device selection."""
    _instances.clear()
    _selected.clear()


def registered_backends() -> list[str]:
    """Registered backend names, highest priority first."""
    return sorted(_factories, key=lambda name: -_factories[name][0])


def get_backend(name: str) -> MoEBackend:
    """The (cached) instance of the backend registered as ``name``."""
    if name not in _factories:
        raise ValueError(f"unknown a4prefill backend {name!r}; registered: {registered_backends()}")
    if name not in _instances:
        _instances[name] = _factories[name][1]()
    return _instances[name]


def requested_backend() -> str:
    """The value of ``A4PREFILL_BACKEND`` (default ``auto``), validated."""
    value = os.environ.get(BACKEND_ENV, "auto").strip() or "auto"
    if value != "auto" and value not in _factories:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not 'auto' or one of {registered_backends()}")
    return value


def backend_for(device: torch.device) -> MoEBackend:
    """The backend that runs MoE calls on ``device`` (cached per device and request)."""
    request = requested_backend()
    key = (request, str(device))
    if key in _selected:
        return _selected[key]
    candidates = registered_backends() if request == "auto" else [request]
    reasons = []
    for name in candidates:
        backend = get_backend(name)
        reason = backend.unsupported_reason(device)
        if reason is None:
            logger.info("a4prefill: backend %r runs MoE calls on %s", name, device)
            _selected[key] = backend
            return backend
        reasons.append(f"{name}: {reason}")
        logger.info("a4prefill: backend %r not used on %s: %s", name, device, reason)
    raise RuntimeError(f"no a4prefill backend supports {device}: {'; '.join(reasons)}")


def _register_builtin_backends() -> None:
    register_backend("reference", ReferenceBackend, priority=0)
    register_backend("triton", TritonBackend, priority=10)  # imports triton only when first used on CUDA
    register_backend("b12x", B12xBackend, priority=20)  # imports b12x only when asked about a device


def _reset_registry() -> None:
    """Back to the built-in backends, with no instance and no selection."""
    _factories.clear()
    _register_builtin_backends()
    reset_backends()


_register_builtin_backends()
register_state(__name__, _reset_registry, _factories, _instances, _selected)
