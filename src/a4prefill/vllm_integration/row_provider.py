"""Which rows of a vLLM step are prefill: the row provider, from host query lengths only.

This module is one of the three places that decide precision: *which rows of a step are
prefill*. The rule (docs/vllm-internals.md, section 6):

- a request with ``0 < query_len <= max_decode_len`` (``1 + num_speculative_tokens`` of the
  engine's speculative config) is decode or speculative verify; a longer one is prefill; rows
  past the scheduled tokens are padding;
- query lengths come from a host ``query_start_loc`` (``query_start_loc_cpu``, or a CPU
  ``query_start_loc``), else from one host read of a device ``query_start_loc`` per uncaptured
  step (cached on the forward context object);
- attention backends' own counts (``num_decodes``, ``num_decode_tokens``, ``num_prefills``)
  follow each backend's ``reorder_batch_threshold`` / ``require_uniform`` rules, not this rule:
  together with a host ``max_query_len <= max_decode_len`` they may confirm a decode-only step
  (nothing is read then), but they never mark a row prefill;
- several metadata entries of one step (one per KV-cache group) must agree; where they do not,
  a row is prefill only if every entry says so;
- dual-batch overlap: ``attn_metadata`` is a list of one dict per micro-batch; micro-batch ``i``'s
  rows are placed at its own token slice (``ubatch_slices[i].token_slice`` when the context has
  them, else one after the other);
- a captured step (``cudagraph_runtime_mode`` not NONE), no attention metadata (profile and dummy
  runs), or no usable metadata: every row decode (W4A16);
- a layer whose A4 a refused reload withdrew (load time's decision, the method's
  ``a4_withdrawn``; compiled graphs still pass the layer's old scale buffers to the op): every
  row decode (W4A16), one warning per layer;
- sequence-parallel MoE: when the op sees only this rank's slice of the padded rows, the step's
  row types are sliced with :func:`a4prefill.ops.shard_row_types`.

The provider keeps no state: :func:`forward_context_row_types` finds the layer's
:class:`RowPolicy` (the engine's decode length and sequence-parallel rank, set when the layer was
built) through the forward context's ``no_compile_layers``, so every engine in a process uses its
own. Who may call: :func:`a4prefill.ops.rows.current_row_types`, through
:func:`a4prefill.ops.set_row_provider` (the plugin installs it when it registers); tests.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from a4prefill.ops.rows import RowTypes, row_types_from_query_start_loc, shard_row_types
from a4prefill.process_state import warn_once

logger = logging.getLogger(__name__)

CACHE_ATTRIBUTE = "_a4prefill_row_types"
"""Attribute set on the forward context object: ``{(num_rows, policy): RowTypes | None}``."""

_LABEL_RANK = MappingProxyType({"prefill": 0, "padding": 1, "decode": 2})


@dataclass(frozen=True)
class RowPolicy:
    """What an engine's steps need to be typed: ``max_decode_len`` (1 + speculative tokens) and
    the sequence-parallel MoE rank and size (``sp_size`` 1: off). Set per layer at build time."""

    max_decode_len: int = 1
    sp_rank: int = 0
    sp_size: int = 1

    def __post_init__(self) -> None:
        if self.max_decode_len < 1:
            raise ValueError(f"max_decode_len must be >= 1, got {self.max_decode_len}")
        if not 0 <= self.sp_rank < self.sp_size:
            raise ValueError(f"need 0 <= sp_rank < sp_size, got {self.sp_rank}, {self.sp_size}")

    def row_types(
        self, attn_metadata: Any, num_rows: int, ubatch_slices: Sequence[Any] | None = None
    ) -> RowTypes | None:
        """Row types of ``num_rows`` rows for this step's metadata; None when it says nothing."""
        if attn_metadata is None:
            return None
        global_rows = num_rows
        if self.sp_size > 1 and not _covers_step(attn_metadata, num_rows):
            global_rows = num_rows * self.sp_size
        if isinstance(attn_metadata, Mapping):
            rows = _dict_row_types(attn_metadata, global_rows, self.max_decode_len)
        else:
            rows = _micro_batch_row_types(attn_metadata, global_rows, self.max_decode_len, ubatch_slices)
        if rows is not None and global_rows != num_rows:
            rows = shard_row_types(rows, self.sp_rank, self.sp_size)
        return rows


def _host_int(metadata: Any, name: str) -> int | None:
    value = getattr(metadata, name, None)
    if value is None or isinstance(value, torch.Tensor):
        return None
    return int(value)


def _starts(metadata: Any, allow_device_read: bool) -> list[int] | None:
    """``query_start_loc`` of one metadata object as host ints (a device tensor only if allowed)."""
    for name in ("query_start_loc_cpu", "query_start_loc"):
        value = getattr(metadata, name, None)
        if isinstance(value, torch.Tensor) and (value.device.type == "cpu" or allow_device_read):
            return [int(v) for v in value.tolist()]  # one host read for a device tensor
    return None


def _from_starts(starts: list[int], metadata: Any, num_rows: int, max_decode_len: int) -> RowTypes | None:
    num_actual = _host_int(metadata, "num_actual_tokens")
    if num_actual is not None:
        starts = [min(s, num_actual) for s in starts]
    if not starts or starts[-1] > num_rows:
        return None
    return row_types_from_query_start_loc(starts, max_decode_len, num_rows)


def _confirmed_decode_only(metadata: Any, num_rows: int, max_decode_len: int) -> RowTypes | None:
    """All decode when the backend's host counts say so under this rule; else None."""
    max_query_len = _host_int(metadata, "max_query_len")
    num_prefills = _host_int(metadata, "num_prefills")
    if max_query_len is None or max_query_len > max_decode_len or (num_prefills or 0) > 0:
        return None
    used = _host_int(metadata, "num_actual_tokens")
    used = num_rows if used is None else used
    if used > num_rows:
        return None
    return RowTypes(
        num_rows, ((0, used),) if used else (), (), ((used, num_rows),) if used < num_rows else ()
    )


def merge_row_types(candidates: Sequence[RowTypes]) -> RowTypes:
    """Row-wise merge: decode wins over padding, padding over prefill (prefill needs consensus)."""
    if len(candidates) == 1:
        return candidates[0]
    label_lists = [c.labels() for c in candidates]
    merged = [max(labels, key=_LABEL_RANK.__getitem__) for labels in zip(*label_lists, strict=True)]
    return RowTypes.from_labels(merged)


def _dict_row_types(group: Mapping[str, Any], num_rows: int, max_decode_len: int) -> RowTypes | None:
    """Row types from one dict of metadata (layer name -> metadata) describing ``num_rows`` rows."""
    entries = list({id(m): m for m in group.values() if m is not None}.values())
    host = [(m, s) for m in entries if (s := _starts(m, allow_device_read=False)) is not None]
    if host:
        typed = [_from_starts(s, m, num_rows, max_decode_len) for m, s in host]
        return None if any(t is None for t in typed) else merge_row_types(typed)  # type: ignore[arg-type]
    for metadata in entries:
        confirmed = _confirmed_decode_only(metadata, num_rows, max_decode_len)
        if confirmed is not None:
            return confirmed
    for metadata in entries:
        starts = _starts(metadata, allow_device_read=True)
        if starts is not None:
            return _from_starts(starts, metadata, num_rows, max_decode_len)
    return None


def _micro_batch_row_types(
    groups: Sequence[Any], num_rows: int, max_decode_len: int, ubatch_slices: Sequence[Any] | None
) -> RowTypes | None:
    """Dual-batch overlap: one dict per micro-batch, each typed over its own token slice."""
    labels = ["padding"] * num_rows
    position = 0
    for index, group in enumerate(groups):
        if not isinstance(group, Mapping):
            return None
        if ubatch_slices is not None and index < len(ubatch_slices):
            token_slice = ubatch_slices[index].token_slice
            start, stop = int(token_slice.start), int(token_slice.stop)
        else:
            start = position
            stop = start + _micro_batch_tokens(group)
        if stop > num_rows:
            return None
        rows = _dict_row_types(group, stop - start, max_decode_len)
        if rows is None:
            return None
        labels[start:stop] = rows.labels()
        position = stop
    return RowTypes.from_labels(labels)


def _micro_batch_tokens(group: Mapping[str, Any]) -> int:
    for metadata in group.values():
        actual = _host_int(metadata, "num_actual_tokens")
        if actual is not None:
            return actual
        starts = _starts(metadata, allow_device_read=False)
        if starts:
            return starts[-1]
    return 0


def _covers_step(attn_metadata: Any, num_rows: int) -> bool:
    """True when ``num_rows`` covers the step's scheduled tokens (not one rank's slice)."""
    groups = [attn_metadata] if isinstance(attn_metadata, Mapping) else list(attn_metadata)
    tokens = sum(_micro_batch_tokens(g) for g in groups if isinstance(g, Mapping))
    return tokens <= num_rows


def _method_of(layer: Any) -> Any:
    """The quantization method behind a ``no_compile_layers`` entry (None: none)."""
    return getattr(getattr(layer, "routed_experts", layer), "quant_method", None)


def row_policy_of(layer: Any) -> RowPolicy | None:
    """The :class:`RowPolicy` of the a4prefill MoE method behind a ``no_compile_layers`` entry."""
    policy = getattr(_method_of(layer), "row_policy", None)
    return policy if isinstance(policy, RowPolicy) else None


def a4_withdrawn_of(layer: Any) -> str | None:
    """Why a refused reload withdrew the A4 of the MoE method behind a ``no_compile_layers``
    entry (None: it did not)."""
    reason = getattr(_method_of(layer), "a4_withdrawn", None)
    return reason if isinstance(reason, str) else None


def forward_context_row_types(num_rows: int, layer_name: str) -> RowTypes | None:
    """The row provider the plugin installs (see the module docstring)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    context = get_forward_context()
    if context.cudagraph_runtime_mode != CUDAGraphMode.NONE or context.attn_metadata is None:
        return RowTypes.all_decode(num_rows)
    layer = context.no_compile_layers.get(layer_name)
    policy = row_policy_of(layer)
    withdrawn = a4_withdrawn_of(layer)
    if withdrawn is not None:
        warn_once(
            logger,
            ("a4 withdrawn", layer_name),
            "a4prefill: layer %r: A4 withdrawn by a refused reload (%s): its rows run W4A16",
            layer_name,
            withdrawn,
        )
        return RowTypes.all_decode(num_rows)
    if policy is None:
        warn_once(
            logger,
            ("no row policy", layer_name),
            "a4prefill: layer %r is not an a4prefill MoE layer of this engine: its rows run W4A16",
            layer_name,
        )
        return RowTypes.all_decode(num_rows)
    cache = getattr(context, CACHE_ATTRIBUTE, None)
    if cache is None:
        cache = {}
        setattr(context, CACHE_ATTRIBUTE, cache)
    key = (num_rows, policy)
    if key not in cache:
        cache[key] = policy.row_types(context.attn_metadata, num_rows, context.ubatch_slices)
    rows = cache[key]
    if rows is None:
        warn_once(
            logger,
            ("no query lengths", layer_name),
            "a4prefill: layer %s: this step's attention metadata gives no query lengths: its rows run W4A16",
            layer_name,
        )
        return RowTypes.all_decode(num_rows)
    return rows
