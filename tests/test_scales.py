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

from a4prefill.ops import a4_calibration, derive_a4_scales

EXPERTS = 5
positive_scales = hnp.arrays(
    np.float32,
    EXPERTS,
    elements=st.floats(2**-20, 1024.0, width=32),
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
    ],
)
def test_malformed_input_scales_are_an_error(w13, w2, error, message):
    with pytest.raises(error, match=message):
        a4_calibration(w13, w2)
