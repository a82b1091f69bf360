"""The plugin's effective settings: ``additional_config["a4prefill"]`` plus the legacy switch.

- ``--additional-config '{"a4prefill": {...}}'`` is validated with
  :meth:`a4prefill.settings.A4PrefillSettings.from_mapping` (``ValueError`` naming the key).
- ``B12X_W4A16_A4_PREFILL_MIN_TOKENS`` (deprecated) still works as an on/off switch: set to an
  integer >= 0 it enables A4 prefill, anything else disables it; one deprecation warning. Its
  threshold value is ignored (precision is decided per row, never by call size). An explicit
  ``enabled`` in ``additional_config`` wins over it.

Who may call: the quantization config / MoE method at model construction (a vLLM config is
current there), the row provider setup, tests.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from a4prefill.ops.rows import LEGACY_THRESHOLD_ENV, legacy_threshold
from a4prefill.settings import SETTINGS_KEY, A4PrefillSettings, settings_from_vllm_config

logger = logging.getLogger(__name__)
_warned_legacy = False


def effective_settings(vllm_config: Any | None) -> A4PrefillSettings:
    """Validated settings of ``vllm_config`` (defaults when None) with the legacy switch applied."""
    global _warned_legacy
    settings = settings_from_vllm_config(vllm_config) if vllm_config is not None else A4PrefillSettings()
    legacy = legacy_threshold()
    if legacy.enabled is None:
        return settings
    if not _warned_legacy:
        _warned_legacy = True
        logger.warning(
            "a4prefill: %s is deprecated; it now only switches A4 prefill %s (its token threshold "
            "is ignored: prefill rows run A4 whatever the step size). Use --additional-config "
            '\'{"%s": {"enabled": true|false}}\' instead.',
            LEGACY_THRESHOLD_ENV,
            "on" if legacy.enabled else "off",
            SETTINGS_KEY,
        )
    raw = (getattr(vllm_config, "additional_config", None) or {}).get(SETTINGS_KEY) or {}
    if "enabled" in raw:
        return settings
    return dataclasses.replace(settings, enabled=legacy.enabled)


def max_decode_len(vllm_config: Any | None) -> int:
    """1 + the engine's number of speculative tokens (1 without speculative decoding)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    tokens = getattr(speculative, "num_speculative_tokens", None) if speculative is not None else None
    return 1 + int(tokens or 0)
