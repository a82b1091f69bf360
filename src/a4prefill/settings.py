"""The package's user settings and their one resolution (``--additional-config '{"a4prefill": {...}}'``
under vLLM, the :class:`~a4prefill.SplitPrefillPass` constructor with plain torch.compile).

Keys (all optional):

- ``enabled`` (bool): false keeps every layer W4A16 (the pass rewrites nothing, layers get no A4
  scales). Not given: the legacy variable decides if it is set, else true;
- ``captured_limit`` (int >= 0 or null): the largest token count that may run inside a captured
  CUDA graph; graphs (MoE nodes) whose whole token range is within it keep W4A16. null: the
  engine's, from the CUDA-graph modes it actually captures (under vLLM), else 0;
- ``excluded_layers`` (list of regular expressions, default []): layers whose name matches one
  (``re.search``) never run A4, e.g. ``["mtp"]`` for speculative draft layers;
- ``count_rows`` (bool, default false): count each layer's W4A16 and A4 rows and the calls of each
  kernel family on its device, inside the op, so that replays of captured CUDA graphs count too
  (:data:`a4prefill.ops.DEVICE_ROW_COUNTERS`); costs up to three tiny kernels per MoE call.
  Evidence only: it changes no precision.
- ``row_log`` (path or null, default null): the audit log of precision. Every engine process
  appends one JSON line per forward pass to ``<row_log>.rank<R>`` (its global rank ``R``): the
  rows each MoE layer ran W4A16 and A4 (device counters under ``count_rows``, else host counters),
  the step's row types and CUDA-graph mode, and the layers' load-time status whenever it changes.
  ``python -m a4prefill audit`` checks the rule on it. Off: nothing is installed. Evidence only.
- ``prefill_precision`` (``"a4"`` or ``"a8"``, default ``"a4"``): what prefill rows run where
  they may run something other than W4A16. ``"a4"``: NVFP4 activations with the layer's
  calibrated encode scales (today's behaviour); ``"a8"``: FP8 e4m3 activations with one scale per
  row (docs/numerics.md, section 8), for GPUs with FP8 tensor cores (CUDA capability
  >= 8.9). Decode, verify, padding and captured rows run W4A16 either way. The ``reference``
  backend runs ``"a8"`` anywhere (numerics, not speed), the triton backend on sm_90 GPUs (its A8
  prefill kernel, FP8 wgmma; elsewhere it refuses at load time), the b12x backend refuses it.

The legacy variable ``B12X_W4A16_A4_PREFILL_MIN_TOKENS`` (deprecated) is an on/off switch: a
valid integer >= 0 means on (one deprecation warning; its threshold is ignored: precision is
decided per row, never by call size), set but empty or malformed means off (one warning), unset
means no opinion. An explicit ``enabled`` wins over it.

:func:`resolve_settings` is the only place these rules live; the pass and the vLLM plugin both
call it. Invalid settings raise ``ValueError`` naming the key. Nothing here imports vLLM.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from a4prefill.ops.precision import A4, check_prefill_precision
from a4prefill.process_state import warn_once

logger = logging.getLogger(__name__)

SETTINGS_KEY = "a4prefill"
LEGACY_THRESHOLD_ENV = "B12X_W4A16_A4_PREFILL_MIN_TOKENS"
_KNOWN_KEYS = ("enabled", "captured_limit", "excluded_layers", "count_rows", "row_log", "prefill_precision")


def _json_form(settings: A4PrefillSettings | ResolvedSettings) -> dict[str, Any]:
    return {**asdict(settings), "excluded_layers": list(settings.excluded_layers)}


def _check_prefill_precision(value: object) -> None:
    check_prefill_precision(value, f"{SETTINGS_KEY}.prefill_precision")


@dataclass(frozen=True)
class A4PrefillSettings:
    """Settings as the user gave them (None: not given); see the module docstring."""

    enabled: bool | None = None
    captured_limit: int | None = None
    excluded_layers: tuple[str, ...] = field(default_factory=tuple)
    count_rows: bool = False
    row_log: str | None = None
    prefill_precision: str = A4

    def __post_init__(self) -> None:
        _check_prefill_precision(self.prefill_precision)
        if self.row_log is not None and (not isinstance(self.row_log, str) or not self.row_log):
            raise ValueError(f"{SETTINGS_KEY}.row_log must be a file path or null, got {self.row_log!r}")
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise ValueError(f"{SETTINGS_KEY}.enabled must be true or false, got {self.enabled!r}")
        if not isinstance(self.count_rows, bool):
            raise ValueError(f"{SETTINGS_KEY}.count_rows must be true or false, got {self.count_rows!r}")
        limit = self.captured_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"{SETTINGS_KEY}.captured_limit must be an integer >= 0 or null, got {limit!r}")
        patterns = self.excluded_layers
        if isinstance(patterns, str) or not isinstance(patterns, tuple | list):
            raise ValueError(
                f"{SETTINGS_KEY}.excluded_layers must be a list of regular expressions, got {patterns!r}"
            )
        for pattern in patterns:
            if not isinstance(pattern, str):
                raise ValueError(f"{SETTINGS_KEY}.excluded_layers: {pattern!r} is not a string")
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"{SETTINGS_KEY}.excluded_layers: {pattern!r} is not a regex: {error}"
                ) from None
        object.__setattr__(self, "excluded_layers", tuple(patterns))

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> A4PrefillSettings:
        """Build from a JSON-like mapping; unknown keys and wrong types raise ``ValueError``."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ValueError(f"{SETTINGS_KEY} settings must be a JSON object, got {raw!r}")
        unknown = sorted(set(raw) - set(_KNOWN_KEYS))
        if unknown:
            raise ValueError(f"unknown {SETTINGS_KEY} setting(s) {unknown}; known: {sorted(_KNOWN_KEYS)}")
        return cls(
            enabled=raw.get("enabled"),
            captured_limit=raw.get("captured_limit"),
            excluded_layers=raw.get("excluded_layers", ()),
            count_rows=raw.get("count_rows", False),
            row_log=raw.get("row_log"),
            prefill_precision=raw.get("prefill_precision", A4),
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (None where not given)."""
        return _json_form(self)


@dataclass(frozen=True)
class ResolvedSettings:
    """The settings in force for one engine (or one plain-torch pass): every field decided."""

    enabled: bool
    captured_limit: int
    excluded_layers: tuple[str, ...]
    count_rows: bool = False
    row_log: str | None = None
    prefill_precision: str = A4

    def __post_init__(self) -> None:
        _check_prefill_precision(self.prefill_precision)

    def excluded_by(self, layer_name: str) -> str | None:
        """The first ``excluded_layers`` pattern that matches ``layer_name``, or None."""
        return next((p for p in self.excluded_layers if re.search(p, layer_name)), None)

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (part of the pass uuid, printed in reports)."""
        return _json_form(self)


def misspelt_settings_key(key: str) -> bool:
    """Whether a top-level ``--additional-config`` key looks like a misspelling of
    :data:`SETTINGS_KEY` (same letters and digits ignoring case and separators, or nearly the
    same): its settings would otherwise be ignored without a word."""
    if key == SETTINGS_KEY:
        return False
    letters = re.sub(r"[^a-z0-9]", "", key.lower())
    return letters == SETTINGS_KEY or difflib.SequenceMatcher(None, letters, SETTINGS_KEY).ratio() >= 0.8


def unmatched_patterns(settings: ResolvedSettings, layer_names: Sequence[str]) -> list[str]:
    """The ``excluded_layers`` patterns that match none of ``layer_names``."""
    return [p for p in settings.excluded_layers if not any(re.search(p, name) for name in layer_names)]


def legacy_switch(environ: Mapping[str, str]) -> bool | None:
    """The legacy variable as an on/off switch: None when unset, True for an integer >= 0, False
    for anything else. Logs nothing (:func:`resolve_settings` says what is in force)."""
    raw = environ.get(LEGACY_THRESHOLD_ENV)
    if raw is None:
        return None
    try:
        return int(raw.strip()) >= 0
    except ValueError:
        return False


def _say_what_the_legacy_variable_did(raw: str, legacy: bool, explicit: bool | None) -> None:
    """One warning per process and situation, consistent with the resolved ``enabled``."""
    if explicit is not None:
        warn_once(
            logger,
            (LEGACY_THRESHOLD_ENV, raw, "ignored"),
            "a4prefill: %s=%r is deprecated and ignored: the setting %s.enabled=%s is in force "
            "(A4 prefill is %s).",
            LEGACY_THRESHOLD_ENV,
            raw,
            SETTINGS_KEY,
            "true" if explicit else "false",
            "on" if explicit else "off",
        )
    elif legacy:
        warn_once(
            logger,
            (LEGACY_THRESHOLD_ENV, raw, "on"),
            "a4prefill: %s=%r is deprecated: it switches A4 prefill on (its token threshold is ignored: "
            "prefill rows run A4 whatever the step size). Use --additional-config "
            '\'{"%s": {"enabled": true}}\' instead.',
            LEGACY_THRESHOLD_ENV,
            raw,
            SETTINGS_KEY,
        )
    else:
        warn_once(
            logger,
            (LEGACY_THRESHOLD_ENV, raw, "off"),
            "a4prefill: %s=%r is not an integer >= 0: A4 prefill is off (the variable is deprecated; "
            'use --additional-config \'{"%s": {"enabled": true|false}}\')',
            LEGACY_THRESHOLD_ENV,
            raw,
            SETTINGS_KEY,
        )


def resolve_settings(
    settings: A4PrefillSettings,
    engine_captured_limit: int = 0,
    environ: Mapping[str, str] | None = None,
) -> ResolvedSettings:
    """The one rule: explicit settings, else the legacy variable (``enabled`` only), else defaults.

    ``engine_captured_limit``: the largest token count the engine runs inside a captured CUDA
    graph (0 without an engine or without captured mixed batches). ``environ`` defaults to
    ``os.environ``.
    """
    environ = os.environ if environ is None else environ
    legacy = legacy_switch(environ)
    if legacy is not None:
        _say_what_the_legacy_variable_did(environ[LEGACY_THRESHOLD_ENV], legacy, settings.enabled)
    enabled = settings.enabled
    if enabled is None:
        enabled = True if legacy is None else legacy
    limit = settings.captured_limit if settings.captured_limit is not None else engine_captured_limit
    return ResolvedSettings(
        enabled,
        limit,
        settings.excluded_layers,
        settings.count_rows,
        settings.row_log,
        settings.prefill_precision,
    )
