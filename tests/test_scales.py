"""Load-time A4 scales: the contract's formulas bit for bit, and every way a calibration is invalid."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from a4prefill.ops import a4_calibration, derive_a4_scales, nvfp4
from a4prefill.ops.scales import ENCODE_SCALE_LIMIT, FC1_EXPERT_SPREAD, FC1_INPUT_SCALE_MAX

EXPERTS = 5
# within FC1_EXPERT_SPREAD of each other (2**13 < 448 * 64) and at most FC1_INPUT_SCALE_MAX
# (2**6 < 2**9 / 6): a valid calibration
positive_scales = hnp.arrays(
    np.float32,
    EXPERTS,
    elements=st.floats(2**-7, 2**6, width=32),
)


@given(fc1_input=positive_scales, fc1_up=positive_scales, fc2_input=positive_scales)
def test_scales_follow_the_contract_bit_for_bit(fc1_input, fc1_up, fc2_input):
    w13_input_scale = torch.from_numpy(np.stack([fc1_input, fc1_up], axis=1))
    w2_input_scale = torch.from_numpy(fc2_input)
    scales = derive_a4_scales(w13_input_scale, w2_input_scale)
    # gs1 = 1 / max_e(w13_input_scale) (one shared scale), gs2[e] = 1 / w2_input_scale[e] (fp32).
    widest = max(float(v) for v in np.concatenate([fc1_input, fc1_up]))
    assert scales.fc1_encode_scale.dtype == torch.float32 and scales.fc1_encode_scale.shape == (1,)
    assert float(scales.fc1_encode_scale) == float(np.float32(1.0) / np.float32(widest))
    expected_fc2 = np.float32(1.0) / fc2_input
    assert scales.fc2_encode_scales.tolist() == expected_fc2.tolist()


@pytest.mark.parametrize(
    ("which", "bad", "reason"),
    [
        ("w13", 0.0, r"w13_input_scale has zero entries \(not calibrated\)"),
        ("w2", 0.0, r"w2_input_scale has zero entries \(not calibrated\)"),
        ("w13", -1.0, "w13_input_scale has negative entries"),
        ("w2", math.nan, "w2_input_scale has non-finite entries"),
        ("w13", math.inf, "w13_input_scale has non-finite entries"),
        # 1 / 1e-45 overflows fp32: the expert's FC2 output would be silently zeroed in A4.
        ("w2", 1e-45, r"w2_input_scale\[2\]=1.4e-45 is so small that its FC2 encode scale is not finite"),
        # finite encode scales the kernels' fp32 multipliers cannot take (ENCODE_SCALE_LIMIT)
        (
            "w2",
            2.0**-110,
            r"w2_input_scale\[2\]=7.7e-34 gives the FC2 encode scale 1.3e\+33, outside .*overflow",
        ),
        (
            "w2",
            2.0**110,
            r"w2_input_scale\[2\]=1.3e\+33 gives the FC2 encode scale 7.7e-34, outside .*overflow",
        ),
    ],
)
def test_an_invalid_calibration_gives_no_scales_and_says_why(which, bad, reason):
    w13_input_scale = torch.full((EXPERTS, 2), 0.01)
    w2_input_scale = torch.full((EXPERTS,), 0.02)
    target = w13_input_scale if which == "w13" else w2_input_scale
    target.view(-1)[2] = bad
    calibration = a4_calibration(w13_input_scale, w2_input_scale)
    assert calibration.scales is None
    assert calibration.reason is not None
    assert re.fullmatch(reason, calibration.reason), calibration.reason
    with pytest.raises(ValueError, match="not a valid A4 calibration"):
        derive_a4_scales(w13_input_scale, w2_input_scale)


def test_a_tiny_fc1_scale_everywhere_is_invalid_too():
    calibration = a4_calibration(torch.full((EXPERTS, 2), 1e-45), torch.full((EXPERTS,), 0.02))
    assert calibration.scales is None and "FC1 encode scale is not finite" in calibration.reason
    calibration = a4_calibration(torch.full((EXPERTS, 2), 2.0**-110), torch.full((EXPERTS,), 0.02))
    assert calibration.scales is None
    assert calibration.reason == (
        "w13_input_scale gives the FC1 encode scale 1.3e+33, outside 2**-100 to 2**100, where the "
        "kernels' per-block multipliers overflow"
    )


def test_encode_scales_at_the_limit_are_kept():
    """Input scales of ``2**-100`` and ``2**100`` give encode scales exactly at
    ``ENCODE_SCALE_LIMIT`` and its reciprocal: kept."""
    calibration = a4_calibration(torch.full((EXPERTS, 2), 2.0**-100), torch.full((EXPERTS,), 2.0**100))
    assert calibration.scales is not None, calibration.reason
    assert float(calibration.scales.fc1_encode_scale) == ENCODE_SCALE_LIMIT
    assert calibration.scales.fc2_encode_scales.tolist() == [1.0 / ENCODE_SCALE_LIMIT] * EXPERTS


@pytest.mark.parametrize(
    ("w13", "w2", "error", "message"),
    [
        (
            torch.zeros(3, 2, dtype=torch.int32),
            torch.zeros(3),
            TypeError,
            "w13_input_scale must be a floating",
        ),
        (torch.ones(3, 2), torch.ones(4), ValueError, r"w2_input_scale \[E\]"),
        (torch.ones(3, 2, 1), torch.ones(3), ValueError, r"\[E, 2\] or \[E\]"),
        (torch.ones(3, 3), torch.ones(3), ValueError, r"\[E, 2\] or \[E\]"),  # issue 27
    ],
)
def test_malformed_input_scales_are_an_error(w13, w2, error, message):
    with pytest.raises(error, match=message):
        a4_calibration(w13, w2)


def test_one_absurd_fc1_input_scale_gives_no_scales_and_says_why():
    """Issue 27: one expert's w13_input_scale at 1e6 (the others calibrated) made the shared FC1
    encode scale flush every other expert's activations to zero, and A4 ran anyway."""
    w13_input_scale = torch.full((EXPERTS, 2), 0.01)
    w13_input_scale[3, 0] = 1e6
    calibration = a4_calibration(w13_input_scale, torch.full((EXPERTS,), 0.02))
    assert calibration.scales is None
    assert "w13_input_scale spans a factor 1e+08" in calibration.reason
    assert "flush to zero" in calibration.reason


@pytest.mark.parametrize(
    ("largest", "valid"), [(float(FC1_EXPERT_SPREAD), True), (FC1_EXPERT_SPREAD + 1.0, False)]
)
def test_the_fc1_spread_bound_edges(largest, valid):
    w13_input_scale = torch.full((EXPERTS, 2), 1.0 / largest)  # spread `largest`, max 1
    w13_input_scale[0, 1] = 1.0
    calibration = a4_calibration(w13_input_scale, torch.full((EXPERTS,), 0.02))
    assert (calibration.scales is not None) is valid, calibration.reason


def test_the_spread_bound_is_where_the_smallest_experts_blocks_leave_e4m3s_normal_range():
    """At the bound, a block at the smallest expert's calibrated amax (``6 * 448 * s_min``) gets
    the smallest normal e4m3 block scale 2**-6 and keeps its codes; 16 times beyond the bound the
    same block's scale rounds to zero and every code is zero."""
    block = torch.linspace(-1.0, 1.0, 16).reshape(1, 16) * (6 * 448 * 1.0)  # s_min = 1.0
    at_bound = torch.tensor([1.0 / FC1_EXPERT_SPREAD])
    codes, scale = nvfp4.quantize_codes(block, at_bound)
    assert float(scale.float()) == 2.0**-6 and bool((codes & 7).any())
    beyond = torch.tensor([1.0 / (16 * FC1_EXPERT_SPREAD)])
    codes, scale = nvfp4.quantize_codes(block, beyond)
    assert float(scale.float()) == 0.0 and not bool((codes & 7).any())


@pytest.mark.parametrize(("largest", "valid"), [(85.0, True), (86.0, False), (1e6, False)])
def test_uniformly_absurd_fc1_input_scales_are_no_calibration(largest, valid):
    """Issue 27, point 3: every expert's ``w13_input_scale`` equal, so the spread rule sees
    nothing. Up to ``2**9 / 6`` (85.33) the layer keeps A4; above it, and at the reported 1e6,
    the layer is "no calibration" with the reason (accepted before this rule)."""
    w13_input_scale = torch.full((EXPERTS, 2), largest)
    calibration = a4_calibration(w13_input_scale, torch.full((EXPERTS,), 0.02))
    assert (calibration.scales is not None) is valid, calibration.reason
    if not valid:
        assert "flush input blocks of amax 1" in calibration.reason


def test_the_fc1_input_scale_bound_is_where_a_block_of_amax_1_keeps_a_block_scale():
    """At the bound a block of amax 1 gets the smallest e4m3 block scale 2**-9 and nonzero
    codes; at 1e6 (the issue's checkpoint) the same block's scale and codes are zero."""
    block = torch.linspace(-1.0, 1.0, 16).reshape(1, 16)
    codes, scale = nvfp4.quantize_codes(block, torch.tensor([1.0 / FC1_INPUT_SCALE_MAX]))
    assert float(scale.float()) == 2.0**-9 and bool((codes & 7).any())
    codes, scale = nvfp4.quantize_codes(block, torch.tensor([1.0 / 1e6]))
    assert float(scale.float()) == 0.0 and not bool((codes & 7).any())
