"""Math rewards: answer accuracy (math-verify + a numeric fallback) and answer format."""

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
]

# A number as models write it: optional sign / $, digits with optional thousands commas,
# optional decimals. "1,234.50", "$12", "-3", ".5" is not matched (rare in answers).
_NUM_RE = re.compile(r"-?\$?\s?\d+(?:,\d{3})*(?:\.\d+)?|-?\$?\s?\d+(?:\.\d+)?")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_FORMAT_HASH_RE = re.compile(r"####\s*\$?\s*-?\d[\d,]*(?:\.\d+)?")
_FORMAT_BOXED_RE = re.compile(r"\\boxed\s*\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")

#: seconds math-verify may spend parsing / comparing one answer (signal-based, main thread only).
MATH_VERIFY_TIMEOUT_S = 3


def _normalize_number(s: str) -> str:
    s = s.strip().replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")
    return "0" if s == "-0" else s


_LATEX_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{\s*(-?[\d.,]+)\s*\}\{\s*(-?[\d.,]+)\s*\}$")


def _to_fraction(s: str) -> Fraction | None:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\[,!; ]|\\left|\\right|\\text\{[^{}]*\}|\\%|%", "", s).strip()
    m = _LATEX_FRAC_RE.match(s)
    if m:  # \frac{a}{b} with numeric a, b
        s = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
        if s.startswith("--"):
            s = s[2:]
    s = _normalize_number(s)
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)(?:/(\d+))?", s)
    if not m:
        return None
    try:
        f = Fraction(m.group(1))
        if m.group(2):
            d = int(m.group(2))
            if d == 0:
                return None
            f /= d
        return f
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer_region(completion: str) -> tuple[str, str]:
    """Where the final answer is: ``("hash", text after the last ####)``, else
    ``("boxed", content of the last \\boxed{})``, else ``("all", completion)``."""
    from das_jax.data.problems import extract_last_boxed  # noqa: PLC0415  (rl -> data is fine)

    idx = completion.rfind("####")
    if idx >= 0:
        line = completion[idx + 4 :].strip().split("\n", 1)[0].strip()
        return "hash", line
    boxed = extract_last_boxed(completion)
    if boxed is not None:
        return "boxed", boxed
    return "all", completion


def extract_final_number(completion: str) -> str | None:
    """The final numeric answer of a completion, normalised (``"$1,234.00"`` -> ``"1234"``):
    the first number after the last ``####`` if present, else the last number inside the last
    ``\\boxed{}``, else the last number in the text. None when there is none."""
    kind, region = extract_answer_region(completion)
    nums = _NUM_RE.findall(region)
    if not nums:
        return None
    return _normalize_number(nums[0] if kind == "hash" else nums[-1])


def _gold_text(answer: Any) -> str:
    from das_jax.data.problems import extract_last_boxed  # noqa: PLC0415

    g = str(answer).strip()
    if "####" in g:
        g = g[g.rfind("####") + 4 :].strip()
    elif "\\boxed" in g:
        g = extract_last_boxed(g) or g
    return g.strip().strip("$").strip()


def _numeric_match(completion: str, gold: str) -> bool:
    gf = _to_fraction(gold)
    if gf is None:
        return False
    kind, region = extract_answer_region(completion)
    if kind != "all":
        whole = _to_fraction(region)  # the whole answer region, e.g. "\frac{1}{2}" or "3/4"
        if whole is not None and whole == gf:
            return True
    pred = extract_final_number(completion)
    if pred is None:
        return False
    pf = _to_fraction(pred)
    if pf is None:
        return False
    if pf == gf:
        return True
    # float answers written with rounding, e.g. 0.3333 vs 1/3: relative 1e-4
    return abs(float(pf) - float(gf)) <= 1e-4 * max(1.0, abs(float(gf))) and (gf.denominator != 1 or pf.denominator != 1)


_warned_thread = False


def _math_verify_match(completion: str, gold: str, timeout_s: int) -> bool:
    """math-verify on the answer region. Only in the main thread (its timeouts use SIGALRM);
    elsewhere it is skipped (returns False) so it can never hang."""
    global _warned_thread
    if threading.current_thread() is not threading.main_thread():
        if not _warned_thread:
            logger.warning(
                "math_accuracy_reward called outside the main thread: math-verify (signal-based "
                "timeouts) is skipped, only the numeric/string fallback match is used."
            )
            _warned_thread = True
        return False
    try:
        from math_verify import parse, verify  # noqa: PLC0415  (slow import, optional path)
        from math_verify.errors import TimeoutException  # noqa: PLC0415  (a BaseException)
    except ImportError:  # pragma: no cover - declared dependency
        return False
    kind, region = extract_answer_region(completion)
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


def _string_match(completion: str, gold: str) -> bool:
    kind, region = extract_answer_region(completion)
    if kind == "all":
        return False
    norm = lambda s: re.sub(r"\s+|\\left|\\right|\\!|\\,|^\$|\$$", "", s).replace("dfrac", "frac")  # noqa: E731
    return bool(gold) and norm(region) == norm(gold)


def math_answer_correct(completion: str, answer: Any, *, use_math_verify: bool = True,
                        timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Is the completion's final answer equal to ``answer``?

    ``answer`` may be a bare value (``"18"``, ``"\\frac{1}{2}"``), a GSM8K solution
    (``"... #### 18"``) or a MATH solution with ``\\boxed{}``. True when any of these agrees:
    (1) numeric match of :func:`extract_final_number` and the gold number (commas, ``$``,
    trailing ``.0`` normalised; fractions ``a/b`` allowed); (2) math-verify (``parse`` +
    ``verify``) on the answer region (text after ``####``, or the last ``\\boxed{}``, else the
    whole completion) -- main thread only, each call bounded by ``timeout_s`` seconds;
    (3) whitespace-insensitive string equality of the answer region and the gold text.
    Never raises for odd inputs (returns False).
    """
    if not isinstance(completion, str) or answer is None:
        return False
    gold = _gold_text(answer)
    if not gold:
        return False
    if _numeric_match(completion, gold):
        return True
    if _string_match(completion, gold):
        return True
    if use_math_verify:
        return _math_verify_match(completion, gold, timeout_s)
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
    return [1.0 if math_answer_correct(c, a, use_math_verify=use_mv) else 0.0 for c, a in zip(comps, answers)]


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
