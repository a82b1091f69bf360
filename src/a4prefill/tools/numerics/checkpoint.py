"""A ModelOpt NVFP4 MoE checkpoint, read lazily: one MoE layer's tensors at a time.

Safetensors files, single (``model.safetensors``) or sharded (``model.safetensors.index.json``
or every ``*.safetensors`` of the folder). Expert tensors are found by their ModelOpt names,
``<layer>.experts.<e>.<projection>.<kind>`` with projection ``gate_proj``/``up_proj``/``down_proj``
(Qwen, DeepSeek, ...) or ``w1``/``w3``/``w2`` (Mixtral) and kind ``weight``, ``weight_scale``,
``weight_scale_2`` or ``input_scale``; ``<layer>.experts`` is the layer's name, as vLLM names it.
Only the file offsets are read when the checkpoint is opened; :meth:`ModelOptCheckpoint.read_layer`
reads one layer's tensors (memory: one layer), so checkpoints larger than RAM work.

Who may call: the numerics tool, tests.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch

from a4prefill.ops.modelopt import NvFp4MoEWeights

EXPERT_TENSOR = re.compile(
    r"^(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.(?P<kind>weight_scale_2|weight_scale|input_scale|weight)$"
)
ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _natural_key(name: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class ModelOptCheckpoint:
    """The MoE layers of a checkpoint folder and where each of their tensors lives."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._file_of = self._tensor_files()
        self._layers: dict[str, dict[tuple[int, str, str], str]] = defaultdict(dict)
        for name in self._file_of:
            match = EXPERT_TENSOR.match(name)
            if match:
                key = (int(match["expert"]), ROLES[match["projection"]], match["kind"])
                self._layers[match["layer"]][key] = name
        if not self._layers:
            raise ValueError(
                f"{self.directory}: no ModelOpt NVFP4 expert tensors (<layer>.experts.<e>.<gate_proj|up_proj|"
                "down_proj|w1|w3|w2>.weight) found; is this a ModelOpt NVFP4 MoE checkpoint?"
            )

    def _tensor_files(self) -> dict[str, Path]:
        from safetensors import safe_open

        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.directory / file for name, file in weight_map.items()}
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.directory}: no *.safetensors files")
        found: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), "pt") as handle:
                found.update(dict.fromkeys(handle.keys(), file))
        return found

    def layer_names(self) -> list[str]:
        """The MoE layers, in model order."""
        return sorted(self._layers, key=_natural_key)

    def read_layer(self, layer: str) -> NvFp4MoEWeights:
        """One layer's parameter set as vLLM holds it (input scales 0 where the checkpoint has none)."""
        from safetensors import safe_open

        names = self._layers[layer]
        num_experts = 1 + max(expert for expert, _, _ in names)
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names.values():
            by_file[self._file_of[name]].append(name)
        loaded: dict[str, torch.Tensor] = {}
        for file, wanted in by_file.items():
            with safe_open(str(file), "pt") as handle:
                loaded.update({name: handle.get_tensor(name) for name in wanted})

        def get(expert: int, role: str, kind: str) -> torch.Tensor | None:
            name = names.get((expert, role, kind))
            return None if name is None else loaded[name]

        def need(expert: int, role: str, kind: str) -> torch.Tensor:
            tensor = get(expert, role, kind)
            if tensor is None:
                raise ValueError(f"{layer}: expert {expert} has no {role} {kind} tensor")
            return tensor

        def scalar(expert: int, role: str, kind: str, required: bool) -> torch.Tensor:
            tensor = need(expert, role, kind) if required else get(expert, role, kind)
            return torch.zeros((), dtype=torch.float32) if tensor is None else tensor.reshape(()).float()

        experts = range(num_experts)
        w13 = torch.stack([torch.cat([need(e, "gate", "weight"), need(e, "up", "weight")]) for e in experts])
        w13_scale = torch.stack(
            [torch.cat([need(e, "gate", "weight_scale"), need(e, "up", "weight_scale")]) for e in experts]
        )
        pairs = [("weight_scale_2", True), ("input_scale", False)]
        w13_pairs = [
            torch.stack([torch.stack([scalar(e, r, kind, req) for r in ("gate", "up")]) for e in experts])
            for kind, req in pairs
        ]
        weights = NvFp4MoEWeights(
            w13_weight=w13,
            w13_weight_scale=w13_scale,
            w13_weight_scale_2=w13_pairs[0],
            w13_input_scale=w13_pairs[1],
            w2_weight=torch.stack([need(e, "down", "weight") for e in experts]),
            w2_weight_scale=torch.stack([need(e, "down", "weight_scale") for e in experts]),
            w2_weight_scale_2=torch.stack([scalar(e, "down", "weight_scale_2", True) for e in experts]),
            w2_input_scale=torch.stack([scalar(e, "down", "input_scale", False) for e in experts]),
        )
        if weights.w13_weight.dtype != torch.uint8 or weights.w13_weight_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(
                f"{layer}: expert weights must be uint8 NVFP4 codes with float8_e4m3fn block scales, got "
                f"{weights.w13_weight.dtype} and {weights.w13_weight_scale.dtype}"
            )
        return weights
