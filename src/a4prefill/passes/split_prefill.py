"""The post-grad pass that lets prefill rows run A4: W4A16 MoE nodes -> split nodes.

What it rewrites, in graphs whose token range reaches beyond the captured limit:

- ``a4prefill::moe_w4a16`` -> ``a4prefill::moe_split`` (same arguments);
- ``auto_functionalized[_v2](vllm::moe_forward, ...)`` -> the same node around
  ``a4prefill::moe_forward_split``, and ``vllm::moe_forward_shared`` ->
  ``a4prefill::moe_forward_shared_split`` (only where vLLM registered those ops).

A graph whose whole token range fits in the captured limit (CUDA-graph sizes) is left as it is;
layers matching ``excluded_layers`` are left alone. The pass is idempotent and keeps
``meta['val']`` valid (the replacement has the same outputs). Its ``uuid()`` covers the pass
source, the effective settings and the value ranges of the graph being compiled, so Inductor's
and vLLM's caches never serve a graph rewritten under another decision.

Usable as ``post_grad_custom_post_pass`` of plain torch.compile (see :func:`inductor_options`)
and, once the vLLM plugin registered it as a virtual ``InductorPass``, in vLLM's pass manager.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._dynamo.utils import lazy_format_graph_code
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.operator_schemas import normalize_function

from a4prefill.ops import moe as moe_ops
from a4prefill.ops.rows import legacy_threshold
from a4prefill.passes import token_range, vllm_ops
from a4prefill.passes.token_range import TokenRange
from a4prefill.settings import (
    A4PrefillSettings,
    current_vllm_config,
    settings_from_vllm_config,
    vllm_captured_limit,
)

logger = logging.getLogger(__name__)

_AUTO_FUNCTIONALIZED = tuple(
    op
    for op in (
        getattr(torch.ops.higher_order, "auto_functionalized", None),
        getattr(torch.ops.higher_order, "auto_functionalized_v2", None),
    )
    if op is not None
)


@dataclass
class PassRecord:
    """What the pass did to one graph: its token range, the MoE nodes rewritten and kept."""

    graph: str
    token_range: str
    captured_limit: int
    rewritten: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)

    @property
    def moe_nodes(self) -> int:
        return len(self.rewritten) + len(self.kept)

    def summary(self) -> str:
        kept = ", ".join(f"{name} ({reason})" for name, reason in self.kept) or "none"
        return (
            f"a4prefill split pass: graph {self.graph}, tokens {self.token_range}, captured limit "
            f"{self.captured_limit}: rewrote {len(self.rewritten)} of {self.moe_nodes} MoE nodes "
            f"{self.rewritten}; kept {kept}"
        )


@dataclass(frozen=True)
class _MoENode:
    node: fx.Node
    op: torch._ops.OpOverload
    hidden_states: fx.Node
    layer_name: str | None
    auto_functionalized: bool
    already_split: bool


def _argument(node: fx.Node, op: torch._ops.OpOverload, name: str, auto_functionalized: bool) -> Any:
    if auto_functionalized:
        base_index = node.kwargs.get(f"_{name}_base_index")  # auto_functionalized_v2
        if base_index is not None:
            bases: Any = node.kwargs["_all_bases"]
            return bases[base_index]
        return node.kwargs.get(name)
    normalized = normalize_function(
        op, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True
    )
    return normalized.kwargs[name] if normalized else None


def _layer_name(value: Any) -> str | None:
    """A layer name from a string constant or a hoisted vLLM ``LayerName`` placeholder."""
    if isinstance(value, str):
        return value
    if isinstance(value, fx.Node):
        value = value.meta.get("val", value.meta.get("example_value"))
    value = getattr(value, "real_obj", value)
    name = getattr(value, "value", None)
    return name if isinstance(name, str) else None


def _log_graph(name: str, graph: fx.Graph) -> None:
    """Log the graph's code at debug level; depyf dumps every graph logged this way."""
    if graph.owning_module is not None:
        logger.debug("%s", lazy_format_graph_code(name, graph.owning_module))


class SplitPrefillPass(CustomGraphPass):
    """Rewrite W4A16 MoE nodes into split nodes in graphs that may run uncaptured.

    ``settings`` None: read lazily from the current vLLM config's ``additional_config`` (or the
    defaults without vLLM). ``records`` lists what each call did; reset it with ``records.clear()``.
    """

    def __init__(self, settings: A4PrefillSettings | None = None) -> None:
        self.settings = settings
        self.records: list[PassRecord] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> SplitPrefillPass:
        # Configs holding the pass get deep-copied (vLLM does); keep one instance so that its
        # records stay where the user looks for them. The settings are immutable.
        return self

    def effective_settings(self) -> tuple[A4PrefillSettings, int]:
        """The settings in force and the captured limit (settings, else vLLM's, else 0)."""
        vllm_config = current_vllm_config()
        settings = self.settings
        if settings is None:
            settings = settings_from_vllm_config(vllm_config) if vllm_config else A4PrefillSettings()
        if legacy_threshold().enabled is False:
            settings = A4PrefillSettings(False, settings.captured_limit, settings.excluded_layers)
        limit = settings.captured_limit
        if limit is None:
            limit = vllm_captured_limit(vllm_config) if vllm_config else 0
        return settings, limit

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        """vLLM's pass-manager hook: rewrite only ranges that reach beyond the captured limit."""
        settings, limit = self.effective_settings()
        return settings.enabled and not TokenRange(int(compile_range.start), int(compile_range.end)).within(
            limit
        )

    def uuid(self) -> str:
        settings, limit = self.effective_settings()
        vllm_range = token_range.vllm_compile_range()
        state = {
            "source": hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest(),
            "settings": settings.as_dict(),
            "captured_limit": limit,
            "symbol_ranges": token_range.shape_env_ranges(),
            "compile_range": str(vllm_range) if vllm_range else None,
        }
        return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def _moe_nodes(graph: fx.Graph) -> list[_MoENode]:
        rewritable = {moe_ops.moe_w4a16, *vllm_ops.vllm_moe_ops().values()}
        split = {moe_ops.moe_split, *vllm_ops.registered_twins()}
        found = []
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            auto = node.target in _AUTO_FUNCTIONALIZED
            op = node.args[0] if auto else node.target
            if op in rewritable or op in split:
                hidden = _argument(node, op, "hidden_states", auto)
                name = _layer_name(_argument(node, op, "layer_name", auto))
                found.append(_MoENode(node, op, hidden, name, auto, already_split=op in split))
        return found

    def _graph_range(self, moe_nodes: list[_MoENode]) -> TokenRange:
        vllm_range = token_range.vllm_compile_range()
        if vllm_range is not None:
            return vllm_range
        return token_range.size_range(moe_nodes[0].hidden_states.meta["val"].shape[0])

    def __call__(self, graph: fx.Graph) -> None:
        moe_nodes = self._moe_nodes(graph)
        if not moe_nodes:
            return
        settings, limit = self.effective_settings()
        tokens = self._graph_range(moe_nodes)
        _log_graph("before_a4prefill_split_pass", graph)
        record = PassRecord(f"#{len(self.records)}", str(tokens), limit)
        for moe in moe_nodes:
            reason = self._reason_to_keep(moe, settings, tokens, limit)
            if reason is None:
                self._rewrite(moe)
                record.rewritten.append(moe.node.name)
            else:
                record.kept.append((moe.node.name, reason))
        if record.rewritten:
            graph.lint()
        _log_graph("after_a4prefill_split_pass", graph)
        self.records.append(record)
        logger.info("%s", record.summary())
        if record.rewritten:
            torch._logging.trace_structured(
                "artifact",
                metadata_fn=lambda: {"name": "a4prefill_split_pass", "encoding": "string"},
                payload_fn=lambda: record.summary(),
            )

    @staticmethod
    def _reason_to_keep(
        moe: _MoENode, settings: A4PrefillSettings, tokens: TokenRange, limit: int
    ) -> str | None:
        if moe.already_split:
            return "already split"
        if not settings.enabled:
            return "a4prefill disabled"
        if tokens.within(limit):
            return f"token range {tokens} within captured limit {limit}"
        if settings.excluded_layers:
            if moe.layer_name is None:
                return "layer name unknown while excluded_layers is set"
            if settings.is_layer_excluded(moe.layer_name):
                return f"layer {moe.layer_name} excluded"
        return None

    @staticmethod
    def _rewrite(moe: _MoENode) -> None:
        if moe.op is moe_ops.moe_w4a16:
            moe.node.target = moe_ops.moe_split
        elif moe.auto_functionalized:
            moe.node.args = (vllm_ops.split_twin(moe.op), *moe.node.args[1:])
        else:
            moe.node.target = vllm_ops.split_twin(moe.op)


def register_with_vllm() -> None:
    """Make :class:`SplitPrefillPass` a (virtual) vLLM ``InductorPass`` so vLLM's pass manager
    accepts it. Imports vLLM: only the vLLM plugin and vLLM tests call it."""
    from vllm.compilation.passes.inductor_pass import InductorPass

    InductorPass.register(SplitPrefillPass)


def inductor_options(split_pass: SplitPrefillPass | None = None) -> dict[str, Any]:
    """``torch.compile(..., options=inductor_options())`` runs the pass after Inductor's
    post-grad passes (default: the package's ``split_prefill_pass`` instance)."""
    from a4prefill import split_prefill_pass

    return {"post_grad_custom_post_pass": split_pass or split_prefill_pass}
