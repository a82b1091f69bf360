"""Row types of the current vLLM step, read from the forward context (host data only).

Contract (who may call: :func:`a4prefill.ops.rows.current_row_types`, through
:func:`a4prefill.ops.set_row_provider`; the plugin installs :class:`ForwardContextRowProvider`):

- A request with ``0 < query_len <= max_decode_len`` (``1 + num_speculative_tokens`` of the
  engine's speculative config) is decode or speculative verify; a longer one is prefill; rows
  past the scheduled tokens are padding.
- Host data only. In order of preference per attention-metadata entry: backend counts
  (``num_decodes``/``num_decode_tokens``/``num_prefills``: decodes come first there), a host
  ``max_query_len <= max_decode_len`` (decode-only step, nothing read), a CPU
  ``query_start_loc`` / ``query_start_loc_cpu``; a device-only ``query_start_loc`` costs one
  host read, at most once per step (the result is cached on the forward context object).
- Several metadata entries (one per KV-cache group, or the list of two dicts under dual-batch
  overlap) are merged row by row: a row is prefill only if every entry says prefill; a row any
  entry calls decode is decode.
- No forward context, no attention metadata, or a captured step (``cudagraph_runtime_mode``
  not NONE): every row is decode (W4A16).
- Sequence-parallel MoE: when the op sees only this rank's slice of the padded rows, the step's
  row types are sliced with :func:`a4prefill.ops.shard_row_types`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from a4prefill.ops.rows import RowTypes, row_types_from_query_start_loc, shard_row_types

logger = logging.getLogger(__name__)

CACHE_ATTRIBUTE = "_a4prefill_row_types"
"""Attribute set on the forward context object: ``{num_rows: RowTypes | None}`` for this step."""

_LABEL_RANK = {"prefill": 0, "padding": 1, "decode": 2}


def metadata_entries(attn_metadata: Any) -> list[Any]:
    """Distinct backend metadata objects of a forward context's ``attn_metadata``.

    Accepts a dict (layer name -> metadata), a list of such dicts (dual-batch overlap) or None.
    """
    if attn_metadata is None:
        return []
    groups: Iterable[Any]
    if isinstance(attn_metadata, Mapping):
        groups = [attn_metadata]
    elif isinstance(attn_metadata, Sequence):
        groups = attn_metadata
    else:
        groups = [{"": attn_metadata}]
    entries: dict[int, Any] = {}
    for group in groups:
        values = group.values() if isinstance(group, Mapping) else [group]
        for value in values:
            if value is not None:
                entries.setdefault(id(value), value)
    return list(entries.values())


def _int_attr(metadata: Any, name: str) -> int | None:
    value = getattr(metadata, name, None)
    if value is None or isinstance(value, torch.Tensor):
        return None
    return int(value)


def row_types_from_metadata(metadata: Any, num_rows: int, max_decode_len: int) -> RowTypes | None:
    """Row types of ``num_rows`` rows from one backend metadata object, or None if unknown.

    Reads host fields only, except a device-only ``query_start_loc`` (one ``tolist()``).
    """
    num_prefills = _int_attr(metadata, "num_prefills")
    num_decode_tokens = _int_attr(metadata, "num_decode_tokens")
    num_actual = _int_attr(metadata, "num_actual_tokens")
    if num_prefills is not None and num_decode_tokens is not None:
        # FlashInfer / MLA style: decodes are reordered to the front.
        num_prefill_tokens = _int_attr(metadata, "num_prefill_tokens")
        if num_prefill_tokens is None:
            num_prefill_tokens = 0 if num_prefills == 0 else (num_actual or num_rows) - num_decode_tokens
        used = num_decode_tokens + num_prefill_tokens
        if used > num_rows:
            return None
        decode = ((0, num_decode_tokens),) if num_decode_tokens else ()
        prefill = ((num_decode_tokens, used),) if num_prefill_tokens else ()
        padding = ((used, num_rows),) if num_rows > used else ()
        return RowTypes(num_rows, decode, prefill, padding)
    max_query_len = _int_attr(metadata, "max_query_len")
    if max_query_len is not None and max_query_len <= max_decode_len:
        used = num_actual if num_actual is not None else num_rows
        if used > num_rows:
            return None
        return RowTypes(
            num_rows, ((0, used),) if used else (), (), ((used, num_rows),) if used < num_rows else ()
        )
    query_start_loc = getattr(metadata, "query_start_loc_cpu", None)
    if query_start_loc is None:
        query_start_loc = getattr(metadata, "query_start_loc", None)
    if not isinstance(query_start_loc, torch.Tensor):
        return None
    starts = query_start_loc.tolist()  # host copy; one device read at most per step (cached)
    if num_actual is not None:
        starts = [min(int(s), num_actual) for s in starts]
    if not starts or int(starts[-1]) > num_rows:
        return None
    return row_types_from_query_start_loc(starts, max_decode_len, num_rows)


def merge_row_types(candidates: Sequence[RowTypes]) -> RowTypes:
    """Row-wise merge: decode wins over padding, padding over prefill (prefill needs consensus)."""
    if len(candidates) == 1:
        return candidates[0]
    label_lists = [c.labels() for c in candidates]
    merged = [max(labels, key=_LABEL_RANK.__getitem__) for labels in zip(*label_lists, strict=True)]
    return RowTypes.from_labels(merged)


@dataclass
class ForwardContextRowProvider:
    """The plugin's row provider (see the module docstring).

    ``max_decode_len``: 1 + speculative tokens; ``enabled``: False types every row decode;
    ``sp_rank``/``sp_size``: sequence-parallel MoE rank and size (1 = off).
    """

    max_decode_len: int = 1
    enabled: bool = True
    sp_rank: int = 0
    sp_size: int = 1

    def __call__(self, num_rows: int) -> RowTypes | None:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not self.enabled or not is_forward_context_available():
            return RowTypes.all_decode(num_rows)
        context = get_forward_context()
        if context.cudagraph_runtime_mode != CUDAGraphMode.NONE:
            return RowTypes.all_decode(num_rows)
        cache = getattr(context, CACHE_ATTRIBUTE, None)
        if cache is None:
            cache = {}
            setattr(context, CACHE_ATTRIBUTE, cache)
        if num_rows not in cache:
            cache[num_rows] = self.row_types_for(context.attn_metadata, num_rows)
        return cache[num_rows]

    def row_types_for(self, attn_metadata: Any, num_rows: int) -> RowTypes:
        """Row types of ``num_rows`` rows for this metadata (all decode when unknown)."""
        entries = metadata_entries(attn_metadata)
        if not entries:
            return RowTypes.all_decode(num_rows)
        global_rows = num_rows
        if self.sp_size > 1 and not self._is_global(entries, num_rows):
            global_rows = num_rows * self.sp_size
        candidates = []
        for metadata in entries:
            row_types = row_types_from_metadata(metadata, global_rows, self.max_decode_len)
            if row_types is None:
                return RowTypes.all_decode(num_rows)
            candidates.append(row_types)
        merged = merge_row_types(candidates)
        if global_rows != num_rows:
            merged = shard_row_types(merged, self.sp_rank, self.sp_size)
        return merged

    @staticmethod
    def _is_global(entries: Sequence[Any], num_rows: int) -> bool:
        """True when ``num_rows`` covers the step's scheduled tokens (not a rank's slice)."""
        actual = [_int_attr(m, "num_actual_tokens") for m in entries]
        known = [a for a in actual if a is not None]
        return not known or max(known) <= num_rows
