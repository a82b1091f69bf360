"""Shared fixtures: a tiny calibrated layer, an uncalibrated one, random inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

from a4prefill.ops import ROW_COUNTERS
from a4prefill.tiny_layer import TinyMoELayer, make_tiny_layer, random_routing

settings.register_profile("default", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("default")

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 6, 2
# GPU backends vs the reference, per precision: (relative Frobenius error, fraction of elements
# off by more than two bf16 ulps). A4 rounding flips can move an FC2 input by one FP4 code.
BOUNDS = {"w4a16": (5e-3, 0.01), "a4": (2e-2, 0.05)}


@pytest.fixture(scope="session")
def layer() -> TinyMoELayer:
    return make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=3, calibration_tokens=128)


@pytest.fixture(scope="session")
def uncalibrated_layer() -> TinyMoELayer:
    return make_tiny_layer(EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, seed=4, calibrated=False)


def make_inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 hidden states [T, HIDDEN] and random routing for the tiny layer."""
    generator = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(tokens, HIDDEN, generator=generator)).to(torch.bfloat16)
    topk_weights, topk_ids = random_routing(tokens, EXPERTS, TOP_K, generator)
    return hidden, topk_weights, topk_ids


@pytest.fixture(autouse=True)
def _reset_counters():
    ROW_COUNTERS.reset()
    yield


def assert_close_to_reference(result: torch.Tensor, expected: torch.Tensor, precision: str) -> None:
    """``result`` is within ``BOUNDS[precision]`` of the reference output ``expected``."""
    rel_frob, flip_fraction = BOUNDS[precision]
    result, expected = result.float().cpu(), expected.float().cpu()
    assert torch.isfinite(result).all()
    error = float((result - expected).norm() / expected.norm().clamp(min=1e-30))
    ulp = torch.exp2(torch.floor(torch.log2(expected.abs().clamp(min=2**-60))) - 7)
    flips = float(((result - expected).abs() > 2 * ulp).float().mean())
    assert error < rel_frob, f"{precision}: relative Frobenius error {error:.2e} >= {rel_frob}"
    assert flips <= flip_fraction, f"{precision}: {flips:.2%} of elements off by > 2 ulps"
