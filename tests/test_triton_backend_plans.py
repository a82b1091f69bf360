"""The triton backend executes a row plan as planned (``TritonBackend.run``), on the CPU: Triton's
own launch path compiles the kernels for sm_90a offline (``helpers.triton_launches``), and the
``MODE`` each kernel is compiled with is read from the specialization Triton reports. So a plan
reaches the kernels with the precision it says, W4A16 rows never quantized, A4 scales ignored for
a W4A16 plan although the call carries them."""

from __future__ import annotations

import pytest
import torch

from a4prefill.ops.backends.triton import plan as call_plans
from a4prefill.ops.backends.triton.backend import TritonBackend
from a4prefill.ops.modelopt import NvFp4Experts
from a4prefill.ops.precision import A4, MODE_A4, MODE_SPLIT, MODE_W4A16, SPLIT, W4A16, MoECall, RowPlan
from a4prefill.ops.rows import RowTypes
from a4prefill.ops.scales import A4Scales
from helpers.markers import needs_gluon

pytestmark = [
    pytest.mark.slow,
    needs_gluon,
]
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 1024, 512, 2


def call(tokens: int) -> MoECall:
    """A layer with A4 scales: the plan alone decides whether any row runs A4."""
    experts = NvFp4Experts(
        torch.zeros(EXPERTS, 2 * INTERMEDIATE, HIDDEN // 2, dtype=torch.uint8),
        torch.zeros(EXPERTS, 2 * INTERMEDIATE, HIDDEN // 16, dtype=torch.float8_e4m3fn),
        torch.ones(EXPERTS, 2),
        torch.zeros(EXPERTS, HIDDEN, INTERMEDIATE // 2, dtype=torch.uint8),
        torch.zeros(EXPERTS, HIDDEN, INTERMEDIATE // 16, dtype=torch.float8_e4m3fn),
        torch.ones(EXPERTS),
    )
    ids = (torch.arange(tokens * TOP_K) % EXPERTS).reshape(tokens, TOP_K).to(torch.int32)
    hidden = torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)
    scales = A4Scales(torch.ones(1), torch.ones(EXPERTS))
    return MoECall(hidden, torch.full((tokens, TOP_K), 0.5), ids, experts, scales, None, "layer")


def _mode(event) -> int | None:
    """The ``MODE`` constexpr a compile event's kernel was specialized with (None: it has none)."""
    from helpers.triton_launches import package_kernels

    kernel = next(k for name, k in package_kernels().items() if name.endswith("." + event.kernel))
    names = [param.name for param in kernel.params]
    data = event.specialization
    for key, value in zip(data["constant_keys"], data["constant_vals"], strict=True):
        if names[key[0]] == "MODE":
            return value["constexpr"] if isinstance(value, dict) else value
    return None


@pytest.mark.parametrize(
    ("plan", "mode", "quantized"),
    [
        (RowPlan.uniform(W4A16, 12), MODE_W4A16, False),
        (RowPlan.uniform(A4, 12), MODE_A4, True),
        (
            RowPlan(SPLIT, 12, RowTypes.from_labels(["decode"] * 4 + ["prefill"] * 6 + ["padding"] * 2)),
            MODE_SPLIT,
            True,
        ),
    ],
    ids=lambda value: getattr(value, "kind", str(value)),
)
def test_the_kernels_run_the_plans_mode(plan, mode, quantized, monkeypatch):
    from helpers.triton_launches import fresh_launches

    monkeypatch.setattr(call_plans, "decode_kernels_run", lambda device: True)
    monkeypatch.setattr(call_plans, "grid_dependencies_run", lambda device: True)
    with fresh_launches("cpu") as compiles:
        TritonBackend().run(call(12), plan)
    launched = {event.kernel: _mode(event) for event in compiles}
    assert ("quantize_rows_kernel" in launched) is quantized
    assert launched["fc1_decode_kernel"] == launched["fc2_decode_kernel"] == mode
    if quantized:
        assert launched["quantize_rows_kernel"] == (MODE_SPLIT if plan.kind == SPLIT else MODE_A4)
