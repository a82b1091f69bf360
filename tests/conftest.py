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
