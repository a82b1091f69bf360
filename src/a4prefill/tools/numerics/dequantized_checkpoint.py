"""A bf16 copy of a ModelOpt NVFP4 MoE checkpoint: the reference vLLM serves unquantized.

``write_dequantized_checkpoint(source, target)`` writes ``target`` such that vLLM loads it as
an ordinary bf16 model whose expert weights are exactly the NVFP4 weights' values:

- every ModelOpt expert projection (:data:`.checkpoint.EXPERT_TENSOR`: ``<layer>.experts.<e>.
  <projection>.weight`` with ``weight_scale`` and ``weight_scale_2``) becomes one ``weight``
  ``e2m1 * block_scale * weight_scale_2`` computed in fp32 and rounded once to ``dtype``
  (docs/numerics.md, section 2; ``weight_scale_2`` is the decode scale of that projection, so
  gate and up keep their own); its ``weight_scale``, ``weight_scale_2`` and ``input_scale`` are
  dropped;
- every other tensor is copied unchanged;
- ``config.json`` loses ``quantization_config``; ``hf_quant_config.json`` is not copied; every
  other non-weight file (tokenizer, generation config) is copied.

Safetensors files are processed one at a time (memory: one file); a sharded checkpoint keeps its
shards and gets an index without the dropped names.

Who may call: benchmarks comparing vLLM's paths against bf16, tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from a4prefill.ops.modelopt import QuantizedStack, dequantize_expert_stack
from a4prefill.tools.numerics.checkpoint import EXPERT_TENSOR

INDEX_FILE = "model.safetensors.index.json"
QUANTIZATION_FILES = ("hf_quant_config.json",)


def _dequantized_file(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file with every NVFP4 expert projection dequantized."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = EXPERT_TENSOR.match(name)
        if match is None:
            out[name] = tensor
            continue
        if match["kind"] != "weight":
            continue  # scales of a projection dequantized below
        base = name[: -len(".weight")]
        missing = [
            f"{base}.{kind}" for kind in ("weight_scale", "weight_scale_2") if f"{base}.{kind}" not in tensors
        ]
        if missing:
            raise ValueError(
                f"{name}: an NVFP4 expert weight needs {' and '.join(missing)} in the same safetensors file"
            )
        one = QuantizedStack(
            tensor[None],
            tensors[f"{base}.weight_scale"][None],
            tensors[f"{base}.weight_scale_2"].reshape(1).float(),
        )
        out[name] = dequantize_expert_stack(one)[0].to(dtype)
    return out


def write_dequantized_checkpoint(
    source: str | Path, target: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the ``dtype`` copy of the ModelOpt NVFP4 MoE checkpoint ``source`` into ``target``."""
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"source={source}: no *.safetensors files")
    target.mkdir(parents=True, exist_ok=True)
    kept: set[str] = set()
    for shard in shards:
        tensors = _dequantized_file(load_file(str(shard)), dtype)
        kept.update(tensors)
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(target / shard.name))
    for path in source.iterdir():
        if path.suffix == ".safetensors" or path.name in (*QUANTIZATION_FILES, INDEX_FILE, "config.json"):
            continue
        if path.is_file():
            shutil.copy2(path, target / path.name)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config, indent=2))
    if (source / INDEX_FILE).exists():
        index = json.loads((source / INDEX_FILE).read_text())
        index["weight_map"] = {name: file for name, file in index["weight_map"].items() if name in kept}
        (target / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return target
