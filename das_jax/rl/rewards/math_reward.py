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
   when no marker holds an answer), main thread only (its timeouts use SIGALRM). When the gold
   is one number, the answer math-verify extracts must state one number too
   (:func:`_states_a_number`: ``3\\frac{1}{2}``, ``18^\\circ`` and ``1.5 \\times 10^{3}`` do);
   an expression left for the grader to evaluate (``Sam has 3 - 1.``, ``\\boxed{3^{2}}``,
   ``#### 3 + 4``) states no answer, and a policy trained on a reward that evaluates it learns
   to stop computing (the main job's arithmetic did, within 24 steps). ``... 3 - 1 = 2.`` is
   graded on ``2``.

Steps 2 and 3 only ever accept what math-verify also accepts (a property test checks this), with
one exception: a number in ``\\text{}`` or before ``\\%`` is that number (math-verify means it
to be, ``\\text{5}`` and ``25\\%`` pass against 5 and 25, but its ``verify`` rejects a decimal so
wrapped: ``\\text{0.1}``, ``2.5\\%`` against 0.1, 2.5). They make the common case fast and keep
grading off the main thread possible.

Step 1 lives in `das_jax.rl.rewards.math_answer`, the exact numbers of step 2 in
`das_jax.rl.rewards.math_numbers`; their public names are importable from here too.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Sequence

from das_jax.data.problems import extract_last_boxed
from das_jax.rl.rewards.math_answer import (answer_markers, extract_answer_region,
                                            extract_final_number)
from das_jax.rl.rewards.math_numbers import parse_number, strip_wrappers

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


_BARE_DOLLAR_RE = re.compile(r"(?<!\\)\$")


def _in_math_mode(region: str) -> str:
    """``$region$`` for math-verify; a lone bare ``$`` in the region (currency: ``-$1 \\cdot 2``)
    is escaped first, else it would close the math mode after ``-``. An even number of bare
    ``$`` is left alone (the region's own inline math: ``3 \\cdot $4$``)."""
    if len(_BARE_DOLLAR_RE.findall(region)) % 2:
        region = _BARE_DOLLAR_RE.sub(r"\\$", region)
    return f"${region}$"


# a binary operator in an answer's text: \div, \times, \cdot, *, :, +, a minus after a number
# or bracket, a power other than degrees
_OPERATOR_RE = re.compile(r"\\(?:div|times|cdot)(?![A-Za-z])|[*:+]|(?<=[\d)}])\s*-"
                          r"|\^(?!\s*\{?\s*\\circ)")


def _states_a_number(parsed: list) -> bool:
    """Whether an answer math-verify parsed (its ``[sympy expression, text]``) states one number:
    its text (of an equation, the right-hand side) is one number (:func:`parse_number`:
    ``2``, ``50\\%``, ``\\frac{14}{2}``), a number in scientific notation
    (``1.5 \\times 10^{3}``), or a notation without an operator that sympy reads as a number
    (``3\\frac{1}{2}``, ``18^\\circ``). An expression left to evaluate (``3 - 1``,
    ``2 \\cdot 9``, ``12 \\div 4``, ``3^{2}``, ``\\sqrt{8}``) is not, even where math-verify
    evaluated it."""
    # deferred import: sympy (loaded by math_verify, which only this path imports)
    import sympy  # noqa: PLC0415

    text = str(parsed[-1]).rsplit("=", 1)[-1]
    if parse_number(text) is not None:
        return True
    expr = parsed[0]
    if isinstance(expr, sympy.Eq):
        expr = expr.rhs
    if isinstance(expr, sympy.Mul) and len(expr.args) == 2:      # a x 10^k
        a, b = expr.args
        if a.is_Number and isinstance(b, sympy.Pow) and b.base == 10 and b.exp.is_Integer:
            return True
    return not _OPERATOR_RE.search(text) and bool(getattr(expr, "is_Number", False))


def _math_verify_match(kind: str, region: str, completion: str, gold: str, timeout_s: int,
                       numeric_gold: bool = False) -> bool:
    """math-verify on the answer region (``$region$``, :func:`_in_math_mode`; the whole
    completion when there is no marker); with `numeric_gold`, the answer it extracts must
    state one number (:func:`_states_a_number`), not an expression equal to the gold. Only in
    the main thread (its timeouts use SIGALRM); elsewhere it is skipped (returns False) so it
    can never hang."""
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
        # deferred import: math_verify (slow to import; an optional path)
        from math_verify import parse, verify  # noqa: PLC0415
        from math_verify.errors import TimeoutException  # noqa: PLC0415  (a BaseException)
    except ImportError:  # pragma: no cover - declared dependency
        return False
    pred_text = _in_math_mode(region) if kind in ("hash", "boxed") else completion
    try:
        gold_p = parse(f"${gold}$", parsing_timeout=timeout_s)
        pred_p = parse(pred_text, parsing_timeout=timeout_s)
        if not gold_p or not pred_p:
            return False
        if numeric_gold and not _states_a_number(pred_p):
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
    s = strip_wrappers(s)
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
    seconds; for a gold that is one number, only an answer that is one number (not an
    expression equal to it). Never raises for odd inputs (returns False).
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
        return _math_verify_match(kind, region, completion, gold, timeout_s,
                                  numeric_gold=parse_number(gold) is not None)
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
