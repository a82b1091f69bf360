"""b12x 1.5.1 weight and execution plans for one MoE layer (lazy b12x imports).

Precision plans (see :mod:`a4prefill.ops.backends.b12x_moe` for the contract and its limits):

- ``w4a16``: for bf16 activations ``ActivationSpec(mode=A4, a16_max_tokens=max_tokens)``. b12x
  then keeps the ModelOpt tensors source-native and prepares its native W4A16 representation
  over the *same* storage; since every call is at most ``max_tokens`` rows, every call runs
  W4A16 and no A4 variant is ever compiled. For fp16 (b12x's token cutoff is bf16-only) it is
  ``mode=A16``, whose packed layout is repacked *in place*, so it gets its own copy of the tensors.
- ``a4``: ``ActivationSpec(mode=A4)`` with no cutoff over the same storage: every call runs A4.

Weight planning runs anywhere. Preparing an A4-only plan and planning its execution also run on
a CPU; preparing the W4A16 plans and materializing execution plans need an SM120/SM121 GPU.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from a4prefill.ops.backends.b12x_weights import B12xTensors, to_packed_weights
from a4prefill.ops.nvfp4 import BLOCK_SIZE
from a4prefill.ops.precision import A4, W4A16

PER_CALL_A4_PARAMETERS = ("a4_prefill",)
"""Names a b12x ``bind`` may take to choose A4 per call (not in 1.5.1; feature-detected)."""


@dataclass(frozen=True)
class B12xGeometry:
    """Sizes b12x plans for: experts E, hidden H, intermediate I, top-k, token capacity."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    max_tokens: int


def check_geometry(
    w13_weight: torch.Tensor, w2_weight: torch.Tensor, top_k: int, max_tokens: int
) -> B12xGeometry:
    """Validate the layer's weight shapes and the call capacity; raise naming the argument.

    ``w13_weight`` uint8 [E, 2I, H/2], ``w2_weight`` uint8 [E, H, I/2]; H and I multiples of 16;
    ``1 <= top_k <= E``; ``max_tokens >= 1``.
    """
    if w13_weight.ndim != 3 or w13_weight.dtype != torch.uint8:
        raise ValueError(
            f"w13_weight must be uint8 [E, 2I, H/2], got {w13_weight.dtype} {list(w13_weight.shape)}"
        )
    experts, two_i, hidden_half = w13_weight.shape
    hidden, intermediate = 2 * hidden_half, two_i // 2
    if experts < 1:
        raise ValueError(f"w13_weight: number of experts E must be >= 1, got {experts}")
    if two_i % 2 or intermediate % BLOCK_SIZE or intermediate == 0:
        raise ValueError(
            f"w13_weight: 2I={two_i} rows; the intermediate size I must be a positive multiple "
            f"of {BLOCK_SIZE}"
        )
    if hidden % BLOCK_SIZE or hidden == 0:
        raise ValueError(f"w13_weight: hidden size H={hidden} must be a positive multiple of {BLOCK_SIZE}")
    if tuple(w2_weight.shape) != (experts, hidden, intermediate // 2) or w2_weight.dtype != torch.uint8:
        raise ValueError(
            f"w2_weight must be uint8 [E, H, I/2] = {[experts, hidden, intermediate // 2]}, "
            f"got {w2_weight.dtype} {list(w2_weight.shape)}"
        )
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, E={experts}], got {top_k}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return B12xGeometry(experts, hidden, intermediate, top_k, max_tokens)


def per_call_a4_parameter() -> str | None:
    """The name of a per-call A4 flag of b12x's ``bind`` if this b12x has one, else None."""
    from b12x.moe import fused_moe
    from b12x.moe.fused_moe import _impl

    for function in (fused_moe.bind, _impl.TPMoEScratchPlan.bind):
        parameters = inspect.signature(function).parameters
        for name in PER_CALL_A4_PARAMETERS:
            if name in parameters:
                return name
    return None


def activation_spec(
    precision: str, io_dtype: torch.dtype, swiglu_limit: float | None, max_tokens: int
) -> Any:
    """b12x's ``ActivationSpec`` of the ``w4a16`` or ``a4`` plan (see the module docstring)."""
    from b12x.moe.fused_moe import ActivationMode, ActivationSpec

    if precision == A4:
        mode, cutoff = ActivationMode.A4, 0
    elif precision == W4A16 and io_dtype == torch.bfloat16:
        mode, cutoff = ActivationMode.A4, max_tokens
    elif precision == W4A16:
        mode, cutoff = ActivationMode.A16, 0
    else:
        raise ValueError(f"precision must be {W4A16!r} or {A4!r}, got {precision!r}")
    return ActivationSpec(
        mode=mode, nonlinearity="silu", io_dtype=io_dtype, swiglu_limit=swiglu_limit, a16_max_tokens=cutoff
    )


def shares_storage(precision: str, io_dtype: torch.dtype) -> bool:
    """Whether the plan reads the layer's one translated copy (False: it repacks its own copy)."""
    return precision == A4 or io_dtype == torch.bfloat16


def plan_weights(
    geometry: B12xGeometry, precision: str, io_dtype: torch.dtype, swiglu_limit: float | None
) -> Any:
    """b12x's ``WeightPlan`` for ModelOpt NVFP4 weights in up-first (``W13``) order."""
    from b12x.moe import fused_moe

    return fused_moe.plan_weights(
        source=fused_moe.PackedSource(
            format=fused_moe.PackedSourceFormat.MODELOPT_NVFP4, w13_layout=fused_moe.W13Layout.W13
        ),
        activation=activation_spec(precision, io_dtype, swiglu_limit, geometry.max_tokens),
        geometry=fused_moe.MoEGeometry(
            num_experts=geometry.num_experts,
            hidden_size=geometry.hidden_size,
            intermediate_size=geometry.intermediate_size,
        ),
    )


def prepare_weights(weight_plan: Any, tensors: B12xTensors) -> Any:
    """b12x's ``PreparedExperts`` over ``tensors`` (storage is kept, or repacked for fp16 A16)."""
    from b12x.moe import fused_moe

    return fused_moe.prepare_weights(plan=weight_plan, weights=to_packed_weights(tensors))


def plan_execution(experts: Any, geometry: B12xGeometry) -> Any:
    """b12x's execution declaration for calls of up to ``geometry.max_tokens`` rows."""
    from b12x.moe import fused_moe

    capacity = fused_moe.ExecutionCapacity(max_tokens=geometry.max_tokens, top_k=geometry.top_k)
    return fused_moe.plan_execution(experts=experts, capacity=capacity)


def prepare_execution(declaration: Any, name: str) -> None:
    """Compile and materialize ``declaration`` with its default configuration (GPU; not under
    CUDA-graph capture). Binding an unprepared declaration would do the same lazily, with a warning."""
    from b12x.preparation import PreparedCall, prepare_default

    def noop(state: object) -> PreparedCall:
        return PreparedCall(run=lambda: None)

    if hasattr(declaration, "token_counts"):
        request = declaration.request(name=name, prepare_calls=dict.fromkeys(declaration.token_counts, noop))
    else:
        request = declaration.request(name=name, prepare_call=noop)
    prepare_default(request)


def scratch_nbytes(declaration: Any) -> int:
    """Bytes of caller-owned scratch one call of ``declaration`` needs (after preparation)."""
    return int(declaration.memory_requirements().scratch_nbytes)
