"""Math rewards: answer accuracy (math-verify + an exact numeric fallback) and answer format.

How a completion is graded (:func:`math_answer_correct`):

1. The *final-answer region* is located (:func:`extract_answer_region`): the last answer marker
   that holds an answer (:func:`answer_markers`) -- the rest of the line after a ``####`` or the
   content of a complete ``\\boxed{}`` / ``\\fbox{}``, whichever comes later (a completion that
   corrects itself, ``#### 3 ... \\boxed{5}``, is graded on ``5``); without one, the whole
   completion. A marker holds an answer only when its content is non-empty and is not a
   markdown heading or prose (``#### Verification``, ``#### Step 2``, ``#### 1. Setup``), an
   echoed placeholder (``\\boxed{}``, ``\\boxed{answer}``, ``#### <number>``) or bare
   punctuation, so such text after the answer cannot overwrite it. Markers inside fenced code
   blocks count only when no marker outside code holds an answer.
2. Exact numeric fallback: only when the *whole* region is one number
   (:func:`parse_number`: ``18``, ``-3``, ``1,000``, ``$1,234.50``, ``\\$18``, ``25\\%``, ``18.``,
   ``.5``, ``\\frac{1}{2}``, ``-7/2``, ``\\text{18}``) and the gold is one number too, the two
   are compared as exact rationals (no tolerance: ``17.9999`` is not ``18``). A number is never
   pulled out of a region that is not itself a number: ``4\\sqrt{2}``, ``3 \\cdot 7``,
   ``3 or 4``, ``3, 4``, ``[3, 4]`` and ``18 dollars`` are left to math-verify.
3. Normalised string equality of region and gold (whitespace around operators, ``\\left``/
   ``\\right``, ``\\!``/``\\,``, ``dfrac``; digits separated by a space stay separated). Each
   rule matches whole commands only: ``\\leftarrow`` is not ``\\left`` + ``arrow``.
4. math-verify (``parse`` + ``verify``) on the region wrapped in ``$...$`` (the whole completion
   when no marker holds an answer), main thread only (its timeouts use SIGALRM).

Steps 2 and 3 only ever accept what math-verify also accepts (a property test checks this); they
make the common case fast and keep grading off the main thread possible.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from fractions import Fraction
from typing import Any, Sequence

from das_jax.data.problems import extract_last_boxed

logger = logging.getLogger(__name__)

__all__ = [
    "math_accuracy_reward",
    "format_reward",
    "math_answer_correct",
    "extract_final_number",
    "extract_answer_region",
    "answer_markers",
    "parse_number",
]

# format_reward: a #### answer that begins with a number ("18", "$1,234.50", "-7").
_FORMAT_HASH_RE = re.compile(r"\\?\$?\s*[-+\u2212]?\s*\\?\$?\d")

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


# An answer marker: a run of four or more "#" (the rest of its line is the candidate) or a whole
# \boxed / \fbox command (its brace group, or the one token after it, is the candidate).
_HASH_MARK_RE = re.compile(r"#{4,}")
_BOX_MARK_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")

# "#### Answer: 42", "#### **Final answer is** 42": a label before the answer on a #### line.
_LABEL_RE = re.compile(
    r"\s*(?P<em>\*\*|__|\*|_)?\s*(?:the\s+)?(?:final\s+)?answer(?![A-Za-z])\s*(?(em)(?P=em)?)\s*"
    r"(?P<sep>:|=|is(?![A-Za-z]))?\s*(?(em)(?P=em)?)\s*",
    re.IGNORECASE,
)
# A markdown heading's text (or prose): before its first number or math symbol it has a word of
# two or more letters ("#### Step 2", "#### Verification", "#### Q: what is 6*7?"), optionally
# after emphasis, an emoji or a list number ("#### 1. Setup", "#### a) Check", "#### IV. Notes").
_ENUMERATOR_RE = re.compile(r"[*_`\s]*(?:\d+|[A-Za-z]|[IVXivx]+)[.)]\s+")
_MATH_CHAR_RE = re.compile(r"[0-9=\\$+\-\u2212^<>/|]")
_WORD_RE = re.compile(r"[^\W\d_]{2,}")
# Words that begin math rather than prose ("#### sqrt(2)", "#### pi/2", "#### infinity").
_MATH_WORDS = frozenset(
    "sqrt cbrt sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln lg exp pi "
    "inf infty infinity oo max min gcd lcm mod det".split()
)
# An echoed placeholder: "answer", "your final answer", "[answer here]", "{final_answer}", a
# template slot "<number>", "...", "?", "___".
_PLACEHOLDER_WORDS = frozenset(
    "your the a an my final answer answers here result solution goes number value expression".split()
)
_PLACEHOLDER_NOUNS = frozenset("answer answers result solution number value expression".split())
_PLACEHOLDER_SYMBOL_RE = re.compile(
    r"(?:\.{2,}|\u2026|\\[lc]?dots(?![A-Za-z])|(?:\\?_)+|\?+|\\square(?![A-Za-z])|<[A-Za-z_ ]+>)"
)
_SPACING_RE = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~|[{}$\s]")


def _is_placeholder(core: str) -> bool:
    c = core.strip()
    if _PLACEHOLDER_SYMBOL_RE.fullmatch(c):
        return True
    if len(c) >= 2 and (c[0], c[-1]) in (("[", "]"), ("(", ")"), ("{", "}")):
        c = c[1:-1].strip()
    words = re.split(r"[\s_]+", _strip_wrappers(c).lower().strip())
    return set(words) <= _PLACEHOLDER_WORDS and bool(set(words) & _PLACEHOLDER_NOUNS)


def _is_prose(text: str) -> bool:
    """Does ``text`` read like a heading or a sentence -- a word of two or more letters (not a
    math name such as ``sqrt``, not Greek) before its first number or math symbol -- rather than
    like math (``42``, ``-3``, ``x = 5``, ``\\text{yes}``, ``(C)``, ``18 dollars``)?"""
    t = text.lstrip()
    while t and unicodedata.category(t[0]) in ("So", "Sk", "Mn", "Cf", "Zs"):
        t = t[1:]  # a leading emoji ("#### \u2705 Check")
    m = _ENUMERATOR_RE.match(t)
    if m:
        t = t[m.end():]
    cut = _MATH_CHAR_RE.search(t)
    prefix = t[: cut.start()] if cut else t
    return any(
        w.lower() not in _MATH_WORDS and not any("\u0370" <= c <= "\u03ff" for c in w)
        for w in _WORD_RE.findall(prefix)
    )


def _holds_answer(candidate: str) -> bool:
    """Non-empty, not an echoed placeholder: something a grader can compare."""
    core = _strip_wrappers(_strip_markdown(candidate.strip()))
    meat = _SPACING_RE.sub("", core)
    if not re.search(r"[^\W_]|[\u221e\u2205]", meat):  # nothing but punctuation / spacing
        return False
    if re.search(r"\{\s*\}", core) and not re.search(r"[^\W_]", re.sub(r"\\[A-Za-z]+", "", meat)):
        return False  # an empty template: "\frac{}{}", "\sqrt{}", "\text{} \%"
    return not _is_placeholder(core)


# Quotes around a #### line's text: "`#### 42`", "end with '#### <number>'." (quote, then punctuation).
_QUOTES_RE = re.compile(r"^\s*[`'\"]+|[`'\"]+[.,;:!?)]*\s*$")


def _hash_answer(line: str) -> str | None:
    """The answer a ``####`` line holds (markdown emphasis and an ``Answer:`` label dropped), or
    None when the line is a heading, empty, a placeholder, or defers to a ``\\boxed`` on it."""
    s = line.strip()
    if _BOX_MARK_RE.search(s):
        return None  # the \boxed{} on this line is a marker of its own
    m = _LABEL_RE.match(s)
    if m:
        rest = s[m.end():].strip()
        if not rest or (not m.group("sep") and _is_prose(rest)):
            return None  # "#### Answer", "#### Final Answer" (a heading), "#### Answer key"
        s = rest  # labelled: "#### Answer: yes" holds "yes", even though it is a word
    s = _strip_markdown(_QUOTES_RE.sub("", s).strip())
    if (not m and _is_prose(s)) or not _holds_answer(s):
        return None
    return s


def _brace_pairs(text: str) -> dict[int, int]:
    """``{index of "{": index of its matching "}"}`` for every balanced brace group (one pass)."""
    pairs, stack = {}, []
    for k, c in enumerate(text):
        if c == "{":
            stack.append(k)
        elif c == "}" and stack:
            pairs[stack.pop()] = k
    return pairs


_SPACES_RE = re.compile(r"\s*")


def _box_content(text: str, end: int, pairs: dict[int, int]) -> str | None:
    """The argument of a ``\\boxed`` command ending at ``end``: its balanced brace group, or the
    one token after it (``\\boxed 5``); None when unbalanced or absent. ``pairs``:
    :func:`_brace_pairs` of ``text``."""
    j = _SPACES_RE.match(text, end).end()
    if text.startswith("{", j):
        k = pairs.get(j)
        return None if k is None else text[j + 1 : k]  # None: unbalanced (a truncated completion)
    m = re.match(r"\s+([^\s$]+)", text[end : end + 4096])
    if m is None or _is_prose(m.group(1)) or _BOX_MARK_RE.match(m.group(1)):
        return None  # "\boxed as asked" mentions the command, it does not box an answer
    return m.group(1)


_FENCE_RE = re.compile(r"^[ \t]{0,3}(`{3,}|~{3,})", re.MULTILINE)


def _code_spans(text: str) -> list[tuple[int, int]]:
    """``[start, end)`` of each fenced code block (```` ``` ```` or ``~~~``); an unclosed fence
    runs to the end of the text (a truncated completion)."""
    spans, start, fence = [], None, ""
    for m in _FENCE_RE.finditer(text):
        f = m.group(1)
        if start is None:
            start, fence = m.start(), f
        elif f[0] == fence[0] and len(f) >= len(fence):
            spans.append((start, m.end()))
            start = None
    if start is not None:
        spans.append((start, len(text)))
    return spans


def answer_markers(completion: str) -> list[tuple[int, str, str]]:
    """The answer markers of ``completion`` that hold an answer, in text order.

    A marker is the rest of the line after a run of four or more ``#`` (kind ``"hash"``) or the
    argument of a ``\\boxed`` / ``\\fbox`` command (kind ``"boxed"``). It holds an answer only
    when its content is non-empty and is not: a markdown heading or prose (``#### Step 2``,
    ``#### Verification``, ``#### 1. Setup``, ``#### Final Answer``: ``####`` text with a word
    of two or more letters -- other than a math name such as ``sqrt`` or ``pi`` -- before its
    first number or math symbol, unless labelled ``Answer:`` / ``The answer is``), an echoed
    placeholder (``\\boxed{}``, ``\\boxed{answer}``, ``\\boxed{your final answer}``,
    ``<number>``, ``...``), or only punctuation. ``#### Answer: 42`` holds ``42``; a ``####``
    line holding a ``\\boxed{}`` defers to that box. Markers inside fenced code blocks
    (```` ``` ````) are code (``print("#### " + str(x))``) and count only when no marker
    outside code holds an answer.

    Returns:
        ``[(offset, kind, content)]``; content of a ``####`` line has markdown emphasis, quotes
        and an answer label dropped, boxed content is returned as written.
    """
    out: list[tuple[int, str, str]] = []
    for m in _HASH_MARK_RE.finditer(completion):
        eol = completion.find("\n", m.end())
        ans = _hash_answer(completion[m.end() : eol if eol >= 0 else len(completion)])
        if ans is not None:
            out.append((m.start(), "hash", ans))
    pairs = _brace_pairs(completion) if "{" in completion else {}
    for m in _BOX_MARK_RE.finditer(completion):
        content = _box_content(completion, m.end(), pairs)
        if content is not None and _holds_answer(content):
            out.append((m.start(), "boxed", content))
    out.sort(key=lambda t: t[0])
    spans = _code_spans(completion) if "```" in completion or "~~~" in completion else []
    if spans:
        outside = [t for t in out if not any(a <= t[0] < b for a, b in spans)]
        if outside:
            return outside
    return out


def extract_answer_region(completion: str) -> tuple[str, str]:
    """Where the completion's last final answer is.

    The last answer marker that holds an answer (:func:`answer_markers`): ``("hash", rest of
    its line)`` or ``("boxed", content of the \\boxed{} / \\fbox{})``. So a completion that
    corrects itself is graded on its last answer, while a later markdown heading
    (``#### Verification``), an empty ``####`` or ``\\boxed{}``, or an echoed instruction
    (``I put the final answer in \\boxed{} as asked.``) cannot overwrite an earlier answer.
    ``("all", completion)`` when no marker holds an answer.
    """
    markers = answer_markers(completion) if isinstance(completion, str) else []
    if not markers:
        return "all", completion
    _, kind, content = markers[-1]
    return kind, content


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


# Tokens _norm_expr drops. Every command is matched whole: a letter command only when no letter
# follows (``\left`` but not ``\leftarrow``, ``\dfrac`` but not ``\dfracx``); ``\\`` (a line
# break) is matched first so that ``\\,`` is not read as ``\,``.
_SPACING_CMD_RE = re.compile(r"\\\\|\\(?:left|right)(?![A-Za-z])|\\[!,;: ]")
_DFRAC_RE = re.compile(r"\\[dt]frac(?![A-Za-z])")


def _norm_expr(s: str) -> str:
    """Normalise an answer for string comparison: wrappers and ``\\left``/``\\right``/thin
    spaces dropped, ``dfrac``/``tfrac`` -> ``frac``, whitespace collapsed and removed around
    operators and brackets. Spaces between two word characters stay (``"1 2"`` is not ``"12"``)."""
    s = _strip_wrappers(s)
    s = _SPACING_CMD_RE.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else " ", s)
    s = _DFRAC_RE.sub(r"\\frac", s)
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
    """1.0 when a completion states an answer in the expected format -- a ``####`` line holding a
    number (``#### 18``, ``#### $1,234.50``) or a ``\\boxed{...}`` holding an answer -- else 0.0.
    Markers that hold no answer (:func:`answer_markers`: a heading such as ``#### 1. Setup``, an
    empty ``\\boxed{}``, an echoed ``\\boxed{answer}``) earn nothing. Ignores all dataset columns."""
    out = []
    for c in completions:
        markers = answer_markers(as_text(c))
        ok = any(kind == "boxed" or _FORMAT_HASH_RE.match(ans) for _, kind, ans in markers)
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
