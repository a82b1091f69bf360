"""The ``b12x`` backend: b12x 1.5.1's fused NVFP4 MoE on SM120/SM121 GPUs (RTX PRO 6000, DGX Spark).

PyPI's b12x 1.5.1 or the copy FlashInfer 0.7.2+ embeds (:mod:`.b12x_source`; same API).

Selected only where ``b12x.moe.fused_moe.is_supported()`` is True (b12x imported lazily).
Registration (in ``backends/__init__.py``): ``register_backend("b12x", B12xBackend, priority=20)``.

Per layer (cached on the identity and version of the six expert tensors and the two A4 scale
tensors it is called with), once, before any CUDA-graph capture (vLLM's profile run does it):
the tensors are translated into one b12x copy (:mod:`.b12x_weights`; the caller's tensors are
never modified), weight plans are prepared and execution plans are compiled for a token
capacity ``max_tokens`` (``A4PREFILL_B12X_MAX_TOKENS``, default 8192: longer spans run as several
calls), and the scratch is sized.
At run time each contiguous span of rows is one ``bind`` + ``run`` that reads and writes views of
the caller's tensors and a pre-allocated scratch: nothing is allocated but the op's output.

Precision contract with b12x 1.5.1
----------------------------------
b12x 1.5.1 has no per-row or per-call precision flag. Its only mixed mode is
``ActivationSpec(mode=A4, a16_max_tokens=C)``: one prepared weight set (``nvfp4`` + native
``w4a16`` recipes over the same source-native storage) where *calls* of at most ``C`` rows run
W4A16 and larger calls run A4 (``_FusedMoeCapacityState.bind``). Used alone that is the old
size rule, not the row rule: a prefill span of at most ``C`` rows (a short prompt, the tail
chunk of a chunked prefill, a prefill that shares a small step with decodes) would run W4A16,
and a decode-only call of more than ``C`` rows would run A4.

So this backend prepares two plans over one weight copy (:mod:`.b12x_plans`):

- ``w4a16`` = ``mode=A4, a16_max_tokens=max_tokens``: every call fits the capacity, so every
  call runs W4A16 and no A4 kernel is compiled for it;
- ``a4`` = ``mode=A4`` without cutoff: every call runs A4 (only for calibrated layers);

and runs decode and padding rows through the first, prefill rows through the second, as
separate calls. That is the row rule exactly, whatever the span sizes. Cost: both plans keep
b12x's ``KEEP_SOURCE`` storage, so the weights are held once (our translated copy: w13 in
b12x's up-first order, w2, 128x4-swizzled block scales padded to 128 rows x 4 scale columns)
plus per-plan alphas ([E] fp32), compiled kernels and one scratch buffer per device and stream,
shared by all layers (calls on one stream run one after the other). The alternative, a pure
``mode=A16`` plan beside the A4 one, needs b12x's packed A16 layout, which b12x repacks in
place: a second copy of every weight (2x memory). That is what fp16 activations get, because
b12x's token cutoff accepts only bf16.

Remaining differences from the reference contract (docs/numerics.md, section 7): b12x's A4 path
quantizes with its own (approximate-reciprocal) quantizer and may fuse the top-k sum
differently, so results match the reference within a tolerance, not bit-exactly.

If a later b12x ``bind`` takes a per-call A4 flag (one of ``b12x_plans.PER_CALL_A4_PARAMETERS``,
found with ``inspect.signature``), the layer prepares the one mixed plan
(``a16_max_tokens = max_tokens``) and passes the flag: True for prefill calls, False otherwise.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from a4prefill.ops.backends import b12x_plans
from a4prefill.ops.backends.b12x_plans import B12xGeometry
from a4prefill.ops.backends.b12x_source import b12x_source
from a4prefill.ops.backends.b12x_weights import B12xTensors, translate_weights
from a4prefill.ops.backends.base import MoEBackend
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.precision import A4, W4A16, MoECall, RowPlan
from a4prefill.ops.rows import Span
from a4prefill.ops.scales import A4Scales

logger = logging.getLogger(__name__)

MAX_TOKENS_ENV = "A4PREFILL_B12X_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 8192


def b12x_unsupported_reason(device: torch.device) -> str | None:
    """Why b12x's fused MoE cannot run on ``device``, or None (imports b12x lazily)."""
    if device.type != "cuda":
        return f"b12x runs on SM120/SM121 CUDA GPUs only, not on {device.type}"
    try:
        from b12x.moe import fused_moe
    except ImportError as error:
        return (
            f"b12x is not importable ({error}); install b12x==1.5.1, or flashinfer-python>=0.7.2, "
            "which embeds b12x"
        )
    if not fused_moe.is_supported(device):
        return f"b12x.moe.fused_moe.is_supported() is False on {device} (b12x kernels need SM120/SM121)"
    return None


def _layer_tensors(experts: NvFp4Experts, a4_scales: A4Scales | None) -> tuple[torch.Tensor, ...]:
    scales = () if a4_scales is None else (a4_scales.fc1_encode_scale, a4_scales.fc2_encode_scales)
    return (*experts.tensors(), *scales)


@dataclass(frozen=True)
class _TensorsSeen:
    """The tensors a layer was prepared from: weak references and their versions at the time.

    Matches only the very same tensor objects, unmodified since (a freed tensor whose address is
    reused never matches). Weight processing bumps the versions after an in-place reload.
    """

    refs: tuple[weakref.ref, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, tensors: tuple[torch.Tensor, ...]) -> _TensorsSeen:
        return cls(tuple(weakref.ref(t) for t in tensors), tuple(t._version for t in tensors))

    def matches(self, tensors: tuple[torch.Tensor, ...]) -> bool:
        return len(tensors) == len(self.refs) and all(
            ref() is t and t._version == version
            for ref, t, version in zip(self.refs, tensors, self.versions, strict=True)
        )


@dataclass(frozen=True)
class PreparedPlan:
    """One precision's prepared experts and execution declaration; ``a16_max_tokens`` is its
    weight plan's ``ActivationSpec.a16_max_tokens`` (calls of at most that many rows run W4A16;
    0: none do)."""

    precision: str
    experts: Any
    declaration: Any
    tensors: B12xTensors
    a16_max_tokens: int


@dataclass(frozen=True)
class PreparedLayer:
    """Everything one layer needs at run time; ``a4`` is None for an uncalibrated layer.

    Invariant (checked here): every call the backend makes on the ``w4a16`` plan has at most
    :attr:`call_tokens` rows, and for bf16 (b12x's mixed plan) that is exactly the plan's
    ``a16_max_tokens``: a longer call would run A4. For fp16 the plan is pure A16 (cutoff 0)."""

    seen: _TensorsSeen
    geometry: B12xGeometry
    io_dtype: torch.dtype
    w4a16: PreparedPlan
    a4: PreparedPlan | None
    per_call_flag: str | None
    scratch_nbytes: int

    def __post_init__(self) -> None:
        mixed = self.io_dtype == torch.bfloat16
        cutoff = self.w4a16.a16_max_tokens
        if (mixed and cutoff != self.call_tokens) or (not mixed and cutoff != 0):
            raise ValueError(
                f"b12x W4A16 plan: a16_max_tokens={cutoff} but the backend cuts calls at "
                f"{self.call_tokens} rows ({self.io_dtype}): calls above the cutoff would run A4"
            )

    @property
    def call_tokens(self) -> int:
        """The most rows of one ``bind`` + ``run`` (the declarations' capacity)."""
        return self.geometry.max_tokens

    def launches(self, plan: RowPlan) -> Iterator[tuple[PreparedPlan, bool, Span]]:
        """``(prepared plan, prefill, rows)`` of every b12x call of one op call under ``plan``:
        W4A16 spans on the W4A16 plan, A4 (prefill) spans on the A4 plan, each cut at
        :attr:`call_tokens` rows."""
        for rows in _chunks(plan.spans(W4A16), self.call_tokens):
            yield self.w4a16, False, rows
        if self.a4 is not None:
            for rows in _chunks(plan.spans(A4), self.call_tokens):
                yield self.a4, True, rows

    def weight_nbytes(self) -> int:
        """Bytes of b12x-side weight copies (one, or two for fp16)."""
        plans = [self.w4a16] + ([self.a4] if self.a4 is not None else [])
        unique = {id(plan.tensors): plan.tensors for plan in plans}
        return sum(tensors.nbytes() for tensors in unique.values())


def _stream_id(device: torch.device) -> int:
    """The current stream of ``device`` (0 off CUDA)."""
    return int(torch.cuda.current_stream(device).stream_id) if device.type == "cuda" else 0


def _chunks(spans: tuple[Span, ...], max_tokens: int) -> Iterator[Span]:
    for start, end in spans:
        for chunk_start in range(start, end, max_tokens):
            yield chunk_start, min(end, chunk_start + max_tokens)


class B12xBackend(MoEBackend):
    """b12x's fused MoE; decode/padding rows W4A16 and prefill rows A4 as separate calls."""

    name = "b12x"

    def __init__(self, max_tokens: int | None = None) -> None:
        """``max_tokens``: the rows one b12x call takes (longer spans run as several calls); None
        reads ``A4PREFILL_B12X_MAX_TOKENS`` (default 8192). Raises ``ValueError`` naming the
        argument or the variable if it is not a positive integer."""
        source = "max_tokens"
        if max_tokens is None:
            source = MAX_TOKENS_ENV
            text = os.environ.get(MAX_TOKENS_ENV, str(DEFAULT_MAX_TOKENS))
            try:
                max_tokens = int(text)
            except ValueError:
                raise ValueError(f"{MAX_TOKENS_ENV} must be a positive integer, got {text!r}") from None
        if max_tokens < 1:
            raise ValueError(f"{source} must be a positive integer, got {max_tokens}")
        self.max_tokens = max_tokens
        self._layers: dict[tuple, PreparedLayer] = {}
        self._scratch: dict[tuple[str, int], torch.Tensor] = {}
        self._lock = threading.Lock()
        self._logged: set[str] = set()

    def unsupported_reason(self, device: torch.device) -> str | None:
        reason = b12x_unsupported_reason(device)
        if reason is not None and str(device) not in self._logged:
            self._logged.add(str(device))
            logger.info("a4prefill: b12x backend not available on %s: %s", device, reason)
        return reason

    # -- preparation -------------------------------------------------------------------------

    def _slot(
        self, experts: NvFp4Experts, top_k: int, io_dtype: torch.dtype, swiglu_limit: float | None
    ) -> tuple:
        return (id(experts.w13_weight), str(experts.w13_weight.device), top_k, io_dtype, swiglu_limit)

    def prepare_layer(
        self,
        experts: NvFp4Experts,
        a4_scales: A4Scales | None,
        top_k: int,
        io_dtype: torch.dtype = torch.bfloat16,
        swiglu_limit: float | None = None,
    ) -> PreparedLayer:
        """Translate, prepare and compile one layer (cached; call before CUDA-graph capture).

        ``a4_scales`` is the layer's load-time verdict: None prepares the W4A16 plan only. Reads
        scales on the host and allocates: never call it while a stream is capturing.
        """
        slot = self._slot(experts, top_k, io_dtype, swiglu_limit)
        tensors = _layer_tensors(experts, a4_scales)
        with self._lock:
            layer = self._layers.get(slot)
            if layer is not None and layer.seen.matches(tensors):
                return layer
        if experts.w13_weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a4prefill b12x: a layer must be prepared before CUDA-graph capture: run it once "
                "eagerly (vLLM's profile run does) or call B12xBackend.prepare_layer first"
            )
        geometry = b12x_plans.check_geometry(experts.w13_weight, experts.w2_weight, top_k, self.max_tokens)
        translated = translate_weights(experts, a4_scales)
        flag = b12x_plans.per_call_a4_parameter()
        name = f"a4prefill.b12x.{experts.w13_weight.data_ptr():x}"
        w4a16 = self._prepare_plan(W4A16, geometry, io_dtype, swiglu_limit, translated, name)
        a4 = None
        if a4_scales is not None and flag is None:
            a4 = self._prepare_plan(A4, geometry, io_dtype, swiglu_limit, translated, name)
        elif a4_scales is not None:
            a4 = w4a16
        scratch = max(b12x_plans.scratch_nbytes(p.declaration) for p in (w4a16, a4) if p is not None)
        layer = PreparedLayer(_TensorsSeen.of(tensors), geometry, io_dtype, w4a16, a4, flag, scratch)
        self.scratch(experts.w13_weight.device, scratch)
        with self._lock:
            self._layers[slot] = layer
        logger.info(
            "a4prefill: b12x layer prepared with %s (E=%d H=%d I=%d, A4 plan %s, %.1f MiB of weights)",
            b12x_source().describe(),
            geometry.num_experts,
            geometry.hidden_size,
            geometry.intermediate_size,
            "prepared" if a4 is not None else "not prepared (no A4 scales)",
            layer.weight_nbytes() / 2**20,
        )
        return layer

    @staticmethod
    def _prepare_plan(
        precision: str,
        geometry: B12xGeometry,
        io_dtype: torch.dtype,
        swiglu_limit: float | None,
        tensors: B12xTensors,
        name: str,
    ) -> PreparedPlan:
        if not b12x_plans.shares_storage(precision, io_dtype):
            tensors = tensors.clone()
        weight_plan = b12x_plans.plan_weights(geometry, precision, io_dtype, swiglu_limit)
        experts = b12x_plans.prepare_weights(weight_plan, tensors)
        declaration = b12x_plans.plan_execution(experts, geometry)
        b12x_plans.prepare_execution(declaration, f"{name}.{precision}")
        return PreparedPlan(precision, experts, declaration, tensors, weight_plan.activation.a16_max_tokens)

    def scratch(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """The caller-owned scratch (uint8, at least ``nbytes``) of calls on ``device``'s current
        stream: one buffer per device and stream, so that calls on two streams (dual-batch
        overlap) never share one. Grown when too small. Under CUDA-graph capture a missing or too
        small buffer is allocated for that graph alone (from its pool) and not kept."""
        key = (str(device), _stream_id(device))
        with self._lock:
            scratch = self._scratch.get(key)
            if scratch is not None and scratch.numel() >= nbytes:
                return scratch
            scratch = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._scratch[key] = scratch
            return scratch

    # -- execution ---------------------------------------------------------------------------

    def _launch(
        self, layer: PreparedLayer, plan: PreparedPlan, prefill: bool, rows: Span, call: tuple
    ) -> None:
        from b12x.moe import fused_moe

        hidden_states, topk_weights, topk_ids, output = call
        start, end = rows
        kwargs: dict[str, Any] = {
            "scratch": self.scratch(hidden_states.device, layer.scratch_nbytes),
            "a": hidden_states[start:end],
            "experts": plan.experts,
            "topk_weights": topk_weights[start:end],
            "topk_ids": topk_ids[start:end],
            "output": output[start:end],
            "input_scales_static": True,
        }
        if layer.per_call_flag is not None:
            kwargs[layer.per_call_flag] = prefill
        binding = fused_moe.bind(plan.declaration, **kwargs)
        result = fused_moe.run(binding=binding)
        target = output[start:end]
        if isinstance(result, torch.Tensor) and result.data_ptr() != target.data_ptr():
            target.copy_(result)

    def run_into(self, output: torch.Tensor, call: MoECall, plan: RowPlan) -> torch.Tensor:
        """Write ``call`` under ``plan`` into the caller's ``output [T, H]``.

        W4A16 rows run the W4A16 plan, A4 rows the A4 plan, each span (cut at ``max_tokens``) as
        one bind + run on views; no allocation once the layer is prepared. No A8 plan: a plan
        with A8 rows raises (:meth:`~MoEBackend.check_plan`).
        """
        self.check_plan(call, plan)
        hidden_states, top_k = call.hidden_states, call.topk_ids.shape[1]
        layer = self.prepare_layer(
            call.experts, call.a4_scales, top_k, hidden_states.dtype, call.swiglu_limit
        )
        views = (hidden_states, call.topk_weights, call.topk_ids, output)
        for prepared, prefill, rows in layer.launches(plan):
            self._launch(layer, prepared, prefill, rows, views)
        return output

    def run(self, call: MoECall, plan: RowPlan) -> torch.Tensor:
        output = torch.empty_like(call.hidden_states)
        if call.num_rows == 0:
            return output
        return self.run_into(output, call, plan)

    def run_uniform(self, call: MoECall, precision: str) -> torch.Tensor:
        return self.run(call, RowPlan.uniform(precision, call.num_rows))
