"""``python -m a4prefill <command>``: the package's command line."""

from __future__ import annotations

import argparse
import sys

from a4prefill.tools.arguments import (
    at_least,
    comma_list,
    device,
    fraction,
    json_object,
    positive_float,
    size_specs,
)

DEFAULT_SIZES = "8,512,2:256,2:8192"  # inspect --sizes
DEFAULT_CAPTURED_LIMIT = 256  # inspect --captured-limit


def _demo(args: argparse.Namespace) -> int:
    from a4prefill.tools.demo import format_table, run_demo

    print(
        "a4prefill demo: random NVFP4 MoE layer (E=8, H=256, I=128, top-2), "
        f"{args.tokens} tokens, {args.device}"
    )
    print(format_table(run_demo(tokens=args.tokens, seed=args.seed, device=args.device)))
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from a4prefill.tools.tiny_model import make_tiny_model

    print(f"wrote {make_tiny_model(args.directory)}")
    return 0


def _audit(args: argparse.Namespace) -> int:
    from a4prefill.tools.audit import audit

    try:
        report = audit(args.logs)
    except (OSError, ValueError, KeyError) as error:  # a missing, unreadable or malformed log
        print(f"a4prefill audit: cannot read the logs: {error!r}", file=sys.stderr)
        return 2
    print(report.summary())
    if not report.steps:
        print("a4prefill audit: the logs hold no step record: nothing was checked", file=sys.stderr)
        return 2
    return 1 if report.violations else 0


def _e2e(args: argparse.Namespace) -> int:
    from a4prefill.tools.e2e import run_e2e_cli

    return run_e2e_cli(args)


def _inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.model is not None:
        from a4prefill.tools.inspect_engine import format_inspection, inspect_engine

        print(format_inspection(inspect_engine(args.model, Path(args.out), args.vllm_args)))
        return 0
    if args.vllm_args:
        raise SystemExit(f"unknown arguments {args.vllm_args} (vLLM arguments need --model)")
    from a4prefill.tools.inspect_graphs import format_rows, inspect_model

    print(f"a4prefill inspect: built-in 2-block NVFP4 MoE model, captured limit {args.captured_limit}")
    print(format_rows(inspect_model(Path(args.out), args.sizes, args.captured_limit)))
    return 0


def _numerics(args: argparse.Namespace) -> int:
    from pathlib import Path

    from a4prefill.tools.numerics.report import format_table, write_outputs
    from a4prefill.tools.numerics.run import run_numerics
    from a4prefill.tools.parallelism import Parallelism

    report = run_numerics(
        Path(args.checkpoint) if args.checkpoint else None,
        Path(args.prompts) if args.prompts else None,
        device=args.device,
        max_tokens_per_layer=args.max_tokens_per_layer,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        exclude_factor=args.exclude_factor,
        parallelism=Parallelism.from_arguments(args),
    )
    print(format_table(report))
    written = write_outputs(report, Path(args.out))
    print("wrote " + ", ".join(str(path) for path in written.values()))
    if "png" not in written:
        print("no plot: matplotlib is not installed (pip install -e '.[numerics]')")
    return 0


def _b12x_compile(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from a4prefill.tools.b12x_compile import SHAPES, compile_layer, format_report, placeholder_layer, report

    results = []
    for shape in args.shape:
        experts, hidden, intermediate, top_k = SHAPES[shape]
        weights, scales = placeholder_layer(experts, hidden, intermediate)
        for arch in args.arch:
            print(
                f"b12x kernels of the {shape} layer (E={experts} H={hidden} I={intermediate} top-{top_k}), "
                f"calls of up to {args.max_tokens} tokens, compiled for {arch}:",
                flush=True,
            )
            compilations = compile_layer(weights, scales, top_k, args.max_tokens, arch, workers=args.workers)
            print(format_report(compilations), flush=True)
            results.append(
                {"shape": shape, "arch": arch, "max_tokens": args.max_tokens, **report(compilations)}
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0


def _add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's parallel arguments, as ``vllm serve`` spells them (``tools.parallelism``)."""
    parser.add_argument(
        "--tensor-parallel-size", "-tp", type=at_least(1), default=1, help="vLLM workers (mp executor)"
    )
    parser.add_argument(
        "--enable-expert-parallel", action="store_true", help="experts split over the workers (vLLM's EP)"
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=at_least(1),
        default=1,
        help="must be 1: the tools drive one engine",
    )


def build_parser() -> argparse.ArgumentParser:
    from a4prefill.passes.split_prefill import DEFAULT_PASS
    from a4prefill.tools.b12x_compile import SHAPES, TARGETS
    from a4prefill.tools.e2e import PROMPT_SETS

    parser = argparse.ArgumentParser(prog="a4prefill", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a random NVFP4 MoE layer through the ops; print numerics")
    demo.add_argument("--tokens", type=at_least(1), default=96, help="rows of the call (a quarter decode)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random layer and activations")
    demo.add_argument("--device", type=device, default="cpu", help="where the ops run (cpu, cuda)")
    demo.set_defaults(handler=_demo)
    tiny = commands.add_parser("make-tiny-model", help="write a tiny random NVFP4 Qwen3-MoE checkpoint")
    tiny.add_argument("directory")
    tiny.set_defaults(handler=_make_tiny_model)
    e2e = commands.add_parser("e2e", help="run the tiny model on vLLM; print rows per step kind")
    e2e.add_argument("--model", default=None, help="checkpoint dir (default: a built-in model, --shape)")
    e2e.add_argument(
        "--shape",
        choices=("tiny", "real"),
        default=None,
        help="the built-in model's sizes (not with --model): tiny (hidden 128, 8 experts; the default), "
        "or real (hidden 2048, intermediate 768, 64 experts, top-8: reaches the triton backend's decode "
        "and tiled kernels)",
    )
    e2e.add_argument(
        "--jit-monitor-mode",
        choices=("warn", "error"),
        default="warn",
        help="vLLM's --jit-monitor-mode: error fails a step that compiles a kernel after warm-up",
    )
    e2e.add_argument(
        "--pass",
        dest="split_pass",
        default=None,
        help=f"the split pass, as -cc names it (default {DEFAULT_PASS}; not with --no-pass)",
    )
    e2e.add_argument("--no-pass", action="store_true", help="run without the split pass")
    e2e.add_argument("--json", default=None, help="also write the full result as JSON here")
    e2e.add_argument(
        "--additional-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help="a4prefill settings as a JSON object, what --additional-config's a4prefill entry holds",
    )
    e2e.add_argument(
        "--compilation-config",
        "-cc",
        type=json_object,
        default=None,
        metavar="JSON",
        help="vLLM's -cc, as a JSON object",
    )
    e2e.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help="vLLM's speculative config, as a JSON object",
    )
    e2e.add_argument(
        "--compile-cache", action="store_true", help="keep vLLM's default compile cache on (VLLM_CACHE_ROOT)"
    )
    e2e.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="default", help="second prompt group")
    e2e.add_argument("--steps", action="store_true", help="also print one line per engine step")
    _add_parallel_arguments(e2e)
    e2e.set_defaults(handler=_e2e)
    numerics = commands.add_parser(
        "numerics", help="per-layer A4 vs W4A16 numerics of a ModelOpt NVFP4 MoE checkpoint"
    )
    numerics.add_argument(
        "checkpoint", nargs="?", default=None, help="checkpoint dir (default: built-in tiny model)"
    )
    numerics.add_argument(
        "--prompts", default=None, help="a text file, one prompt per line (default: built-in set)"
    )
    numerics.add_argument("--out", default="a4prefill-numerics", help="folder for numerics.{json,csv,png}")
    numerics.add_argument(
        "--device", type=device, default="cpu", help="where the layers are measured (cpu, cuda)"
    )
    numerics.add_argument(
        "--max-tokens-per-layer", type=at_least(1), default=4096, help="captured input rows per layer"
    )
    numerics.add_argument("--max-model-len", type=at_least(1), default=1024, help="vLLM's --max-model-len")
    numerics.add_argument(
        "--gpu-memory-utilization", type=fraction, default=0.3, help="vLLM's --gpu-memory-utilization"
    )
    numerics.add_argument(
        "--exclude-factor", type=positive_float, default=2.0, help="suggest layers above this x the median"
    )
    _add_parallel_arguments(numerics)
    numerics.set_defaults(handler=_numerics)
    inspect = commands.add_parser(
        "inspect",
        help="show which graphs the pass rewrote: of a vLLM run (--model DIR [vLLM args]) or of the "
        "built-in model under depyf",
    )
    inspect.add_argument(
        "--model", default=None, help="a checkpoint to serve with vLLM (extra args go to vLLM)"
    )
    inspect.add_argument(
        "--sizes",
        type=size_specs,
        default=None,
        help=f"the built-in model's graphs (not with --model): comma list of N (static) or LO:HI "
        f"(default {DEFAULT_SIZES})",
    )
    inspect.add_argument(
        "--captured-limit",
        type=at_least(0),
        default=None,
        help=f"the built-in model's captured limit (not with --model; default {DEFAULT_CAPTURED_LIMIT})",
    )
    inspect.add_argument("--out", default="a4prefill-dump", help="dump folder (one sub-folder per graph)")
    inspect.set_defaults(handler=_inspect)
    b12x = commands.add_parser(
        "b12x-compile",
        help="compile the b12x backend's kernels for SM120/SM121 without that GPU (b12x's compile pool)",
    )
    b12x.add_argument(
        "--arch",
        type=comma_list(list(TARGETS)),
        default=["sm_120a", "sm_121a"],
        help="comma list of sm_120a, sm_121a",
    )
    b12x.add_argument(
        "--shape",
        type=comma_list(list(SHAPES)),
        default=["tiny", "glm-tp2"],
        help="comma list of tiny, glm-tp2",
    )
    b12x.add_argument("--max-tokens", type=at_least(1), default=8192, help="the backend's call capacity")
    b12x.add_argument("--workers", type=at_least(1), default=1, help="b12x compile processes")
    b12x.add_argument("--json", default=None, help="also write the programs and timings as JSON here")
    b12x.set_defaults(handler=_b12x_compile)
    audit = commands.add_parser(
        "audit",
        help="check the rule on audit logs of precision (the row_log setting); exit 1 on a violation, "
        "2 when the logs cannot be read or hold no step",
    )
    audit.add_argument("logs", nargs="+", help="log files, or the row_log setting (reads <row_log>.rank*)")
    audit.set_defaults(handler=_audit)
    for command, subparser in commands.choices.items():
        subparser.set_defaults(command_parser=subparser, command_name=command)
    return parser


def _check_combinations(args: argparse.Namespace) -> None:
    """Refuse options given together that cannot both apply, and fill the defaults of those that
    apply only without another (``parser.error`` of the command: exit 2 naming the options)."""
    from a4prefill.passes.split_prefill import DEFAULT_PASS

    error = args.command_parser.error
    if args.command == "e2e":
        if args.model is not None and args.shape is not None:
            error("--shape picks a built-in model: not with --model")
        if args.no_pass and args.split_pass is not None:
            error("--pass names the split pass: not with --no-pass")
        args.shape = args.shape or "tiny"
        args.split_pass = None if args.no_pass else args.split_pass or DEFAULT_PASS
    if args.command == "inspect":
        if args.model is not None and (args.sizes is not None or args.captured_limit is not None):
            error("--sizes and --captured-limit are the built-in model's: not with --model")
        args.sizes = args.sizes or DEFAULT_SIZES.split(",")
        args.captured_limit = DEFAULT_CAPTURED_LIMIT if args.captured_limit is None else args.captured_limit
    if args.command in ("e2e", "numerics"):
        from a4prefill.tools.parallelism import Parallelism

        try:
            Parallelism.from_arguments(args)
        except ValueError as problem:
            error(f"--data-parallel-size: {problem}")


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.command != "inspect" and rest:
        build_parser().parse_args(argv)  # the usual error for unknown arguments
    _check_combinations(args)
    args.vllm_args = rest
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
