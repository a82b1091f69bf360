"""One vocabulary for precision: the two precisions, a row plan, one MoE call, the kernels' modes.

- :data:`W4A16` and :data:`A4` name the two precisions a row can run (counters, plans, reports);
  :data:`SPLIT` names a call whose rows differ.
- :class:`RowPlan` says which precision each row of one call runs: every row W4A16, every row A4,
  or split by row types (decode and padding rows W4A16, prefill rows A4). The op makes it from
  what the three deciders said (the pass chose the op, load time gave or withheld the layer's A4
  scales, the row provider typed the rows); backends only execute it.
- :class:`MoECall` is one call's data: activations, routing, the layer's experts and A4 scales,
  the swiglu clamp and the layer's name. Every backend takes it whole.
- :data:`MODE_W4A16`, :data:`MODE_A4`, :data:`MODE_SPLIT`: the ``MODE`` constexpr the triton
  backend's kernels take (:attr:`RowPlan.mode`); the kernels compare with these names.

Who may call: the ops (to make plans), backends and their kernels (to read them), tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

import torch

from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.rows import RowTypes, Span
from a4prefill.ops.scales import A4Scales

W4A16 = "w4a16"
A4 = "a4"
A8 = "a8"
PRECISIONS = (W4A16, A4)
# What prefill rows may run (the ``prefill_precision`` setting): A4 (NVFP4 activations) or A8
# (FP8 e4m3 activations, docs/numerics.md section 8)
PREFILL_PRECISIONS = (A4, A8)
SPLIT = "split"
MODE_W4A16, MODE_A4, MODE_SPLIT = 0, 1, 2
_MODES = MappingProxyType({W4A16: MODE_W4A16, A4: MODE_A4, SPLIT: MODE_SPLIT})


@dataclass(frozen=True)
class RowPlan:
    """The precision of every row of a call of ``num_rows`` rows: ``kind`` :data:`W4A16` or
    :data:`A4` (every row), or :data:`SPLIT` with ``row_types`` (decode and padding rows W4A16,
    prefill rows A4). A plan with A4 rows needs the layer's A4 scales."""

    kind: str
    num_rows: int
    row_types: RowTypes | None = None

    def __post_init__(self) -> None:
        if self.kind not in _MODES:
            raise ValueError(f"RowPlan.kind must be one of {sorted(_MODES)}, got {self.kind!r}")
        if (self.kind == SPLIT) != (self.row_types is not None):
            raise ValueError(f"RowPlan: row_types are given with kind {SPLIT!r} and only then")
        if self.row_types is not None and self.row_types.num_rows != self.num_rows:
            raise ValueError(
                f"RowPlan: row_types cover {self.row_types.num_rows} rows, the call has {self.num_rows}"
            )

    @classmethod
    def uniform(cls, precision: str, num_rows: int) -> RowPlan:
        """Every row in ``precision`` (:data:`W4A16` or :data:`A4`)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        return cls(precision, num_rows)

    @classmethod
    def for_rows(cls, row_types: RowTypes) -> RowPlan:
        """Prefill rows A4, the others W4A16: a uniform plan where all rows are of one precision."""
        prefill = row_types.num_prefill_rows
        if prefill == 0:
            return cls(W4A16, row_types.num_rows)
        if prefill == row_types.num_rows:
            return cls(A4, row_types.num_rows)
        return cls(SPLIT, row_types.num_rows, row_types)

    @property
    def mode(self) -> int:
        """The triton kernels' ``MODE`` of this plan."""
        return _MODES[self.kind]

    def spans(self, precision: str) -> tuple[Span, ...]:
        """The sorted spans of rows that run ``precision``."""
        whole = ((0, self.num_rows),) if self.num_rows else ()
        if self.row_types is None:
            return whole if precision == self.kind else ()
        if precision == A4:
            return self.row_types.prefill
        return tuple(sorted(self.row_types.decode + self.row_types.padding))

    def rows(self, precision: str) -> int:
        """How many rows run ``precision``."""
        return sum(end - start for start, end in self.spans(precision))


@dataclass(frozen=True)
class MoECall:
    """One MoE call: ``hidden_states [T, H]`` (bf16 or fp16), ``topk_weights [T, k]``,
    ``topk_ids [T, k]``, the layer's ``experts`` and ``a4_scales`` (None: the layer has none and
    runs W4A16 only), the optional ``swiglu_limit`` and the ``layer_name`` (counters, messages,
    the row provider). Validated by :func:`a4prefill.ops.checks.check_moe_call` before a backend
    sees it."""

    hidden_states: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    experts: NvFp4Experts
    a4_scales: A4Scales | None = None
    swiglu_limit: float | None = None
    layer_name: str = ""

    @property
    def num_rows(self) -> int:
        return int(self.hidden_states.shape[0])

    def select(self, rows: slice | torch.Tensor) -> MoECall:
        """The call on ``rows`` only (a slice, or an index tensor on the call's device)."""
        return dataclasses.replace(
            self,
            hidden_states=self.hidden_states[rows],
            topk_weights=self.topk_weights[rows],
            topk_ids=self.topk_ids[rows],
        )
