"""Math rewards: answer accuracy (math-verify + an exact numeric fallback) and answer format.

How a completion is graded (:func:`math_answer_correct`):

1. The *final-answer region* is located (:func:`extract_answer_region`): the last final answer
   the completion gives -- the rest of the line after the last ``####`` or the content of the
   last complete ``\\boxed{}``, whichever comes later (a completion that corrects itself,
   ``#### 3 ... \\boxed{5}``, is graded on ``5``); without either marker, the whole completion.
2. Exact numeric fallback: only when the *whole* region is one number
   (:func:`parse_number`: ``18``, ``-3``, ``1,000``, ``$1,234.50``, ``\\$18``, ``25\\%``, ``18.``,
   ``.5``, ``\\frac{1}{2}``, ``-7/2``, ``\\text{18}``) and the gold is one number too, the two
   are compared as exact rationals (no tolerance: ``17.9999`` is not ``18``). A number is never
   pulled out of a region that is not itself a number: ``4\\sqrt{2}``, ``3 \\cdot 7``,
   ``3 or 4``, ``3, 4``, ``[3, 4]`` and ``18 dollars`` are left to math-verify.
3. Normalised string equality of region and gold (whitespace around operators, ``\\left``/
   ``\\right``, ``\\!``/``\\,``, ``dfrac``; digits separated by a space stay separated).
4. math-verify (``parse`` + ``verify``) on the region wrapped in ``$...$`` (whole completion when
   there is no marker), main thread only (its timeouts use SIGALRM).

Steps 2 and 3 only ever accept what math-verify also accepts (a property test checks this); they
make the common case fast and keep grading off the main thread possible.
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction
from typing import Any, Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "math_accuracy_reward",
    "format_reward",
    "math_answer_correct",
    "extract_final_number",
    "extract_answer_region",
    "parse_number",
]

_FORMAT_HASH_RE = re.compile(r"####\s*\$?\s*-?\d[\d,]*(?:\.\d+)?")
_FORMAT_BOXED_RE = re.compile(r"\\boxed\s*\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")

#: seconds math-verify may spend parsing / comparing one answer (signal-based, main thread only).
MATH_VERIFY_TIMEOUT_S = 3

#: longest digit string the numeric fallback converts (Python refuses int(str) beyond 4300 digits).
_MAX_DIGITS = 4000

# One number as a whole string (after _strip_wrappers): sign, optional currency sign on either
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


def _strip_wrappers(s: str) -> str:
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
    s = _strip_wrappers(text)
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


def _normalize_number(v: Fraction) -> str:
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


_MD_WRAP_RE = re.compile(r"^(\*\*|__|\*|_)(?P<inner>[^*_]+)\1$")


def _strip_markdown(line: str) -> str:
    """``**18**`` / ``*18*`` / ``__18__`` -> ``18``: markdown emphasis around the whole answer."""
    m = _MD_WRAP_RE.match(line)
    return m.group("inner").strip() if m else line


def extract_answer_region(completion: str) -> tuple[str, str]:
    """Where the completion's last final answer is.

    Returns ``("hash", rest of the line after the last ####, markdown emphasis around it
    dropped)`` or ``("boxed", content of the
    last complete \\boxed{} / \\fbox{})``, whichever marker comes later in the text (so a
    completion that corrects itself is graded on its last answer); ``("all", completion)`` when
    there is neither.
    """
    from das_jax.data.problems import extract_last_boxed  # noqa: PLC0415  (rl -> data is fine)

    hash_idx = completion.rfind("####")
    box_idx = max(completion.rfind("\\boxed"), completion.rfind("\\fbox"))
    boxed = extract_last_boxed(completion) if box_idx >= 0 else None
    if boxed is not None and box_idx > hash_idx:
        return "boxed", boxed
    if hash_idx >= 0:
        line = completion[hash_idx + 4 :].strip().split("\n", 1)[0].strip()
        return "hash", _strip_markdown(line)
    if boxed is not None:
        return "boxed", boxed
    return "all", completion


def extract_final_number(completion: str) -> str | None:
    """The completion's final answer as a normalised number string, or None.

    The final-answer region (:func:`extract_answer_region`) must be one number as a whole
    (:func:`parse_number`): ``"#### $1,234.00"`` -> ``"1234"``, ``"\\boxed{\\frac{1}{2}}"`` ->
    ``"0.5"``, ``"\\boxed{1/3}"`` -> ``"1/3"``; ``"#### 3 or 4"`` and ``"the total is 7."`` -> None
    (a number is never pulled out of text that is not a number).
    """
    if not isinstance(completion, str):
        return None
    v = parse_number(extract_answer_region(completion)[1])
    return None if v is None else _normalize_number(v)


def _gold_text(answer: Any) -> str:
    from das_jax.data.problems import extract_last_boxed  # noqa: PLC0415

    g = str(answer).strip()
    if "####" in g:
        g = g[g.rfind("####") + 4 :].strip()
    elif "\\boxed" in g or "\\fbox" in g:
        g = extract_last_boxed(g) or g
    g = g.strip()
    if len(g) > 2 and g[0] == "$" and g[-1] == "$" and g.count("$") == 2:
        g = g[1:-1].strip()
    return g


def _numeric_match(region: str, gold: str) -> bool:
    """Exact rational equality, only when both the whole region and the gold are one number."""
    gv = parse_number(gold)
    if gv is None:
        return False
    pv = parse_number(region)
    return pv is not None and pv == gv


_warned_thread = False


def _math_verify_match(kind: str, region: str, completion: str, gold: str, timeout_s: int) -> bool:
    """math-verify on the answer region (``$region$``; the whole completion when there is no
    marker). Only in the main thread (its timeouts use SIGALRM); elsewhere it is skipped
    (returns False) so it can never hang."""
    global _warned_thread
    if threading.current_thread() is not threading.main_thread():
        if not _warned_thread:
            logger.warning(
                "math_accuracy_reward called outside the main thread: math-verify (signal-based "
                "timeouts) is skipped, only the exact numeric/string fallback match is used."
            )
            _warned_thread = True
        return False
    try:
        from math_verify import parse, verify  # noqa: PLC0415  (slow import, optional path)
        from math_verify.errors import TimeoutException  # noqa: PLC0415  (a BaseException)
    except ImportError:  # pragma: no cover - declared dependency
        return False
    pred_text = f"${region}$" if kind in ("hash", "boxed") else completion
    try:
        gold_p = parse(f"${gold}$", parsing_timeout=timeout_s)
        pred_p = parse(pred_text, parsing_timeout=timeout_s)
        if not gold_p or not pred_p:
            return False
        return bool(verify(gold_p, pred_p, timeout_seconds=timeout_s))
    except (Exception, TimeoutException) as e:  # noqa: BLE001 - must never break a reward
        logger.debug("math-verify failed: %s: %s", type(e).__name__, e)
        return False


def _norm_expr(s: str) -> str:
    """Normalise an answer for string comparison: wrappers and ``\\left``/``\\right``/thin
    spaces dropped, ``dfrac``/``tfrac`` -> ``frac``, whitespace collapsed and removed around
    operators and brackets. Spaces between two word characters stay (``"1 2"`` is not ``"12"``)."""
    s = _strip_wrappers(s)
    s = re.sub(r"\\left|\\right|\\[!,;: ]", " ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", " ", s).strip()
    return re.sub(r"\s*([^\w\s\\])\s*", r"\1", s)


def _string_match(kind: str, region: str, gold: str) -> bool:
    if kind == "all":
        return False
    a, b = _norm_expr(region), _norm_expr(gold)
    return bool(a) and a == b


def math_answer_correct(completion: str, answer: Any, *, use_math_verify: bool = True,
                        timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Is the completion's final answer equal to ``answer``?

    ``answer`` may be a bare value (``"18"``, ``"\\frac{1}{2}"``), a GSM8K solution
    (``"... #### 18"``) or a MATH solution with ``\\boxed{}``. The completion is graded on its
    last final answer (:func:`extract_answer_region`). True when any of these agrees (see the
    module docstring): (1) exact numeric match, only when the whole region and the gold are
    each one number (:func:`parse_number`); (2) normalised string equality of region and gold;
    (3) math-verify on the region -- main thread only, each call bounded by ``timeout_s``
    seconds. Never raises for odd inputs (returns False).
    """
    if not isinstance(completion, str) or answer is None:
        return False
    gold = _gold_text(answer)
    if not gold:
        return False
    kind, region = extract_answer_region(completion)
    if _numeric_match(region, gold):
        return True
    if _string_match(kind, region, gold):
        return True
    if use_math_verify:
        return _math_verify_match(kind, region, completion, gold, timeout_s)
    return False


def _column(kwargs: dict, name: str, n: int, fn: str) -> list:
    col = kwargs.get(name)
    if col is None:
        raise ValueError(f"{fn}: needs the dataset column {name!r} (got kwargs {sorted(kwargs)})")
    col = list(col)
    if len(col) != n:
        raise ValueError(f"{fn}: column {name!r} has {len(col)} values for {n} completions")
    return col


def math_accuracy_reward(prompts: Sequence[str], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when a completion's final answer equals the ground truth, else 0.0.

    Args:
        prompts: the prompts (unused; TRL signature).
        completions: completion strings (or TRL conversational lists of ``{"content": ...}``).
        answer: (kwarg, required) ground truth per sample, see :func:`math_answer_correct`.
        use_math_verify: (kwarg, optional bool) default True.

    Returns:
        One float in {0.0, 1.0} per completion.

    Raises:
        ValueError: the ``answer`` column is missing or has the wrong length.
    """
    comps = [as_text(c) for c in completions]
    answers = _column(kwargs, "answer", len(comps), "math_accuracy_reward")
    use_mv = bool(kwargs.get("use_math_verify", True))
    return [_grade_one(i, c, a, use_mv) for i, (c, a) in enumerate(zip(comps, answers))]


def _grade_one(i: int, completion: str, answer: Any, use_mv: bool) -> float:
    """One sample's reward; a failure while grading it gives this sample 0.0 and nothing else."""
    try:
        return 1.0 if math_answer_correct(completion, answer, use_math_verify=use_mv) else 0.0
    except Exception as e:  # noqa: BLE001 - one sample's failure must not spill onto the batch
        logger.warning("math_accuracy_reward: sample %d could not be graded (%s: %s); reward 0.0",
                       i, type(e).__name__, e)
        return 0.0


def format_reward(prompts: Sequence[str], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when a completion states its answer in the expected format -- ``#### <number>`` or a
    non-empty ``\\boxed{...}`` -- else 0.0. Ignores all dataset columns."""
    out = []
    for c in completions:
        t = as_text(c)
        ok = _FORMAT_HASH_RE.search(t) is not None
        if not ok:
            m = _FORMAT_BOXED_RE.search(t)
            ok = m is not None and m.group(0).split("{", 1)[1][:-1].strip() != ""
        out.append(1.0 if ok else 0.0)
    return out


def as_text(c: Any) -> str:
    """A completion as text: strings pass through; TRL conversational completions (a list of
    ``{"role", "content"}`` dicts) are joined; anything else becomes ``str(c)``."""
    if isinstance(c, str):
        return c
    if isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c):
        return "".join(str(m.get("content", "")) for m in c)
    if isinstance(c, dict) and "content" in c:
        return str(c["content"])
    return "" if c is None else str(c)
