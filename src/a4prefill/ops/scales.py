"""Activation encode scales of the A4 path (FACTS.md section 3) and their per-layer cache.

- FC1: one shared encode scale ``gs1 = 1 / max_e(w13_input_scale[e])`` (fp32 [1]);
- FC2: per-expert encode scales ``gs2[e] = 1 / w2_input_scale[e]`` (fp32 [E]).

A layer whose input scales are not all finite and > 0 has no valid calibration: it never
runs A4. Deriving reads the scales on the host, so it happens once per layer (and again only
when the scale tensors are replaced or modified in place), never once per step.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class A4Scales:
    """Prepared encode scales of one layer, on the layer's device.

    ``fc1_encode_scale``: fp32 [1]; ``fc2_encode_scales``: fp32 [E].
    """

    fc1_encode_scale: torch.Tensor
    fc2_encode_scales: torch.Tensor


def invalid_scales_reason(w13_input_scale: torch.Tensor, w2_input_scale: torch.Tensor) -> str | None:
    """Why these input scales are not a valid calibration, or ``None`` if they are (host read)."""
    for name, scale in (("w13_input_scale", w13_input_scale), ("w2_input_scale", w2_input_scale)):
        values = scale.detach().to("cpu", torch.float32)
        if values.numel() == 0:
            return f"{name} is empty"
        if not bool(torch.isfinite(values).all()):
            return f"{name} has non-finite values"
        smallest = float(values.min())
        if smallest <= 0.0:
            kind = "zero (not calibrated)" if smallest == 0.0 else "negative"
            return f"{name} has {kind} entries"
    return None


def derive_a4_scales(w13_input_scale: torch.Tensor, w2_input_scale: torch.Tensor) -> A4Scales:
    """Encode scales for the A4 path; raise ``ValueError`` if the calibration is invalid.

    ``w13_input_scale`` fp32 [E, 2] or [E]; ``w2_input_scale`` fp32 [E]. Host read: call once per
    layer at preparation time.
    """
    reason = invalid_scales_reason(w13_input_scale, w2_input_scale)
    if reason is not None:
        raise ValueError(f"activation scales are not a valid calibration: {reason}")
    fc1 = 1.0 / w13_input_scale.detach().to(torch.float32).amax().reshape(1)
    fc2 = 1.0 / w2_input_scale.detach().to(torch.float32).reshape(-1)
    if not math.isfinite(float(fc1)):
        raise ValueError("w13_input_scale is too small: its encode scale overflows fp32")
    return A4Scales(fc1, fc2)


class LayerScaleCache:
    """Per-layer cache of :func:`derive_a4_scales`, keyed on the scale tensors' storage/version.

    ``lookup`` returns the layer's ``A4Scales`` or ``None`` (no valid calibration: W4A16 only);
    it logs one warning per layer name the first time a layer is found uncalibrated.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple[object, ...], A4Scales | None, str | None]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(w13_input_scale: torch.Tensor, w2_input_scale: torch.Tensor) -> tuple[object, ...]:
        return tuple(
            (t.data_ptr(), t._version, t.device, tuple(t.shape)) for t in (w13_input_scale, w2_input_scale)
        )

    def lookup(
        self, layer_name: str, w13_input_scale: torch.Tensor, w2_input_scale: torch.Tensor
    ) -> A4Scales | None:
        key = self._key(w13_input_scale, w2_input_scale)
        with self._lock:
            entry = self._entries.get(layer_name)
            if entry is not None and entry[0] == key:
                return entry[1]
            reason = invalid_scales_reason(w13_input_scale, w2_input_scale)
            scales = None if reason else derive_a4_scales(w13_input_scale, w2_input_scale)
            already_warned = entry is not None and entry[2] == reason
            self._entries[layer_name] = (key, scales, reason)
        if reason and not already_warned:
            logger.warning("a4prefill: layer %r runs W4A16 for every row: %s", layer_name, reason)
        return scales

    def uncalibrated_layers(self) -> dict[str, str]:
        """Layer name -> reason, for every layer seen without a valid calibration."""
        with self._lock:
            return {name: entry[2] for name, entry in self._entries.items() if entry[2]}


LAYER_SCALES = LayerScaleCache()
