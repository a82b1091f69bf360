"""The built-in tiny model: rebuilt when the package version or its recipe changes, two
architectures with their own checkpoint names."""

from __future__ import annotations

import json

import pytest

# the tiny model's writer needs both (they come with vLLM, which scripts/setup.sh installs)
pytest.importorskip("tokenizers", reason="needs tokenizers (installed with vLLM)")
safe_open = pytest.importorskip("safetensors", reason="needs safetensors (installed with vLLM)").safe_open

from a4prefill.tools.tiny_model import STAMP_FILE, TinyModelSpec, make_tiny_model, recipe_stamp  # noqa: E402


def test_a_stale_tiny_model_is_rebuilt_and_a_current_one_reused(tmp_path):
    from a4prefill.tools.e2e import ensure_tiny_model

    directory = tmp_path / "tiny"
    ensure_tiny_model(directory)
    weights = directory / "model.safetensors"
    built = weights.stat().st_mtime_ns
    ensure_tiny_model(directory)
    assert weights.stat().st_mtime_ns == built  # same version and recipe: reused
    stamp = json.loads((directory / STAMP_FILE).read_text())
    assert stamp == recipe_stamp(TinyModelSpec())
    for stale in ({**stamp, "package_version": "0.0.1"}, {**stamp, "recipe": "0" * 64}):
        (directory / STAMP_FILE).write_text(json.dumps(stale))
        ensure_tiny_model(directory)
        assert json.loads((directory / STAMP_FILE).read_text()) == stamp  # rebuilt
    (directory / STAMP_FILE).unlink()
    ensure_tiny_model(directory)
    assert (directory / STAMP_FILE).exists()


@pytest.mark.parametrize(
    ("architecture", "expert", "router"),
    [
        ("qwen3_moe", "model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.gate.weight"),
        (
            "mixtral",
            "model.layers.0.block_sparse_moe.experts.3.w3.weight",
            "model.layers.0.block_sparse_moe.gate.weight",
        ),
    ],
)
def test_each_architecture_writes_its_own_names(tmp_path, architecture, expert, router):
    spec = TinyModelSpec(architecture=architecture, num_layers=2)
    directory = make_tiny_model(tmp_path / architecture, spec)
    with safe_open(str(directory / "model.safetensors"), "pt") as checkpoint:
        names = set(checkpoint.keys())
    assert expert in names and router in names
    assert "model.layers.1.mlp.experts.0.gate_proj.input_scale" not in names  # last layer: none
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == architecture
    with pytest.raises(ValueError, match="architecture must be one of"):
        TinyModelSpec(architecture="llama")
