"""The package's user settings (``--additional-config '{"a4prefill": {...}}'`` under vLLM).

Keys (all optional):

- ``enabled`` (bool, default true): false keeps every layer W4A16 (the pass rewrites nothing);
- ``captured_limit`` (int >= 0 or null): the largest token count that may run inside a captured
  CUDA graph. Graphs whose whole token range is within it keep W4A16. null: under vLLM the
  engine's ``max_cudagraph_capture_size``, elsewhere 0 (no captured graphs);
- ``excluded_layers`` (list of regular expressions, default []): layers whose name matches one
  (``re.search``) are never rewritten, e.g. ``["mtp"]`` for speculative draft layers.

Invalid settings raise ``ValueError`` naming the key. Who may call: the pass, the vLLM plugin.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SETTINGS_KEY = "a4prefill"


@dataclass(frozen=True)
class A4PrefillSettings:
    """Validated settings; see the module docstring for the meaning of each field."""

    enabled: bool = True
    captured_limit: int | None = None
    excluded_layers: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"{SETTINGS_KEY}.enabled must be true or false, got {self.enabled!r}")
        limit = self.captured_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"{SETTINGS_KEY}.captured_limit must be an integer >= 0 or null, got {limit!r}")
        if isinstance(self.excluded_layers, str) or not all(isinstance(p, str) for p in self.excluded_layers):
            raise ValueError(
                f"{SETTINGS_KEY}.excluded_layers must be a list of regular expressions, "
                f"got {self.excluded_layers!r}"
            )
        for pattern in self.excluded_layers:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"{SETTINGS_KEY}.excluded_layers: {pattern!r} is not a regex: {error}"
                ) from None

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> A4PrefillSettings:
        """Build from a JSON-like mapping; unknown keys and wrong types raise ``ValueError``."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ValueError(f"{SETTINGS_KEY} settings must be a JSON object, got {raw!r}")
        known = {"enabled", "captured_limit", "excluded_layers"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown {SETTINGS_KEY} setting(s) {unknown}; known: {sorted(known)}")
        excluded = raw.get("excluded_layers", ())
        if isinstance(excluded, str) or not isinstance(excluded, list | tuple):
            raise ValueError(
                f"{SETTINGS_KEY}.excluded_layers must be a list of regular expressions, got {excluded!r}"
            )
        return cls(
            enabled=raw.get("enabled", True),
            captured_limit=raw.get("captured_limit"),
            excluded_layers=tuple(excluded),
        )

    def is_layer_excluded(self, layer_name: str) -> bool:
        """True when ``layer_name`` matches one of ``excluded_layers``."""
        return any(re.search(pattern, layer_name) for pattern in self.excluded_layers)

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (part of the pass uuid)."""
        return {
            "enabled": self.enabled,
            "captured_limit": self.captured_limit,
            "excluded_layers": list(self.excluded_layers),
        }


def current_vllm_config() -> Any | None:
    """The current vLLM config if vLLM is already imported and one is set, else None.

    Never imports vLLM: plain torch.compile users pay nothing.
    """
    if "vllm.config" not in sys.modules:
        return None
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def settings_from_vllm_config(vllm_config: Any) -> A4PrefillSettings:
    """The ``a4prefill`` entry of a vLLM config's ``additional_config`` (validated)."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    return A4PrefillSettings.from_mapping(additional.get(SETTINGS_KEY))


def vllm_captured_limit(vllm_config: Any) -> int:
    """The largest CUDA-graph capture size of a vLLM config (0 when CUDA graphs are off)."""
    compilation = vllm_config.compilation_config
    if not getattr(compilation, "cudagraph_capture_sizes", None):
        return 0
    return int(compilation.max_cudagraph_capture_size or 0)
