"""A minimal stand-in for ``a4prefill.split_prefill_pass`` (used only while the real pass is
missing): rewrites every ``a4prefill.moe_w4a16`` node into ``moe_split`` and keeps records with
``token_range``, ``rewritten`` and ``kept`` like the real pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.compilation.passes.inductor_pass import InductorPass

import a4prefill.ops  # noqa: F401  (registers the ops)


@dataclass
class Record:
    token_range: str
    rewritten: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)


class StandInSplitPass(InductorPass):
    def __init__(self) -> None:
        self.records: list[Record] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        record = Record(token_range="?")
        for node in graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.a4prefill.moe_w4a16.default:
                node.target = torch.ops.a4prefill.moe_split.default
                record.rewritten.append(node.name)
        self.records.append(record)

    def uuid(self) -> str:
        return "a4prefill-standin-split-pass-v1"


PASS = StandInSplitPass()
