"""All process state the package keeps, registered by its owners, and the one function that
resets it. A leaf module: it imports nothing of the package.

Every runtime module that keeps process-wide mutable state declares it here when it is imported,
with the function that puts it back to its import-time state: :func:`register_state`.
:func:`reset_process_state` runs every registered reset, in registration order.
``tests/test_process_state.py`` fails when a runtime module holds a module-level mutable container
(or a function cache) that nobody declared. What is declared (none of it carries a precision
decision; the three deciders are the pass, the row provider and load time):

- the once-per-process warning registry below (which messages were already logged);
- row counters (``ops.counters``: what ran, for reports);
- the row-provider hook (``ops.rows``), installed by the vLLM plugin (code, not data);
- the backend registry (``ops.backends``): registrations back to the built-in three, instances
  (with what they prepared, e.g. b12x's prepared layers and scratch) and per-device selection
  dropped; the triton backend's Gluon import check (``ops.backends.triton.kernel_modules``) and
  its cached column permutations of the prefill GEMM (``ops.backends.triton.prefill``: constants
  per K and device);
- the split pass's op-pair registry (``passes.rewrite_targets``) back to the package's own pair
  (an integration registers its pairs again when it registers), and the records of the package's
  pass instance;
- the audit log of precision (``vllm_integration.audit_log``, under ``row_log``): its open file
  and the vLLM function it wraps (reset: the pending record written, the file closed, vLLM's
  function restored).

Who may call :func:`reset_process_state`: tests (one fixture), tools that run several jobs in one
process. Who may call :func:`register_state`: runtime modules, at import.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

_resets: list[tuple[str, Callable[[], None], tuple[object, ...]]] = []
_warned: set[tuple[str, ...]] = set()
_lock = threading.Lock()


def register_state(owner: str, reset: Callable[[], None], *state: object) -> None:
    """Declare process state of module ``owner``: ``reset`` restores it; ``state`` are the
    module-level objects it resets (what the inventory test looks for)."""
    with _lock:
        _resets.append((owner, reset, state))


def registered_state() -> dict[int, str]:
    """``id(object) -> owner`` of every declared state object."""
    with _lock:
        return {id(obj): owner for owner, _, state in _resets for obj in state}


def reset_process_state() -> None:
    """Restore every registered piece of process state (see the module docstring)."""
    with _lock:
        resets = [reset for _, reset, _ in _resets]
    for reset in resets:
        reset()


def warn_once(logger: logging.Logger, key: tuple[str, ...], message: str, *args: object) -> bool:
    """Log ``message % args`` as a warning the first time ``key`` is seen in this process.

    Returns True when it logged. For messages that would otherwise repeat on every call or step.
    """
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    logger.warning(message, *args)
    return True


register_state(__name__, _warned.clear, _warned)
