"""The bf16 copy of a ModelOpt NVFP4 checkpoint: expert weights decoded from a literal e2m1 table,
everything else unchanged, no quantization config left for vLLM to find."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from a4prefill.tools.numerics.dequantized_checkpoint import write_dequantized_checkpoint

# e2m1 magnitudes by the 3 low bits of a nibble; bit 3 is the sign (docs/numerics.md, section 2)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ROWS, COLS = 2, 32  # one projection: [2, 32] values, 16 code bytes per row, 2 scale bytes per row


def decode_by_table(codes: list[int], scale_bytes: list[int], scale_2: float) -> torch.Tensor:
    """fp32 [ROWS, COLS]: element 2j of a row is the low nibble of byte j, 2j+1 the high one."""
    scales = torch.tensor(scale_bytes, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = torch.empty(ROWS, COLS)
    for row in range(ROWS):
        for col in range(COLS):
            byte = codes[row * COLS // 2 + col // 2]
            nibble = byte & 0xF if col % 2 == 0 else byte >> 4
            sign = -1.0 if nibble & 0x8 else 1.0
            values[row, col] = sign * E2M1[nibble & 0x7] * scales[row * COLS // 16 + col // 16] * scale_2
    return values


def projection(codes: list[int], scale_bytes: list[int], scale_2: float) -> dict[str, torch.Tensor]:
    return {
        "weight": torch.tensor(codes, dtype=torch.uint8).reshape(ROWS, COLS // 2),
        "weight_scale": torch.tensor(scale_bytes, dtype=torch.uint8)
        .view(torch.float8_e4m3fn)
        .reshape(ROWS, 2),
        "weight_scale_2": torch.tensor(scale_2, dtype=torch.float32),
        "input_scale": torch.tensor(0.5, dtype=torch.float32),
    }


def write_source(directory, projections: dict[str, dict[str, torch.Tensor]], shards: int = 1) -> None:
    tensors = {f"{base}.{kind}": t for base, parts in projections.items() for kind, t in parts.items()}
    tensors["model.embed_tokens.weight"] = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    directory.mkdir()
    names = sorted(tensors)
    bases = sorted({n.split(".weight")[0] for n in names})
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        weight_map = {}
        for index in range(shards):
            file = f"model-{index:05d}-of-{shards:05d}.safetensors"
            # alternate projections between shards, each projection's tensors together
            chosen = {n: tensors[n] for n in names if bases.index(n.split(".weight")[0]) % shards == index}
            save_file(chosen, str(directory / file))
            weight_map.update(dict.fromkeys(chosen, file))
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {"architectures": ["Qwen3MoeForCausalLM"], "quantization_config": {"quant_algo": "NVFP4"}}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "hf_quant_config.json").write_text("{}")
    (directory / "tokenizer.json").write_text('{"tok": 1}')


def read_all(directory) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


code_bytes = st.lists(st.integers(0, 255), min_size=ROWS * COLS // 2, max_size=ROWS * COLS // 2)
# e4m3 bytes without NaN (0x7f, 0xff): signs included, subnormals included
scale_bytes = st.lists(
    st.integers(0, 255).filter(lambda b: b & 0x7F != 0x7F), min_size=ROWS * 2, max_size=ROWS * 2
)
scale_2s = st.sampled_from([2.0**-12, 1.0 / 2688.0, 0.001, 0.37, 1.0, 3.5])


@settings(max_examples=30, deadline=None)
@given(gate=st.tuples(code_bytes, scale_bytes, scale_2s), down=st.tuples(code_bytes, scale_bytes, scale_2s))
def test_expert_weights_are_the_table_values_rounded_once_to_bf16(tmp_path_factory, gate, down):
    root = tmp_path_factory.mktemp("ckpt")
    base = "model.layers.0.mlp.experts.0"
    write_source(
        root / "src", {f"{base}.gate_proj": projection(*gate), f"{base}.down_proj": projection(*down)}
    )
    write_dequantized_checkpoint(root / "src", root / "dst")
    tensors = read_all(root / "dst")
    for name, drawn in ((f"{base}.gate_proj", gate), (f"{base}.down_proj", down)):
        assert tensors[f"{name}.weight"].dtype == torch.bfloat16
        assert torch.equal(tensors[f"{name}.weight"], decode_by_table(*drawn).to(torch.bfloat16)), name
        for kind in ("weight_scale", "weight_scale_2", "input_scale"):
            assert f"{name}.{kind}" not in tensors


@pytest.mark.parametrize("shards", [1, 2])
def test_other_tensors_and_files_are_kept_and_the_quantization_config_is_gone(tmp_path, shards):
    codes, scales = [0x21] * (ROWS * COLS // 2), [0x38] * (ROWS * 2)  # 0.5 / 1.0 codes, scale 1.0
    bases = [
        f"model.layers.{i}.block_sparse_moe.experts.{e}.w{p}"
        for i in range(2)
        for e in range(2)
        for p in (1, 2, 3)
    ]
    write_source(tmp_path / "src", {b: projection(codes, scales, 2.0) for b in bases}, shards=shards)
    write_dequantized_checkpoint(tmp_path / "src", tmp_path / "dst")
    dst = tmp_path / "dst"
    tensors = read_all(dst)
    assert sorted(tensors) == sorted(["model.embed_tokens.weight", *(f"{b}.weight" for b in bases)])
    assert torch.equal(
        tensors["model.embed_tokens.weight"], torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    )
    # byte 0x21: low nibble 1 (0.5), high nibble 2 (1.0); times scale 1.0 times scale_2 2.0
    assert tensors[f"{bases[0]}.weight"][0, :4].tolist() == [1.0, 2.0, 1.0, 2.0]
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    assert not (dst / "hf_quant_config.json").exists()
    assert (dst / "tokenizer.json").read_text() == '{"tok": 1}'
    if shards > 1:
        weight_map = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(weight_map) == sorted(tensors)


def test_a_weight_without_its_scales_is_a_clear_error(tmp_path):
    parts = projection([0] * (ROWS * COLS // 2), [0x38] * (ROWS * 2), 1.0)
    del parts["weight_scale_2"]
    write_source(tmp_path / "src", {"model.layers.0.mlp.experts.0.up_proj": parts})
    with pytest.raises(ValueError, match=r"experts\.0\.up_proj\.weight: .*weight_scale_2"):
        write_dequantized_checkpoint(tmp_path / "src", tmp_path / "dst")
