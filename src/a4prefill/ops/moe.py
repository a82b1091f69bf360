"""The custom ops ``torch.ops.a4prefill.{moe_w4a16, moe_a4, moe_split}`` and their fake impls.

One schema for all three (:data:`SCHEMA`): hidden states, router outputs, the six NVFP4 expert
tensors (:class:`~a4prefill.ops.modelopt.NvFp4Experts`), the layer name (counters, messages, the
row provider), the layer's A4 encode scales as two optional tensors, the optional swiglu clamp,
and the layer's prefill precision ``prefill_precision`` (``'a4'``, the default, or ``'a8'``).
They are functional: each returns a new ``[T, H]`` tensor in the dtype of ``hidden_states``.

The ops execute; they decide nothing. Precision comes from exactly three places:

- the graph pass picks the op (``moe_split`` only where a graph may run uncaptured);
- load time gives or withholds the A4 scales (absent = the layer has no valid calibration) and
  passes the layer's prefill precision (the engine's ``prefill_precision`` setting);
- the row provider types each row of a split call (decode, prefill, padding).

The prefill precision is a schema argument, not a fourth op: it is data of the layer, like the
A4 scales, so it travels through ``moe_w4a16`` nodes into the ``moe_split`` nodes the pass makes
from them (the pass swaps the target and keeps every argument), and a graph compiled for one
precision holds it as a constant. An A8 call carries no A4 scales and needs H and I multiples
of 128 (checked with the other arguments, fake tensors included).

Semantics:

- ``moe_w4a16``: every row W4A16; A4 scales and the prefill precision, if given, are carried for
  the pass and ignored;
- ``moe_a4``: every row A4; without A4 scales, with ``prefill_precision`` other than ``'a4'``,
  or while a CUDA stream captures, an error;
- ``moe_split``: decode and padding rows W4A16, prefill rows the prefill precision: A4 with the
  call's A4 scales (every row W4A16 when the call has none), or A8 (docs/numerics.md section 8;
  no scales needed). Every row W4A16 while a CUDA stream captures (the capture guard: a second
  line of defence behind the pass, documented in the README).

A backend without a kernel for a precision the plan gives rows (today: A8 on the b12x backend,
and on the triton backend off sm_90 GPUs), or a plan with A4 rows for a call without A4 scales,
raises ``ValueError``; nothing falls back to another precision.

Who may call: anyone through :func:`call_moe` or ``torch.ops.a4prefill.*`` directly.
"""

from __future__ import annotations

import torch

from a4prefill.ops.backends import backend_for
from a4prefill.ops.checks import (
    a4_scales_argument,
    check_encode_scale_values,
    check_expert_ids,
    check_moe_call,
)
from a4prefill.ops.counters import record_rows
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.precision import A4, PRECISIONS, W4A16, MoECall, RowPlan
from a4prefill.ops.rows import current_row_types
from a4prefill.ops.scales import A4Scales

NAMESPACE = "a4prefill"
SCHEMA = (
    "(Tensor hidden_states, Tensor topk_weights, Tensor topk_ids, Tensor w13_weight, "
    "Tensor w13_weight_scale, Tensor w13_weight_scale_2, Tensor w2_weight, Tensor w2_weight_scale, "
    "Tensor w2_weight_scale_2, str layer_name, Tensor? a4_fc1_encode_scale=None, "
    "Tensor? a4_fc2_encode_scales=None, float? swiglu_limit=None, str prefill_precision='a4') -> Tensor"
)
OP_NAMES = ("moe_w4a16", "moe_a4", "moe_split")

_library = torch.library.Library(NAMESPACE, "DEF")
for _name in OP_NAMES:
    _library.define(_name + SCHEMA)


def _call(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_weight_scale: torch.Tensor,
    w13_weight_scale_2: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_weight_scale: torch.Tensor,
    w2_weight_scale_2: torch.Tensor,
    layer_name: str,
    a4_fc1_encode_scale: torch.Tensor | None = None,
    a4_fc2_encode_scales: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    prefill_precision: str = A4,
) -> MoECall:
    """The op's arguments (:data:`SCHEMA`) as one validated :class:`MoECall` (real or fake tensors)."""
    experts = NvFp4Experts(
        w13_weight, w13_weight_scale, w13_weight_scale_2, w2_weight, w2_weight_scale, w2_weight_scale_2
    )
    a4_scales = a4_scales_argument(a4_fc1_encode_scale, a4_fc2_encode_scales)
    call = MoECall(
        hidden_states, topk_weights, topk_ids, experts, a4_scales, swiglu_limit, layer_name, prefill_precision
    )
    check_moe_call(call)
    return call


def _real_call(*args: object, **kwargs: object) -> MoECall:
    """A call of a real (not fake) impl; expert ids and encode-scale values are checked too where
    that reads no device (on a GPU: no host sync per call; scales from
    :func:`~a4prefill.ops.scales.a4_calibration` are valid by construction)."""
    call = _call(*args, **kwargs)  # type: ignore[arg-type]
    if call.topk_ids.device.type == "cpu":
        check_expert_ids(call.topk_ids, call.experts.w13_weight.shape[0])
        if call.a4_scales is not None:
            check_encode_scale_values(call.a4_scales)
    return call


def _execute(call: MoECall, plan: RowPlan) -> torch.Tensor:
    """Refuse a plan the device's backend has no kernel for, count ``plan``'s rows (host
    counters; device counters where attached, with the kernel family that runs the call), then
    have the backend run it."""
    backend = backend_for(call.hidden_states.device)
    backend.check_plan(call, plan)
    record_rows(
        call.layer_name,
        call.experts.w13_weight,
        {precision: plan.rows(precision) for precision in PRECISIONS},
        lambda: backend.kernel_family(call, plan),
    )
    return backend.run(call, plan)


def is_capturing(tensor: torch.Tensor) -> bool:
    """True while ``tensor``'s CUDA stream is being captured into a CUDA graph."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _moe_w4a16(*args: object, **kwargs: object) -> torch.Tensor:
    call = _real_call(*args, **kwargs)
    return _execute(call, RowPlan.uniform(W4A16, call.num_rows))


def _moe_a4(*args: object, **kwargs: object) -> torch.Tensor:
    call = _real_call(*args, **kwargs)
    if call.prefill_precision != A4:
        raise ValueError(
            f"moe_a4 on layer {call.layer_name!r} runs every row A4; got prefill_precision "
            f"{call.prefill_precision!r} (prefill rows run it through moe_split)"
        )
    if call.a4_scales is None:
        raise ValueError(
            f"moe_a4 on layer {call.layer_name!r} needs A4 scales (a4_fc1_encode_scale, "
            "a4_fc2_encode_scales): this layer has none, so it runs W4A16 only"
        )
    if is_capturing(call.hidden_states):
        raise RuntimeError(
            f"moe_a4 on layer {call.layer_name!r} was called while a CUDA stream is capturing: a "
            "captured CUDA graph never runs A4 (use moe_split, which runs W4A16 under capture)"
        )
    return _execute(call, RowPlan.uniform(A4, call.num_rows))


def _moe_split(*args: object, **kwargs: object) -> torch.Tensor:
    call = _real_call(*args, **kwargs)
    without_scales = call.prefill_precision == A4 and call.a4_scales is None  # A8 needs none
    if without_scales or is_capturing(call.hidden_states):
        return _execute(call, RowPlan.uniform(W4A16, call.num_rows))
    row_types = current_row_types(call.num_rows, call.layer_name)
    return _execute(call, RowPlan.for_rows(row_types, call.prefill_precision))


def _moe_fake(*args: object, **kwargs: object) -> torch.Tensor:
    call = _call(*args, **kwargs)  # type: ignore[arg-type]
    return torch.empty_like(call.hidden_states)


for _name, _impl in zip(OP_NAMES, (_moe_w4a16, _moe_a4, _moe_split), strict=True):
    torch.library.impl(f"{NAMESPACE}::{_name}", "CompositeExplicitAutograd", lib=_library)(_impl)
    torch.library.register_fake(f"{NAMESPACE}::{_name}", lib=_library)(_moe_fake)

moe_w4a16 = torch.ops.a4prefill.moe_w4a16.default
moe_a4 = torch.ops.a4prefill.moe_a4.default
moe_split = torch.ops.a4prefill.moe_split.default


def call_moe(
    op: torch._ops.OpOverload,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: NvFp4Experts,
    a4_scales: A4Scales | None,
    layer_name: str,
    swiglu_limit: float | None = None,
    prefill_precision: str = A4,
) -> torch.Tensor:
    """Call one of the ops above with the expert tensors bundled in ``experts``, the layer's A4
    scales (None: the layer has none) and its ``prefill_precision`` (``'a4'``: prefill rows A4
    with ``a4_scales``, W4A16 without; ``'a8'``: ``a4_scales`` must be None)."""
    fc1, fc2 = (
        (None, None) if a4_scales is None else (a4_scales.fc1_encode_scale, a4_scales.fc2_encode_scales)
    )
    return op(
        hidden_states,
        topk_weights,
        topk_ids,
        *experts.tensors(),
        layer_name,
        a4_fc1_encode_scale=fc1,
        a4_fc2_encode_scales=fc2,
        swiglu_limit=swiglu_limit,
        prefill_precision=prefill_precision,
    )
