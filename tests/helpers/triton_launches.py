"""What the package's Triton and Gluon kernel launches compile, seen by a Triton post-compile hook
(tests only), on a CUDA GPU or offline for sm_90a on a machine without one.

:func:`fresh_launches` empties the in-memory compiled-kernel caches of the package's kernels (the
``*_kernel`` functions of the kernel modules of :mod:`a4prefill.ops.backends.triton`) and
installs ``knobs.runtime.jit_post_compile_hook``, the hook vLLM's JIT monitor uses; Triton
serializes each new kernel's specialization (``serialize_specialization_data``) before it calls
the hook. Everything is restored at the end.

- ``device="cuda"``: the launches run on the current GPU.
- ``device="cpu"``: the active Triton driver reports an sm_90a target (H100/H200) and every
  launch ``kernel[grid](...)`` becomes Triton's ``JITFunction.warmup``: Triton's binder
  specializes the arguments exactly as for a launch (constexprs, pointer dtypes, 16-byte
  alignment, sizes divisible by 16, values equal to 1), compiles on a cache miss (from its disk
  cache when it can), calls the hook, and launches nothing. Tensors live on the CPU. The one
  kernel output host code reads, the routing (the warp-specialized FC1 gathers its rows by
  ``sorted_route`` with ``index_select``), is written by the torch routing after the routing
  kernel's warm-up, so that gather sees valid routes; nothing reads the other outputs.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Compile:
    """One compile that Triton reported to the post-compile hook."""

    kernel: str  # the kernel function's name
    specialization: dict[str, Any]  # Triton's serialized specialization data, parsed back


class _Sm90Driver:
    """Stands in for Triton's active driver: device 0 of an sm_90a GPU, stream 0."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


class _WarmupOnly:
    """``kernel[grid](*args, **kwargs)`` -> ``kernel.warmup(*args, grid=grid, **kwargs)``."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


def package_kernels() -> dict[str, Any]:
    """``module.name -> kernel`` of every kernel the package launches (``*_kernel`` JIT functions)."""
    from triton.runtime.jit import JITFunction

    from a4prefill.ops.backends.triton import (
        decode_kernels,
        prefill_a8_kernels,
        prefill_kernels,
        prefill_ws_kernels,
        shared_kernels,
        tiled_kernels,
    )

    modules = (
        shared_kernels,
        tiled_kernels,
        decode_kernels,
        prefill_kernels,
        prefill_ws_kernels,
        prefill_a8_kernels,
    )
    return {
        f"{module.__name__}.{name}": value
        for module in modules
        for name, value in vars(module).items()
        if name.endswith("_kernel") and isinstance(value, JITFunction)
    }


def _routing_written_by_torch(sort_routes: Callable[..., Any]) -> Callable[..., Any]:
    """``sort_routes`` whose routing kernels (the one-program or the chunked ones, launched
    warm-up only: they write nothing) have their outputs written by the torch routing of the same
    routes."""

    def sort(ids: Any, experts: int, launch: Any) -> Any:
        routing = sort_routes(ids, experts, launch)
        if launch.program_routes or launch.chunk_routes:
            written = sort_routes(ids, experts, dataclasses.replace(launch, program_routes=0, chunk_routes=0))
            for output, value in zip(routing.kernel_args(), written.kernel_args(), strict=True):
                output.copy_(value)
        return routing

    return sort


@contextmanager
def _offline_sm90(kernels: dict[str, Any]) -> Iterator[None]:
    import sys

    from triton.runtime.driver import driver

    from a4prefill.ops.backends.triton import fused, fused_a8

    saved_driver = driver._active
    with pytest.MonkeyPatch.context() as patch:
        for qualified, kernel in kernels.items():
            module, name = qualified.rsplit(".", 1)
            patch.setattr(sys.modules[module], name, _WarmupOnly(kernel))
        for caller in (fused, fused_a8):  # the modules that sort a call's routes
            patch.setattr(caller, "sort_routes", _routing_written_by_torch(caller.sort_routes))
        driver.set_active(_Sm90Driver())
        try:
            yield
        finally:
            driver._active = saved_driver


@contextmanager
def fresh_launches(
    device: str, on_compile: Callable[[Compile], None] | None = None
) -> Iterator[list[Compile]]:
    """While active, the package's kernels compile afresh on ``device`` (``"cuda"``, or ``"cpu"``
    for offline sm_90a; see the module docstring); yields the list of :class:`Compile` events, in
    order. ``on_compile`` (for example one that raises, as vLLM's monitor in ``error`` mode) is
    called with each event after it is recorded."""
    from triton import knobs

    kernels = package_kernels()
    events: list[Compile] = []

    def hook(**kwargs: Any) -> None:
        data = json.loads(kwargs["compile"]["specialization_data"])
        event = Compile(kwargs["fn"].name.rsplit(".", 1)[-1], data)
        events.append(event)
        if on_compile is not None:
            on_compile(event)

    saved_caches = {name: kernel.device_caches for name, kernel in kernels.items()}
    saved_hook = knobs.runtime.jit_post_compile_hook
    with ExitStack() as stack:
        if device == "cpu":
            stack.enter_context(_offline_sm90(kernels))
        for kernel in kernels.values():
            kernel.device_caches = defaultdict(kernel.create_binder)
        knobs.runtime.jit_post_compile_hook = hook
        try:
            yield events
        finally:
            knobs.runtime.jit_post_compile_hook = saved_hook
            for name, kernel in kernels.items():
                kernel.device_caches = saved_caches[name]
