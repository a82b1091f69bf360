"""All process state the package keeps, in one place, and the one function that resets it.

What the package keeps per process (none of it carries a precision decision):

- :data:`a4prefill.ops.counters.ROW_COUNTERS` and ``DEVICE_ROW_COUNTERS``: row counters (what
  ran, for reports);
- the once-per-process warning registry below (which messages were already logged);
- the backend registry's instances and per-device selection (:mod:`a4prefill.ops.backends`);
- the row-provider hook (:func:`a4prefill.ops.rows.set_row_provider`), installed by the vLLM
  plugin; it holds code, not data: the provider reads everything from the current step.

Who may call :func:`reset_process_state`: tests (one fixture), tools that run several jobs in one
process.
"""

from __future__ import annotations

import logging
import threading

_warned: set[tuple[str, ...]] = set()
_lock = threading.Lock()


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


def reset_process_state() -> None:
    """Forget counters, logged warnings, backend instances and the row provider."""
    from a4prefill.ops import backends, counters, rows

    counters.ROW_COUNTERS.reset()
    counters.DEVICE_ROW_COUNTERS.reset()
    with _lock:
        _warned.clear()
    backends.reset_backends()
    rows.set_row_provider(None)
