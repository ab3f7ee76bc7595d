"""Exact numbers in math answers: `parse_number` reads a whole string as one number (an exact
`Fraction`: ``18``, ``-3``, ``1,000``, ``$1,234.50``, ``25\\%``, ``\\frac{1}{2}``, ``-7/2``) or
gives None, and `normalize_number` writes one back in its shortest exact form. The numeric
fallback of `das_jax.rl.rewards.math_reward` compares these values; nothing here guesses a
number out of text that is not one."""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["parse_number", "normalize_number", "strip_wrappers"]

#: longest digit string the numeric fallback converts (Python refuses int(str) beyond 4300 digits).
_MAX_DIGITS = 4000

# One number as a whole string (after strip_wrappers): sign, optional currency sign on either
# side of the sign, then digits with strict thousands grouping ("1,000", "1{,}000") or plain
# digits, optional decimals; a bare trailing "." (sentence end) is allowed; optional percent sign.
_SIGN = r"(?P<sign>[-+\u2212]?)"
_CUR = r"(?:\\?\$\s*)?"
_BODY = (r"(?P<body>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d{1,3}(?:\{,\}\d{3})+(?:\.\d+)?"
         r"|\d+(?:\.\d+)?|\.\d+)")
_DECIMAL_RE = re.compile(rf"{_CUR}{_SIGN}\s*{_CUR}{_BODY}\.?\s*(?P<pct>\\?%)?")
_INT = r"\d{1,%d}" % _MAX_DIGITS
_FRAC_RE = re.compile(
    rf"(?P<sign>[-+\u2212]?)\s*(?:\\[dt]?frac\s*\{{\s*(?P<n1>-?{_INT})\s*\}}\s*\{{\s*(?P<d1>-?{_INT})\s*\}}"
    rf"|\\[dt]?frac(?P<n2>\d)(?P<d2>\d)|(?P<n3>{_INT})\s*/\s*(?P<d3>{_INT}))"
)
_WRAP_RE = re.compile(r"^\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{(?P<inner>[^{}]*)\}$")


def strip_wrappers(s: str) -> str:
    """Drop what surrounds a whole answer without changing it: whitespace, ``$...$``,
    ``\\(...\\)``, ``\\[...\\]``, ``\\text{...}``-style wrappers, one trailing ``.``."""
    prev = None
    while s != prev:
        prev = s
        s = s.strip()
        for a, b in (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(s) > len(a) + len(b) and s.startswith(a) and s.endswith(b):
                s = s[len(a): -len(b)]
        # "$18$" is math mode, "$18" a currency sign: only strip a matching pair
        if len(s) > 2 and s[0] == "$" and s[-1] == "$" and s.count("$") == 2:
            s = s[1:-1]
        m = _WRAP_RE.match(s)
        if m:
            s = m.group("inner")
        if s.endswith("\\text{.}"):
            s = s[: -len("\\text{.}")]
        if s.endswith(".") and not s.endswith(".."):
            s = s[:-1]
    return s


def parse_number(text: str) -> Fraction | None:
    """The exact value of ``text`` if the whole of it is one number, else None.

    Accepted: integers and decimals with optional sign (``-``, ``+``, ``\u2212``), strict
    thousands grouping (``1,000,000``, ``1{,}000``), currency sign (``$12``, ``\\$12``, ``-$3``),
    percent sign (``25%`` is 25: the percent sign is dropped, as math-verify accepts ``25\\%``
    for both 25 and 0.25), a trailing period, ``.5``, fractions of integers (``\\frac{1}{2}``,
    ``\\dfrac12``, ``-7/2``), and all of these wrapped in ``$...$``, ``\\(...\\)`` or
    ``\\text{...}``. Anything else -- a second number, an operator, a word, a unit, a list, an
    interval, a space inside the digits, more than 4000 digits -- gives None. Never raises.

    Returns:
        ``fractions.Fraction`` (exact) or None.
    """
    if not isinstance(text, str) or len(text) > 3 * _MAX_DIGITS:
        return None
    s = strip_wrappers(text)
    try:
        m = _DECIMAL_RE.fullmatch(s)
        if m:
            body = m.group("body").replace("{,}", "").replace(",", "")
            if len(body) > _MAX_DIGITS:
                return None
            v = Fraction(body)
            return -v if m.group("sign") in ("-", "\u2212") else v
        m = _FRAC_RE.fullmatch(s)
        if m:
            n = m.group("n1") or m.group("n2") or m.group("n3")
            d = m.group("d1") or m.group("d2") or m.group("d3")
            if int(d) == 0:
                return None
            v = Fraction(int(n), int(d))
            return -v if m.group("sign") in ("-", "\u2212") else v
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def normalize_number(v: Fraction) -> str:
    """``Fraction(1234)`` -> ``"1234"``, ``Fraction(5, 2)`` -> ``"2.5"``, ``Fraction(1, 3)`` -> ``"1/3"``."""
    if v.denominator == 1:
        return str(v.numerator)
    d = v.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d != 1:  # not a terminating decimal
        return f"{v.numerator}/{v.denominator}"
    k = 0
    while (v * 10**k).denominator != 1:
        k += 1
    n = v * 10**k
    sign = "-" if n < 0 else ""
    digits = str(abs(n.numerator)).rjust(k + 1, "0")
    return f"{sign}{digits[:-k]}.{digits[-k:]}"
