"""Which rows of a step are decode and which are prefill: spans, shards, the step context.

Pure Python on host data; nothing here reads device memory.

- A request with ``0 < query_len <= max_decode_len`` (1 + speculative tokens) is decode (or
  speculative verify); a longer one is prefill; rows past the last request are padding.
- :class:`RowTypes` holds the three kinds as sorted, disjoint, half-open spans that together
  cover ``[0, num_rows)`` exactly once.
- The split op asks :func:`current_row_types` for the row types of its call. Code that knows
  the rows itself opens a :func:`step_row_types` block; an engine integration installs a row
  provider with :func:`set_row_provider` (the vLLM plugin does, reading vLLM's forward context).
  The provider is the only code that decides which rows of an engine step are prefill; it must
  hold no state of its own (everything it needs comes from the current step and the layer).
  With no information every row runs W4A16 (one warning per layer).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from a4prefill.process_state import register_state, warn_once

logger = logging.getLogger(__name__)

Span = tuple[int, int]


@dataclass(frozen=True)
class RowTypes:
    """Row kinds of one call of ``num_rows`` rows, as sorted disjoint half-open spans."""

    num_rows: int
    decode: tuple[Span, ...]
    prefill: tuple[Span, ...]
    padding: tuple[Span, ...]

    def __post_init__(self) -> None:
        spans = sorted(self.decode + self.prefill + self.padding)
        position = 0
        for start, end in spans:
            if start != position or end <= start:
                raise ValueError(f"row spans must cover [0, {self.num_rows}) exactly once, got {spans}")
            position = end
        if position != self.num_rows:
            raise ValueError(f"row spans must cover [0, {self.num_rows}) exactly once, got {spans}")

    @property
    def num_prefill_rows(self) -> int:
        return sum(end - start for start, end in self.prefill)

    @property
    def num_decode_rows(self) -> int:
        return sum(end - start for start, end in self.decode)

    @property
    def num_padding_rows(self) -> int:
        return sum(end - start for start, end in self.padding)

    @classmethod
    def all_decode(cls, num_rows: int) -> RowTypes:
        return cls(num_rows, ((0, num_rows),) if num_rows else (), (), ())

    @classmethod
    def from_labels(cls, labels: Sequence[str]) -> RowTypes:
        """Build from one label per row: ``"decode"``, ``"prefill"`` or ``"padding"``."""
        spans: dict[str, list[Span]] = {"decode": [], "prefill": [], "padding": []}
        for row, label in enumerate(labels):
            if label not in spans:
                raise ValueError(f"row label must be decode, prefill or padding, got {label!r}")
            _append_row_range(spans[label], row, row + 1)
        return cls(len(labels), tuple(spans["decode"]), tuple(spans["prefill"]), tuple(spans["padding"]))

    def labels(self) -> list[str]:
        """One label per row (``"decode"``, ``"prefill"``, ``"padding"``)."""
        labels = [""] * self.num_rows
        for kind in ("decode", "prefill", "padding"):
            for start, end in getattr(self, kind):
                labels[start:end] = [kind] * (end - start)
        return labels


def _append_row_range(spans: list[Span], start: int, end: int) -> None:
    """Append ``[start, end)`` to sorted ``spans``, merging with the last span if adjacent."""
    if spans and spans[-1][1] == start:
        spans[-1] = (spans[-1][0], end)
    else:
        spans.append((start, end))


def row_types_from_query_lens(
    query_lens: Sequence[int], max_decode_len: int, num_rows: int | None = None
) -> RowTypes:
    """Row types of a batch whose requests own consecutive rows in order.

    ``query_lens``: tokens per request (>= 0); ``max_decode_len``: 1 + speculative tokens (>= 1);
    ``num_rows``: the call's row count (>= sum of lengths; the rest is padding), default the sum.
    """
    if max_decode_len < 1:
        raise ValueError(f"max_decode_len must be >= 1 (1 + speculative tokens), got {max_decode_len}")
    spans: dict[str, list[Span]] = {"decode": [], "prefill": []}
    position = 0
    for length in query_lens:
        length = _integer(length, "query_lens")
        if length < 0:
            raise ValueError(f"query_lens must be >= 0, got {length}")
        if length:
            kind = "decode" if length <= max_decode_len else "prefill"
            _append_row_range(spans[kind], position, position + length)
            position += length
    total = position if num_rows is None else num_rows
    if total < position:
        raise ValueError(f"num_rows={total} is smaller than the {position} rows the requests hold")
    padding = ((position, total),) if total > position else ()
    return RowTypes(total, tuple(spans["decode"]), tuple(spans["prefill"]), padding)


def _integer(value: object, name: str) -> int:
    """``value`` as an int; non-integers (floats, bools, strings) are an error, never truncated."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must hold integers, got {value!r} ({type(value).__name__})")
    return int(value)


def row_types_from_query_start_loc(
    query_start_loc: Sequence[int] | torch.Tensor, max_decode_len: int, num_rows: int | None = None
) -> RowTypes:
    """Row types from a host ``query_start_loc`` ([num_requests + 1], starting at 0)."""
    if isinstance(query_start_loc, torch.Tensor):
        if query_start_loc.device.type != "cpu":
            raise ValueError("query_start_loc must be a CPU tensor (no device reads here)")
        if query_start_loc.is_floating_point() or query_start_loc.is_complex():
            raise TypeError(f"query_start_loc must be an integer tensor, got {query_start_loc.dtype}")
        query_start_loc = query_start_loc.tolist()
    starts = [_integer(v, "query_start_loc") for v in query_start_loc]
    if not starts or starts[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {starts[:4]}")
    lengths = [b - a for a, b in itertools.pairwise(starts)]
    if any(length < 0 for length in lengths):
        raise ValueError("query_start_loc must be non-decreasing")
    return row_types_from_query_lens(lengths, max_decode_len, num_rows)


def shard_row_types(global_rows: RowTypes, rank: int, world_size: int) -> RowTypes:
    """Row types of ``rank``'s slice under sequence-parallel chunking.

    The global rows are padded to a multiple of ``world_size`` and cut into equal contiguous
    chunks; ``rank`` holds ``[rank * c, (rank + 1) * c)`` with ``c = ceil(num_rows / world_size)``.
    Rows added by that padding are padding.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    chunk = -(-global_rows.num_rows // world_size)
    low, high = rank * chunk, (rank + 1) * chunk

    def clip(spans: tuple[Span, ...]) -> list[Span]:
        return [(max(a, low) - low, min(b, high) - low) for a, b in spans if a < high and b > low]

    padding = clip(global_rows.padding)
    if high > global_rows.num_rows:
        padding.append((max(global_rows.num_rows, low) - low, chunk))
    merged: list[Span] = []
    for start, end in sorted(padding):
        _append_row_range(merged, start, end)
    return RowTypes(chunk, tuple(clip(global_rows.decode)), tuple(clip(global_rows.prefill)), tuple(merged))


# ---------------------------------------------------------------------------------------------
# Step context: where the split op learns the row types of its call.

RowProvider = Callable[[int, str], "RowTypes | None"]
"""Called with the op's row count and layer name; returns that call's row types, or None."""

_provider: RowProvider | None = None
_step_rows: contextvars.ContextVar[RowTypes | None] = contextvars.ContextVar(
    "a4prefill_step_rows", default=None
)


def _forget_provider() -> None:
    set_row_provider(None)


register_state(__name__, _forget_provider)


def set_row_provider(provider: RowProvider | None) -> RowProvider | None:
    """Install the row provider hook (engine integrations); returns the previous one."""
    global _provider
    previous, _provider = _provider, provider
    return previous


@contextlib.contextmanager
def step_row_types(row_types: RowTypes) -> Iterator[RowTypes]:
    """Within this block, split ops with ``row_types.num_rows`` rows use ``row_types``."""
    token = _step_rows.set(row_types)
    try:
        yield row_types
    finally:
        _step_rows.reset(token)


def current_row_types(num_rows: int, layer_name: str) -> RowTypes:
    """The row types for a split call of ``num_rows`` rows of layer ``layer_name``.

    A :func:`step_row_types` block wins over the provider. A size mismatch is an error; with no
    information at all every row is decode (W4A16) and one warning is logged per layer.
    """
    row_types = _step_rows.get()
    if row_types is None and _provider is not None:
        row_types = _provider(num_rows, layer_name)
    if row_types is None:
        warn_once(
            logger,
            ("no row types", layer_name),
            "a4prefill: layer %s has no row types for this step (no step_row_types block, no provider "
            "answer): its rows run W4A16",
            layer_name,
        )
        return RowTypes.all_decode(num_rows)
    if row_types.num_rows != num_rows:
        raise ValueError(f"row types describe {row_types.num_rows} rows but the split op got {num_rows} rows")
    return row_types
