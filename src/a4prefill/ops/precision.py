"""One vocabulary for precision: the precisions, a row plan, one MoE call, the kernels' modes.

- :data:`W4A16`, :data:`A4` and :data:`A8` name the precisions a row can run (counters, plans,
  reports); :data:`PREFILL_PRECISIONS` are the two a prefill row may run instead of W4A16 (the
  ``prefill_precision`` setting, the ops' ``prefill_precision`` argument); :data:`SPLIT` names
  a call whose rows differ.
- :class:`RowPlan` says which precision each row of one call runs: every row W4A16, every row
  the prefill precision, or split by row types (decode and padding rows W4A16, prefill rows the
  plan's prefill precision). The op makes it from what the three deciders said (the pass chose
  the op, load time gave or withheld the layer's scales and chose its prefill precision, the row
  provider typed the rows); backends only execute it.
- :class:`MoECall` is one call's data: activations, routing, the layer's experts and A4 scales,
  the swiglu clamp, the layer's name and its prefill precision. Every backend takes it whole.
- :data:`MODE_W4A16`, :data:`MODE_A4`, :data:`MODE_SPLIT`: the ``MODE`` constexpr the triton
  backend's kernels take (its launcher derives it from a call's A4 scales and row flags); the
  kernels compare with these names. The triton kernels have no A8 mode.

Who may call: the ops (to make plans), backends and their kernels (to read them), tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.rows import RowTypes, Span
from a4prefill.ops.scales import A4Scales

W4A16 = "w4a16"
A4 = "a4"
A8 = "a8"
PRECISIONS = (W4A16, A4, A8)
# What prefill rows may run (the ``prefill_precision`` setting): A4 (NVFP4 activations) or A8
# (FP8 e4m3 activations, docs/numerics.md section 8)
PREFILL_PRECISIONS = (A4, A8)
SPLIT = "split"
MODE_W4A16, MODE_A4, MODE_SPLIT = 0, 1, 2
_KINDS = (*PRECISIONS, SPLIT)


def check_prefill_precision(value: object, name: str = "prefill_precision") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of :data:`PREFILL_PRECISIONS`."""
    if not isinstance(value, str) or value not in PREFILL_PRECISIONS:
        raise ValueError(f"{name} must be one of {list(PREFILL_PRECISIONS)}, got {value!r}")


@dataclass(frozen=True)
class RowPlan:
    """The precision of every row of a call of ``num_rows`` rows: ``kind`` :data:`W4A16`,
    :data:`A4` or :data:`A8` (every row), or :data:`SPLIT` with ``row_types`` (decode and padding
    rows W4A16, prefill rows ``prefill``). ``prefill`` is the plan's prefill precision (one of
    :data:`PREFILL_PRECISIONS`; a uniform A4 or A8 plan's is its kind). A plan with A4 rows needs
    the layer's A4 scales; A8 needs none (its scales are dynamic)."""

    kind: str
    num_rows: int
    row_types: RowTypes | None = None
    prefill: str = A4

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"RowPlan.kind must be one of {sorted(_KINDS)}, got {self.kind!r}")
        check_prefill_precision(self.prefill, "RowPlan.prefill")
        if self.kind in PREFILL_PRECISIONS and self.prefill != self.kind:
            raise ValueError(
                f"RowPlan: a uniform {self.kind!r} plan has prefill {self.kind!r}, got {self.prefill!r}"
            )
        if (self.kind == SPLIT) != (self.row_types is not None):
            raise ValueError(f"RowPlan: row_types are given with kind {SPLIT!r} and only then")
        if self.row_types is not None and self.row_types.num_rows != self.num_rows:
            raise ValueError(
                f"RowPlan: row_types cover {self.row_types.num_rows} rows, the call has {self.num_rows}"
            )

    @classmethod
    def uniform(cls, precision: str, num_rows: int) -> RowPlan:
        """Every row in ``precision`` (:data:`W4A16`, :data:`A4` or :data:`A8`)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        return cls(precision, num_rows, prefill=precision if precision in PREFILL_PRECISIONS else A4)

    @classmethod
    def for_rows(cls, row_types: RowTypes, prefill: str = A4) -> RowPlan:
        """Prefill rows in ``prefill`` (:data:`A4` or :data:`A8`), the others W4A16: a uniform
        plan where all rows are of one precision."""
        check_prefill_precision(prefill, "prefill")
        count = row_types.num_prefill_rows
        if count == 0:
            return cls(W4A16, row_types.num_rows, prefill=prefill)
        if count == row_types.num_rows:
            return cls(prefill, row_types.num_rows, prefill=prefill)
        return cls(SPLIT, row_types.num_rows, row_types, prefill)

    @property
    def precisions(self) -> tuple[str, ...]:
        """The precisions this plan gives rows (whether or not it has rows of each)."""
        return (W4A16, self.prefill) if self.kind == SPLIT else (self.kind,)

    def spans(self, precision: str) -> tuple[Span, ...]:
        """The sorted spans of rows that run ``precision``."""
        whole = ((0, self.num_rows),) if self.num_rows else ()
        if self.row_types is None:
            return whole if precision == self.kind else ()
        if precision == self.prefill:
            return self.row_types.prefill
        if precision == W4A16:
            return tuple(sorted(self.row_types.decode + self.row_types.padding))
        return ()

    def rows(self, precision: str) -> int:
        """How many rows run ``precision``."""
        return sum(end - start for start, end in self.spans(precision))


@dataclass(frozen=True)
class MoECall:
    """One MoE call: ``hidden_states [T, H]`` (bf16 or fp16), ``topk_weights [T, k]``,
    ``topk_ids [T, k]``, the layer's ``experts`` and ``a4_scales`` (None: the layer has none),
    the optional ``swiglu_limit``, the ``layer_name`` (counters, messages, the row provider) and
    the ``prefill_precision`` its prefill rows run (:data:`A4`: with ``a4_scales``, else W4A16
    only; :data:`A8`: no A4 scales, H and I multiples of 128). Validated by
    :func:`a4prefill.ops.checks.check_moe_call` before a backend sees it."""

    hidden_states: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    experts: NvFp4Experts
    a4_scales: A4Scales | None = None
    swiglu_limit: float | None = None
    layer_name: str = ""
    prefill_precision: str = A4

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
