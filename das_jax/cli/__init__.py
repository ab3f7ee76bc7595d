"""The `das-jax` command.

Every command lives in this package, the top floor of the code: no library module imports it. A
module listed in `_COMMAND_MODULES` exposes `register(subparsers)`, which adds its parsers and sets
`func` (called with the parsed args, returning an exit code). Registration must not import jax, so
`das-jax --help` stays fast.

Errors: every subcommand runs under one handler. A user error (`das_jax.errors`: a bad config,
model source, dataset or run directory, a corrupt checkpoint, a full disk, ...) and a bad
command-line argument end in one line on stderr, `das-jax <command>: error: <message>`, and exit
code 2; anything else is a bug and keeps its traceback. `DAS_JAX_DEBUG=1` shows the traceback of
user errors too.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from das_jax.errors import user_error_message

_COMMAND_MODULES = (
    "das_jax.cli.models",     # models, model-info
    "das_jax.cli.generate",   # generate
    "das_jax.cli.train",      # train, samples, compare
    "das_jax.cli.bench",      # bench engine|drafter|rollout|replay|main-job
    "das_jax.cli.plan",       # plan
    "das_jax.cli.export",     # export
    "das_jax.cli.draft_head", # draft-head fit
)


def _unshown(default) -> bool:
    return default is None or default is False or default == []


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, unless it is None / False, the option is a flag
    (`--x` / `--no-x`: "default: True" would not say which way it is on), or the help already
    names it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (_unshown(action.default) or action.default == argparse.SUPPRESS
                or action.nargs == 0 or "default" in text):
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults and whose errors are one line
    (`PROG: error: MESSAGE (see PROG --help)`, exit code 2) instead of the usage block plus the
    error; every subcommand's parser inherits the class."""

    def __init__(self, *args, formatter_class=_HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def add_argument(self, *args, **kwargs):
        if kwargs.get("help") is None and not _unshown(kwargs.get("default")):
            kwargs["help"] = "default: %(default)s"   # an option without help still shows it
        return super().add_argument(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    prog = _prog(args)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (Exception, SystemExit) as e:  # noqa: BLE001 - classified below; bugs are re-raised
        if isinstance(e, SystemExit) and not isinstance(e.code, str):
            raise
        message = user_error_message(e)
        if message is None or os.environ.get("DAS_JAX_DEBUG", "") not in ("", "0"):
            raise
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2


def _prog(args: argparse.Namespace) -> str:
    words = ["das-jax"] + [getattr(args, k) for k in ("command", "bench_command",
                                                      "draft_head_command")
                           if getattr(args, k, None)]
    return " ".join(words)

