"""The token range of a compiled graph, and whether it can run outside a captured CUDA graph.

Reads value ranges from the ShapeEnv without installing guards (no ``n <= M`` in Python on a
SymInt). Where an engine compiles one graph per token range (vLLM's compile ranges), the
engine's integration installs a compile-range source (:func:`set_compile_range_source`, the vLLM
plugin does when it registers) and the pass intersects each node's range with it; this module
knows no engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._sympy.numbers import int_oo

from a4prefill.process_state import register_state


@dataclass(frozen=True)
class TokenRange:
    """Inclusive token range ``[lower, upper]``; ``upper`` None means unbounded."""

    lower: int
    upper: int | None

    def within(self, limit: int) -> bool:
        """True when every size of the range is <= ``limit`` (the graph only runs captured)."""
        return self.upper is not None and self.upper <= limit

    def intersect(self, other: TokenRange) -> TokenRange:
        """The sizes in both ranges (``other`` wins where they do not overlap)."""
        upper = (
            self.upper
            if other.upper is None
            else other.upper
            if self.upper is None
            else min(self.upper, other.upper)
        )
        lower = max(self.lower, other.lower)
        if upper is not None and lower > upper:
            return other
        return TokenRange(lower, upper)

    def __str__(self) -> str:
        if self.upper == self.lower:
            return str(self.lower)
        return f"[{self.lower}, {'inf' if self.upper is None else self.upper}]"


def _bound(value: object) -> int | None:
    if value in (int_oo, -int_oo) or str(value) in ("oo", "-oo", "int_oo", "-int_oo"):
        return None
    return int(value)  # type: ignore[call-overload]


def size_range(size: int | torch.SymInt) -> TokenRange:
    """The value range of a concrete or symbolic size."""
    if isinstance(size, int):
        return TokenRange(size, size)
    node = size.node
    maybe_int = node.maybe_as_int()
    if maybe_int is not None:
        return TokenRange(maybe_int, maybe_int)
    bounds = node.shape_env.bound_sympy(node.expr)
    return TokenRange(_bound(bounds.lower) or 0, _bound(bounds.upper))


CompileRangeSource = Callable[[], "TokenRange | None"]
"""Returns the token range of the graph the engine is compiling now, or None outside one."""

_compile_range_source: CompileRangeSource | None = None


def set_compile_range_source(source: CompileRangeSource | None) -> CompileRangeSource | None:
    """Install the engine's compile-range source (integrations, when they register); returns
    the previous one."""
    global _compile_range_source
    previous, _compile_range_source = _compile_range_source, source
    return previous


def _forget_source() -> None:
    set_compile_range_source(None)


register_state(__name__, _forget_source)


def engine_compile_range() -> TokenRange | None:
    """The token range the engine compiles the current graph for, or None (no source, or the
    source knows of no compile in progress)."""
    return _compile_range_source() if _compile_range_source is not None else None


def shape_env_ranges() -> list[tuple[str, str]]:
    """Value ranges of every symbol of the graph being compiled (for cache keys), or []."""
    context = torch._guards.TracingContext.try_get()
    fake_mode = getattr(context, "fake_mode", None)
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        return []
    return sorted((str(symbol), str(bounds)) for symbol, bounds in shape_env.var_to_range.items())
