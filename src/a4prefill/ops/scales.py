"""A4 activation encode scales: derived once, at load time, handed on as data (docs/numerics.md, 4-5).

- FC1: one shared encode scale ``gs1 = 1 / max_e(w13_input_scale[e])`` (fp32 [1]);
- FC2: per-expert encode scales ``gs2[e] = 1 / w2_input_scale[e]`` (fp32 [E]).

This module is one of the three places that decide precision: *whether a layer has A4 scales*.
A layer has them only when every input scale is finite and > 0 and every encode scale derived from
them is finite (a tiny positive ``w2_input_scale`` would give an infinite ``gs2`` and silently zero
that expert's A4 output) and within :data:`ENCODE_SCALE_LIMIT`. Anything else is "no
calibration": the layer carries no :class:`A4Scales` and every op runs it W4A16.

Who may call: weight processing (the vLLM MoE method's ``process_weights_after_loading``), plain
torch users preparing a layer, tests. Reads the scales on the host: never call it per step.
Nothing here caches; re-running it after a weight reload re-derives the scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

A4_READY = "A4 scales"
"""The status reports give a layer that has A4 scales (otherwise: the reason it has none)."""

FC1_EXPERT_SPREAD = 448 * 64
"""The largest ratio ``max_e / min_e`` of a layer's FC1 input scales that keeps A4 (docs/numerics.md,
section 5). All experts share the FC1 encode scale ``1 / max_e(w13_input_scale[e])``: a block at
expert e's calibrated amax then gets the e4m3 block scale ``448 * s_e / max(s)``, which stays a
normal e4m3 value (>= 2**-6) only while the ratio is at most ``448 * 2**6``. Beyond that, that
expert's typical blocks get subnormal or zero block scales: its A4 rows flush to zero."""


ENCODE_SCALE_LIMIT = 2.0**100
"""Every A4 encode scale (``gs1``, each ``gs2[e]``) must lie within ``[1 / ENCODE_SCALE_LIMIT,
ENCODE_SCALE_LIMIT]`` (docs/numerics.md, section 5). The kernels quantize a block with the
multiplier ``gs / block_scale`` and the reciprocal ``1 / gs`` in fp32 (``numerics._quantize_groups``);
with a block scale down to e4m3's ``2**-9`` the multiplier overflows from ``gs`` near ``2**119``,
and ``1 / gs`` from ``gs`` below ``2**-126``: then ``0 * inf`` gives NaN and the block's values
are not the reference's. ``2**100`` keeps both far inside fp32 (input scales of ``2**-100`` to
``2**100``; calibrated ones are of order ``amax / 2688``)."""


FC1_INPUT_SCALE_MAX = 2.0**9 / 6
"""The largest FC1 input scale (``w13_input_scale``, any expert) that keeps A4 (docs/numerics.md,
section 5). The MoE's inputs are RMS-normalized hidden states, whose 16-value blocks have an amax
of order 1 or more. Under the shared encode scale ``1 / max(s)`` a block of amax 1 gets the e4m3
block scale ``1 / (6 * max(s))``, which is at least the smallest e4m3 value, ``2**-9``, only while
``max(s) <= 2**9 / 6`` (a calibrated amax of at most ``448 * 2**9`` = 229376). Beyond ``2**10 / 6``
it rounds to zero and such blocks flush to zero. A larger scale is not a calibration of such
inputs."""


@dataclass(frozen=True)
class A4Scales:
    """A layer's A4 encode scales, on the layer's device.

    ``fc1_encode_scale``: fp32 [1], shared by all experts; ``fc2_encode_scales``: fp32 [E].
    Passed to the ops as ``a4_fc1_encode_scale`` / ``a4_fc2_encode_scales``; absent = W4A16 only.
    """

    fc1_encode_scale: torch.Tensor
    fc2_encode_scales: torch.Tensor

    def to(self, device: torch.device | str) -> A4Scales:
        """A copy on ``device``."""
        return A4Scales(self.fc1_encode_scale.to(device), self.fc2_encode_scales.to(device))


@dataclass(frozen=True)
class A4Calibration:
    """The load-time verdict on a layer's activation scales: ``scales`` or the ``reason`` why not."""

    scales: A4Scales | None
    reason: str | None

    def __post_init__(self) -> None:
        if (self.scales is None) == (self.reason is None):
            raise ValueError("A4Calibration holds either scales or a reason, not both or neither")


def _invalid_input_scale(name: str, values: torch.Tensor) -> str | None:
    if values.numel() == 0:
        return f"{name} is empty"
    if not bool(torch.isfinite(values).all()):
        return f"{name} has non-finite entries"
    smallest = float(values.min())
    if smallest == 0.0:
        return f"{name} has zero entries (not calibrated)"
    if smallest < 0.0:
        return f"{name} has negative entries"
    return None


def a4_calibration(w13_input_scale: torch.Tensor, w2_input_scale: torch.Tensor) -> A4Calibration:
    """Derive a layer's :class:`A4Scales` from ModelOpt input scales, or say why it has none.

    ``w13_input_scale`` float [E, 2] or [E]; ``w2_input_scale`` float [E] (decode-side ModelOpt
    scales, ``amax / (6 * 448)``). The scales come back fp32 on the inputs' device. One host read.
    """
    for name, scale in (("w13_input_scale", w13_input_scale), ("w2_input_scale", w2_input_scale)):
        if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {scale!r:.80}")
    num_experts = w13_input_scale.shape[0] if w13_input_scale.ndim else 0
    fc1_columns_ok = w13_input_scale.ndim == 1 or (
        w13_input_scale.ndim == 2 and w13_input_scale.shape[1] == 2
    )
    if not fc1_columns_ok or w2_input_scale.shape != (num_experts,):
        raise ValueError(
            f"w13_input_scale must be [E, 2] or [E] and w2_input_scale [E]; got "
            f"{list(w13_input_scale.shape)} and {list(w2_input_scale.shape)}"
        )
    fc1_input = w13_input_scale.detach().to(torch.float32)
    fc2_input = w2_input_scale.detach().to(torch.float32)
    for name, values in (("w13_input_scale", fc1_input), ("w2_input_scale", fc2_input)):
        reason = _invalid_input_scale(name, values.cpu())
        if reason is not None:
            return A4Calibration(None, reason)
    spread = float(fc1_input.amax() / fc1_input.amin())
    if spread > FC1_EXPERT_SPREAD:
        return A4Calibration(
            None,
            f"w13_input_scale spans a factor {spread:.3g} (max/min) over the experts, more than "
            f"{FC1_EXPERT_SPREAD}: under the shared FC1 encode scale the smallest expert's activations "
            "would flush to zero",
        )
    largest = float(fc1_input.amax())
    if largest > FC1_INPUT_SCALE_MAX:
        return A4Calibration(
            None,
            f"w13_input_scale reaches {largest:.3g}, more than {FC1_INPUT_SCALE_MAX:.4g}: the FC1 encode "
            "scale would flush input blocks of amax 1 (RMS-normalized hidden states) to zero",
        )
    fc1 = (1.0 / fc1_input.amax()).reshape(1)
    fc2 = 1.0 / fc2_input.reshape(-1)
    if not math.isfinite(float(fc1)):
        return A4Calibration(None, "w13_input_scale is so small that its FC1 encode scale is not finite")
    finite = torch.isfinite(fc2.cpu())
    if not bool(finite.all()):
        expert = int((~finite).nonzero()[0])
        return A4Calibration(
            None,
            f"w2_input_scale[{expert}]={float(fc2_input[expert]):.3g} is so small that its FC2 encode "
            "scale is not finite",
        )
    bounds = "outside 2**-100 to 2**100, where the kernels' per-block multipliers overflow"
    if not 1.0 / ENCODE_SCALE_LIMIT <= float(fc1) <= ENCODE_SCALE_LIMIT:
        return A4Calibration(None, f"w13_input_scale gives the FC1 encode scale {float(fc1):.3g}, {bounds}")
    outside = ((fc2 < 1.0 / ENCODE_SCALE_LIMIT) | (fc2 > ENCODE_SCALE_LIMIT)).cpu()
    if bool(outside.any()):
        expert = int(outside.nonzero()[0])
        return A4Calibration(
            None,
            f"w2_input_scale[{expert}]={float(fc2_input[expert]):.3g} gives the FC2 encode scale "
            f"{float(fc2[expert]):.3g}, {bounds}",
        )
    return A4Calibration(A4Scales(fc1.contiguous(), fc2.contiguous()), None)


def derive_a4_scales(w13_input_scale: torch.Tensor, w2_input_scale: torch.Tensor) -> A4Scales:
    """:func:`a4_calibration` for plain torch users: the scales, or ``ValueError`` with the reason."""
    calibration = a4_calibration(w13_input_scale, w2_input_scale)
    if calibration.scales is None:
        raise ValueError(f"activation scales are not a valid A4 calibration: {calibration.reason}")
    return calibration.scales
