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
    "das_jax.rl.cli",         # train, samples, compare
    "das_jax.bench.cli",      # bench engine|drafter|rollout|replay
)


def _unshown(default) -> bool:
    return default is None or default is False or default == []


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, unless it is None / False or the help already
    names it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if _unshown(action.default) or action.default == argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults (passed on to every subcommand's parser)."""

    def __init__(self, *args, formatter_class=_HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def add_argument(self, *args, **kwargs):
        if kwargs.get("help") is None and not _unshown(kwargs.get("default")):
            kwargs["help"] = "default: %(default)s"   # an option without help still shows it
        return super().add_argument(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
