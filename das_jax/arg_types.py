"""argparse `type=` converters with messages that say what is expected.

argparse prefixes the message with the flag (`argument --draft-widths: ...`), so an error such as
`--draft-widths abc` reads `argument --draft-widths: 'abc' is not a comma-separated list of
positive ints (e.g. 1,4,8)`. No jax import.
"""
from __future__ import annotations

import argparse
from typing import Callable


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


def float_list(example: str = "0.6,1.0") -> Callable[[str], tuple[float, ...]]:
    """A non-empty comma-separated list of floats, as a tuple."""
    what = f"a comma-separated list of numbers (e.g. {example})"

    def convert(text: str) -> tuple[float, ...]:
        items = [t.strip() for t in text.split(",")]
        try:
            return tuple(float(t) for t in items)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    convert.__name__ = "float list"
    return convert
