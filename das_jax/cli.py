"""The `das-jax` command.

Each subcommand lives next to the code it drives: a module listed in `_COMMAND_MODULES` exposes
`register(subparsers)`, which adds its parsers and sets `func` (called with the parsed args,
returning an exit code). Registration must not import jax, so `das-jax --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

_COMMAND_MODULES = (
    "das_jax.models.cli",     # models, model-info
    "das_jax.engine.cli",     # generate
    "das_jax.rl.cli",         # train
    "das_jax.bench.cli",      # bench engine|drafter|rollout|replay
    "das_jax.plan",           # plan
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="das-jax",
        description="Distribution-aware speculative decoding for RL rollouts, with GRPO training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
