"""``python -m a4prefill <command>``: the package's command line."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from a4prefill.demo import format_table, run_demo

    print(
        "a4prefill demo: random NVFP4 MoE layer (E=8, H=256, I=128, top-2), "
        f"{args.tokens} tokens, {args.device}"
    )
    print(format_table(run_demo(tokens=args.tokens, seed=args.seed, device=args.device)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="a4prefill", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a random NVFP4 MoE layer through the ops; print numerics")
    demo.add_argument("--tokens", type=int, default=96)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
