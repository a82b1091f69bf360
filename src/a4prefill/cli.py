"""``python -m a4prefill <command>``: the package's command line."""

from __future__ import annotations

import argparse
import sys


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

    report = audit(args.logs)
    print(report.summary())
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

    specs = [spec for spec in args.sizes.split(",") if spec]
    print(f"a4prefill inspect: built-in 2-block NVFP4 MoE model, captured limit {args.captured_limit}")
    print(format_rows(inspect_model(Path(args.out), specs, args.captured_limit)))
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
    for shape in args.shape.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shape: unknown shape {shape!r}; expected some of {sorted(SHAPES)}")
        experts, hidden, intermediate, top_k = SHAPES[shape]
        weights, scales = placeholder_layer(experts, hidden, intermediate)
        for arch in args.arch.split(","):
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
        "--tensor-parallel-size", "-tp", type=int, default=1, help="vLLM workers (mp executor)"
    )
    parser.add_argument(
        "--enable-expert-parallel", action="store_true", help="experts split over the workers (vLLM's EP)"
    )
    parser.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1, help="must be 1: the tools drive one engine"
    )


def build_parser() -> argparse.ArgumentParser:
    from a4prefill.tools.e2e import PROMPT_SETS

    parser = argparse.ArgumentParser(prog="a4prefill", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a random NVFP4 MoE layer through the ops; print numerics")
    demo.add_argument("--tokens", type=int, default=96)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu")
    demo.set_defaults(handler=_demo)
    tiny = commands.add_parser("make-tiny-model", help="write a tiny random NVFP4 Qwen3-MoE checkpoint")
    tiny.add_argument("directory")
    tiny.set_defaults(handler=_make_tiny_model)
    e2e = commands.add_parser("e2e", help="run the tiny model on vLLM; print rows per step kind")
    e2e.add_argument("--model", default=None, help="checkpoint dir (default: a built-in model, --shape)")
    e2e.add_argument(
        "--shape",
        choices=("tiny", "real"),
        default="tiny",
        help="the built-in model's sizes: tiny (hidden 128, 8 experts), or real (hidden 2048, "
        "intermediate 768, 64 experts, top-8: reaches the triton backend's decode and tiled kernels)",
    )
    e2e.add_argument(
        "--jit-monitor-mode",
        choices=("warn", "error"),
        default="warn",
        help="vLLM's --jit-monitor-mode: error fails a step that compiles a kernel after warm-up",
    )
    e2e.add_argument("--pass", dest="split_pass", default="a4prefill.split_prefill_pass")
    e2e.add_argument("--no-pass", action="store_true", help="run without the split pass")
    e2e.add_argument("--json", default=None, help="also write the full result as JSON here")
    e2e.add_argument(
        "--additional-config",
        default=None,
        metavar="JSON",
        help="a4prefill settings as JSON, what --additional-config's a4prefill entry holds",
    )
    e2e.add_argument("--compilation-config", default=None, metavar="JSON", help="vLLM's -cc, as JSON")
    e2e.add_argument("--speculative-config", default=None, metavar="JSON", help="vLLM's speculative config")
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
    numerics.add_argument("--device", default="cpu", help="where the layers are measured (cpu, cuda)")
    numerics.add_argument("--max-tokens-per-layer", type=int, default=4096)
    numerics.add_argument("--max-model-len", type=int, default=1024)
    numerics.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    numerics.add_argument(
        "--exclude-factor", type=float, default=2.0, help="suggest layers above this x the median"
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
    inspect.add_argument("--sizes", default="8,512,2:256,2:8192", help="comma list of N (static) or LO:HI")
    inspect.add_argument("--captured-limit", type=int, default=256)
    inspect.add_argument("--out", default="a4prefill-dump", help="dump folder (one sub-folder per graph)")
    inspect.set_defaults(handler=_inspect)
    b12x = commands.add_parser(
        "b12x-compile",
        help="compile the b12x backend's kernels for SM120/SM121 without that GPU (b12x's compile pool)",
    )
    b12x.add_argument("--arch", default="sm_120a,sm_121a", help="comma list of sm_120a, sm_121a")
    b12x.add_argument("--shape", default="tiny,glm-tp2", help="comma list of tiny, glm-tp2")
    b12x.add_argument("--max-tokens", type=int, default=8192, help="the backend's call capacity")
    b12x.add_argument("--workers", type=int, default=1, help="b12x compile processes")
    b12x.add_argument("--json", default=None, help="also write the programs and timings as JSON here")
    b12x.set_defaults(handler=_b12x_compile)
    audit = commands.add_parser(
        "audit", help="check the rule on audit logs of precision (the row_log setting); exit 1 on a violation"
    )
    audit.add_argument("logs", nargs="+", help="log files, or the row_log setting (reads <row_log>.rank*)")
    audit.set_defaults(handler=_audit)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.command != "inspect" and rest:
        build_parser().parse_args(argv)  # the usual error for unknown arguments
    args.vllm_args = rest
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
