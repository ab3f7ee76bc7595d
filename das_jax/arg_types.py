"""argparse `type=` converters with messages that say what is expected.

argparse prefixes the message with the flag (`argument --draft-widths: ...`), so an error such as
`--draft-widths abc` reads `argument --draft-widths: 'abc' is not a comma-separated list of
positive ints (e.g. 1,4,8)`. No jax import.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Sequence

from das_jax.errors import UserError


def _int(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An int >= `minimum`."""
    what = {0: "an int >= 0", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")

    def convert(text: str) -> int:
        return _int(text, minimum, what)
    convert.__name__ = "int"
    return convert


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def int_list(minimum: int = 1, example: str = "1,4,8", *, as_text: bool = False
             ) -> Callable[[str], tuple[int, ...] | str]:
    """A non-empty comma-separated list of ints >= `minimum`, as a tuple (`as_text`: checked,
    then returned as the original text)."""
    kind = "positive ints" if minimum == 1 else f"ints >= {minimum}"
    what = f"a comma-separated list of {kind} (e.g. {example})"

    def convert(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(t) for t in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return text if as_text else values
    convert.__name__ = "int list"
    return convert


def float_list(example: str = "0.6,1.0", *, minimum: float | None = None,
               as_text: bool = False) -> Callable[[str], tuple[float, ...] | str]:
    """A non-empty comma-separated list of finite floats (each >= `minimum` if given), as a tuple
    (`as_text`: checked, then returned as the original text)."""
    bound = "" if minimum is None else f" >= {minimum:g}"
    what = f"a comma-separated list of numbers{bound} (e.g. {example})"

    def convert(text: str) -> tuple[float, ...] | str:
        try:
            values = tuple(float(t) for t in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not all(math.isfinite(v) and (minimum is None or v >= minimum) for v in values):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return text if as_text else values
    convert.__name__ = "float list"
    return convert


def name_list(choices: Sequence[str] | Callable[[], Sequence[str]], *, as_text: bool = False
              ) -> Callable[[str], tuple[str, ...] | str]:
    """A non-empty comma-separated list of names from `choices` (or from `choices()`, called
    when an argument is converted, for lists that are costly to import), as a tuple (`as_text`:
    checked, then returned as the original text)."""
    def convert(text: str) -> tuple[str, ...] | str:
        nonlocal choices
        if callable(choices):
            choices = tuple(choices())
        names = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{(bad[0] if bad else text)!r} is not one of {', '.join(choices)} (give a "
                "comma-separated list of them)")
        return text if as_text else names
    convert.__name__ = "name list"
    return convert


def set_type(parser: argparse.ArgumentParser, flag: str, type_: Callable) -> None:
    """Gives the already-added option `flag` of `parser` the converter `type_` (for options
    defined by modules that leave them as plain strings)."""
    parser._option_string_actions[flag].type = type_  # noqa: SLF001 - argparse's own table


def check_output_file(path: str, flag: str, example: str) -> None:
    """Refuses, before any work, an output file path that cannot be written: a directory, a
    missing or unwritable parent directory, or a directory where its temporary file
    (PATH.tmp*, written and then renamed onto PATH) would go.

    Raises:
      UserError: naming `flag`, the path and the fix (`example`: a file name to suggest)."""
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a directory; give a file path, e.g. "
                        f"{os.path.join(path, example)}")
    out_dir = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(out_dir):
        raise UserError(f"{flag} {path}: directory {out_dir} does not exist; create it first or "
                        "choose another path")
    if not os.access(out_dir, os.W_OK):
        raise UserError(f"{flag} {path}: directory {out_dir} is not writable; choose another "
                        "path")
    if os.path.isdir(f"{path}.tmp"):
        raise UserError(f"{flag} {path}: {path}.tmp (its temporary file) is a directory; "
                        "remove it or choose another path")
