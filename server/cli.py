"""`siesta`: the command line. Subcommands: `demo-model DIR` writes the embedded tiny checkpoint."""

from __future__ import annotations

import argparse
import sys


def _demo_model(args: argparse.Namespace) -> int:
    from engine.demo_model import create_demo_model

    path = create_demo_model(args.dir, seed=args.seed)
    print(f"demo model (tiny random Qwen3 with a local tokenizer) written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="siesta", description="Siesta: an LLM server for RL rollouts")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo-model", help="write a tiny random Qwen3 checkpoint with a tokenizer")
    demo.add_argument("dir", help="directory to write")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
