"""The post-grad pass that lets prefill rows run A4: W4A16 MoE nodes -> split nodes.

This pass is one of the three places that decide precision: *which graphs may run A4*. It
rewrites, per MoE node whose token range reaches beyond the captured limit:

- ``a4prefill::moe_w4a16`` -> ``a4prefill::moe_split`` (same arguments);
- an engine's opaque MoE op -> its split-enabled twin (:mod:`.rewrite_targets`; under vLLM
  ``auto_functionalized[_v2](vllm::moe_forward, ...)`` -> the same node around
  ``a4prefill::moe_forward_split``), registered by the integration in every process.

Invariants:

- The token range is decided per MoE node, from that node's ``hidden_states`` size (a static
  8-row node in a dynamic graph is its own range), intersected with the engine's compile range
  where the engine's integration provides one (:func:`.token_range.set_compile_range_source`;
  vLLM's pass manager compiles one graph per range). A node whose whole range fits in the captured limit keeps
  W4A16 (it may run inside a captured CUDA graph); so do layers matching ``excluded_layers``,
  every node while ``enabled`` is false, and nodes of prefill precision A4 whose A4 scale
  arguments are None (load time gave the layer none; the record says so). A node whose
  ``prefill_precision`` argument is ``'a8'`` needs no scales (A8 scales are dynamic); the pass
  keeps every argument, so the split node runs the precision load time passed.
- The captured limit is the user's ``captured_limit`` or the engine's (the widest captured graph
  of batches that may hold prefill rows, in the CUDA-graph modes that capture mixed batches; 0
  where only uniform decode is captured: ``vllm_integration.engine.captured_limit``).
  The split op's capture guard (W4A16 while a stream captures) is the second line of defence.
- The pass is idempotent, keeps ``meta['val']`` valid (the replacement has the same outputs)
  and installs no guards (ranges are read with ``bound_sympy``).
- ``uuid()`` covers the source of every module that decides what it rewrites
  (:data:`DECIDING_MODULES`), the resolved settings and the value ranges of the graph being
  compiled, so Inductor's and vLLM's caches never serve a graph rewritten under another
  decision. A graph loaded from a cache skips the pass (no record is added).

Settings: the constructor's, resolved by :func:`a4prefill.settings.resolve_settings` when the
pass runs. Under vLLM the plugin replaces the configured pass with
:meth:`SplitPrefillPass.for_engine`, a pass bound to that engine's settings as resolved once at
engine setup (the same object load time decides with, so the two cannot disagree); bound passes
share their parent's ``records``.

Usable as ``post_grad_custom_post_pass`` of plain torch.compile (see :func:`inductor_options`)
and, once the vLLM plugin registered it as a virtual ``InductorPass``, in vLLM's pass manager.
The vLLM and Inductor behaviour this relies on: docs/vllm-internals.md, sections 1 to 4.
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

from a4prefill.ops.precision import A8
from a4prefill.passes import rewrite_targets, token_range
from a4prefill.passes.token_range import TokenRange
from a4prefill.process_state import register_state
from a4prefill.settings import A4PrefillSettings, ResolvedSettings, resolve_settings

logger = logging.getLogger(__name__)

PASS_KEY = "post_grad_custom_post_pass"  # Inductor's option (and vLLM's inductor_passes key)
MAX_RECORDS = 1024  # a pass keeps the records of its newest graphs
# The modules whose code decides what the pass rewrites: uuid() hashes their source, so a change
# to any of them invalidates the graphs that compile caches hold
DECIDING_MODULES = (
    __name__,
    "a4prefill.passes.token_range",
    "a4prefill.passes.rewrite_targets",
    "a4prefill.settings",
)
DEFAULT_PASS = "a4prefill.split_prefill_pass"  # the package's instance, as vLLM's -cc names it

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
    node_ranges: dict[str, str] = field(default_factory=dict)

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
    without_a4_scales: bool  # prefill precision A4, a4 scale arguments None (load time gave none)


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
    return normalized.kwargs.get(name) if normalized else None


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
    """Rewrite W4A16 MoE nodes into split nodes where they may run uncaptured.

    ``settings``: the user's settings (None: all defaults), resolved when the pass runs (no
    engine: captured limit 0). ``records`` lists what each call did, the newest
    :data:`MAX_RECORDS` (shared with the passes bound from this one); reset it with
    ``records.clear()``.
    """

    def __init__(
        self, settings: A4PrefillSettings | None = None, *, records: list[PassRecord] | None = None
    ) -> None:
        self.settings = settings
        self.records: list[PassRecord] = [] if records is None else records
        self._engine_settings: ResolvedSettings | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> SplitPrefillPass:
        # Configs holding the pass get deep-copied (vLLM does); keep one instance so that its
        # records stay where the user looks for them. The settings are immutable.
        return self

    def for_engine(self, engine_settings: ResolvedSettings) -> SplitPrefillPass:
        """A pass bound to one engine's resolved settings (its captured limit included), sharing
        these records."""
        bound = SplitPrefillPass(records=self.records)
        bound._engine_settings = engine_settings
        return bound

    def resolved(self) -> ResolvedSettings:
        """The settings in force: the bound engine's, else the constructor's resolved now
        (:func:`a4prefill.settings.resolve_settings`, the one rule)."""
        if self._engine_settings is not None:
            return self._engine_settings
        return resolve_settings(self.settings or A4PrefillSettings())

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        """vLLM's pass-manager hook: True for every range. The pass decides per MoE node (the
        node's range within the compile range) and records what it kept and why, also for the
        ranges it leaves W4A16."""
        return True

    def uuid(self) -> str:
        engine_range = token_range.engine_compile_range()
        sources = "".join(inspect.getsource(sys.modules[name]) for name in DECIDING_MODULES)
        state = {
            "source": hashlib.sha256(sources.encode()).hexdigest(),
            "settings": self.resolved().as_dict(),
            "symbol_ranges": token_range.shape_env_ranges(),
            "compile_range": str(engine_range) if engine_range else None,
        }
        return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def _moe_nodes(graph: fx.Graph) -> list[_MoENode]:
        rewritable, split = rewrite_targets.rewritable_ops(), rewrite_targets.split_ops()
        found = []
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            auto = node.target in _AUTO_FUNCTIONALIZED
            op = node.args[0] if auto else node.target
            if op in rewritable or op in split:
                hidden = _argument(node, op, "hidden_states", auto)
                name = _layer_name(_argument(node, op, "layer_name", auto))
                names = [a.name for a in op._schema.arguments]
                scale_names = [n for n in names if n.startswith("a4_")]
                a8 = "prefill_precision" in names and _argument(node, op, "prefill_precision", auto) == A8
                unscaled = (
                    bool(scale_names)
                    and not a8
                    and all(_argument(node, op, n, auto) is None for n in scale_names)
                )
                found.append(_MoENode(node, op, hidden, name, auto, op in split, unscaled))
        return found

    @staticmethod
    def _node_range(moe: _MoENode, compile_range: TokenRange | None) -> TokenRange:
        own = token_range.size_range(moe.hidden_states.meta["val"].shape[0])
        if compile_range is None or own.lower == own.upper:
            return own
        return own.intersect(compile_range)

    def __call__(self, graph: fx.Graph) -> None:
        moe_nodes = self._moe_nodes(graph)
        if not moe_nodes:
            return
        settings = self.resolved()
        compile_range = token_range.engine_compile_range()
        ranges = {moe.node.name: self._node_range(moe, compile_range) for moe in moe_nodes}
        distinct = sorted({str(r) for r in ranges.values()})
        _log_graph("before_a4prefill_split_pass", graph)
        record = PassRecord(
            f"#{len(self.records)}",
            distinct[0] if len(distinct) == 1 else ", ".join(distinct),
            settings.captured_limit,
            node_ranges={name: str(r) for name, r in ranges.items()},
        )
        for moe in moe_nodes:
            reason = self._reason_to_keep(moe, settings, ranges[moe.node.name])
            if reason is None:
                self._rewrite(moe)
                record.rewritten.append(moe.node.name)
            else:
                record.kept.append((moe.node.name, reason))
        if record.rewritten:
            graph.lint()
        _log_graph("after_a4prefill_split_pass", graph)
        self.records.append(record)
        del self.records[:-MAX_RECORDS]
        logger.info("%s", record.summary())
        if record.rewritten:
            torch._logging.trace_structured(
                "artifact",
                metadata_fn=lambda: {"name": "a4prefill_split_pass", "encoding": "string"},
                payload_fn=lambda: record.summary(),
            )

    @staticmethod
    def _reason_to_keep(moe: _MoENode, settings: ResolvedSettings, tokens: TokenRange) -> str | None:
        if moe.already_split:
            return "already split"
        if not settings.enabled:
            return "a4prefill disabled"
        if tokens.within(settings.captured_limit):
            return f"token range {tokens} within captured limit {settings.captured_limit}"
        if settings.excluded_layers:
            if moe.layer_name is None:
                return "layer name unknown while excluded_layers is set"
            pattern = settings.excluded_by(moe.layer_name)
            if pattern is not None:
                return f"layer {moe.layer_name} excluded by {pattern!r}"
        if moe.without_a4_scales:
            return "layer has no A4 scales"
        return None

    @staticmethod
    def _rewrite(moe: _MoENode) -> None:
        twin = rewrite_targets.split_twin(moe.op)
        if moe.auto_functionalized:
            moe.node.args = (twin, *moe.node.args[1:])
        else:
            moe.node.target = twin


split_prefill_pass = SplitPrefillPass()
"""The package's instance (``a4prefill.split_prefill_pass``, what vLLM's ``-cc`` names); its records
are process state (:mod:`a4prefill.process_state`)."""
register_state(__name__, split_prefill_pass.records.clear, split_prefill_pass.records)


def inductor_options(split_pass: SplitPrefillPass | None = None) -> dict[str, Any]:
    """``torch.compile(..., options=inductor_options())`` runs the pass after Inductor's
    post-grad passes (default: the package's ``split_prefill_pass`` instance)."""
    return {PASS_KEY: split_pass or split_prefill_pass}
