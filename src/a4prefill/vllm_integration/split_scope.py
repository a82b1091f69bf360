"""Where an opaque MoE call may run the split: the scope the split-enabled vLLM ops open.

On CUDA, vLLM's ``moe_forward`` is opaque to the compiler, so the graph pass cannot swap the
MoE call inside it. It swaps ``vllm::moe_forward`` for ``a4prefill::moe_forward_split``, whose
run time opens :func:`split_enabled` around vLLM's implementation; the quantization method then
picks ``moe_split`` instead of ``moe_w4a16`` while :func:`is_split_enabled` is true.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("a4prefill_split_enabled", default=False)


@contextlib.contextmanager
def split_enabled() -> Iterator[None]:
    """Within this block, MoE methods run ``moe_split`` (row types still decide per row)."""
    token = _enabled.set(True)
    try:
        yield
    finally:
        _enabled.reset(token)


def is_split_enabled() -> bool:
    """True inside :func:`split_enabled` (eager code only; never call it while tracing)."""
    return _enabled.get()
