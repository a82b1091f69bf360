"""The host side's one door to the ``triton`` backend's kernel modules, which import Triton (and
Gluon) and are therefore imported lazily: at the first launch, or when the backend is asked about
a CUDA device. The host modules (schedules, routing, plan, quantize, fused, warmup, backend)
import without Triton; they reach the kernels only through these functions, which return the
modules as ``Any`` (a launch reads its kernel from the module at call time, so tests may replace
a kernel by setting the module's attribute).

- :func:`shared`: :mod:`shared_kernels` (routing, A4 row quantization, the top-k combine; Triton);
- :func:`tiled`: :mod:`tiled_kernels` (the tiled GEMMs; Triton);
- :func:`decode`: :mod:`decode_kernels` (the decode GEMMs; Gluon, Triton 3.6+);
  :func:`decode_imports` says, once per process, whether that module imports;
- :func:`prefill`: :mod:`prefill_kernels` (the Hopper prefill GEMM; Gluon, Triton 3.6+, sm_90a);
  :func:`prefill_imports` says, once per process, whether that module imports;
- :func:`prefill_ws`: :mod:`prefill_ws_kernels` (its warp-specialized variant; part of what
  :func:`prefill_imports` checks);
- :func:`prefill_a8`: :mod:`prefill_a8_kernels` (that variant's A8 mainloop and the A8 row
  quantizer; imported with it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from a4prefill.process_state import register_state

logger = logging.getLogger(__name__)


def shared() -> Any:
    from a4prefill.ops.backends.triton import shared_kernels

    return shared_kernels


def tiled() -> Any:
    from a4prefill.ops.backends.triton import tiled_kernels

    return tiled_kernels


def decode() -> Any:
    from a4prefill.ops.backends.triton import decode_kernels

    return decode_kernels


def prefill() -> Any:
    from a4prefill.ops.backends.triton import prefill_kernels

    return prefill_kernels


def prefill_ws() -> Any:
    from a4prefill.ops.backends.triton import prefill_ws_kernels

    return prefill_ws_kernels


def prefill_a8() -> Any:
    from a4prefill.ops.backends.triton import prefill_a8_kernels

    return prefill_a8_kernels


def _imports(load: Callable[[], Any]) -> bool:
    """Whether ``load`` imports its kernel module (a Triton whose Gluon has what it uses); where
    not, a warning names the module and the error (the calls it would run take other kernels)."""
    try:
        load()
    except (ImportError, AttributeError) as error:
        logger.warning(
            "a4prefill: the triton backend's %s kernels do not import (%s: %s); the calls they would "
            "run take the tiled kernels (same precision, another summation order), A8 is refused",
            load.__name__,
            type(error).__name__,
            error,
        )
        return False
    return True


@functools.cache
def decode_imports() -> bool:
    """Whether :mod:`decode_kernels` imports (a Triton whose Gluon has what the kernels use)."""
    return _imports(decode)


@functools.cache
def prefill_imports() -> bool:
    """Whether :mod:`prefill_kernels` and :mod:`prefill_ws_kernels` import (a Triton whose Gluon
    has the Hopper ops they use)."""
    return _imports(prefill) and _imports(prefill_ws)


register_state(__name__, decode_imports.cache_clear, decode_imports)
register_state(__name__, prefill_imports.cache_clear, prefill_imports)
