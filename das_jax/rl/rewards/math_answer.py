"""Where a math completion's final answer is: the answer markers (``####`` lines, ``\\boxed{}`` /
``\\fbox{}``) that hold an answer, and the final-answer region that grading reads
(`extract_answer_region`; `extract_final_number` when that region is one number). See
`das_jax.rl.rewards.math_reward` for how the region is graded."""

from __future__ import annotations

import re
import unicodedata

from das_jax.rl.rewards.math_numbers import normalize_number, parse_number, strip_wrappers

__all__ = ["answer_markers", "extract_answer_region", "extract_final_number"]


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
    words = re.split(r"[\s_]+", strip_wrappers(c).lower().strip())
    return set(words) <= _PLACEHOLDER_WORDS and bool(set(words) & _PLACEHOLDER_NOUNS)


def _prose_words(text: str) -> list[str]:
    """The words of two or more letters in ``text`` that are not math names or Greek."""
    return [w for w in _WORD_RE.findall(text)
            if w.lower() not in _MATH_WORDS and not any("\u0370" <= c <= "\u03ff" for c in w)]


# Words that point at an answer given elsewhere ("#### The answer is above").
_POINTERS = frozenset({"above", "below", "earlier", "previously", "boxed"})

# A number, then words and nothing else of math: "3 Verification steps", "1/2 way check".
_NUMBERED_HEADING_RE = re.compile(r"[-+]?\d[\d.,/]*\s+(?P<rest>[^\d=\\$+\-\u2212^<>/|]+)")


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
    if _prose_words(prefix):
        return True
    # a numbered heading: one number, then two or more words ("18 dollars" stays an answer)
    m = _NUMBERED_HEADING_RE.fullmatch(t.strip())
    return bool(m) and len(_prose_words(m.group("rest"))) >= 2


def _holds_answer(candidate: str) -> bool:
    """Non-empty, not an echoed placeholder: something a grader can compare."""
    core = strip_wrappers(_strip_markdown(candidate.strip()))
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
        words = {w.lower() for w in _prose_words(rest)}
        if not _MATH_CHAR_RE.search(rest) and (len(words) >= 2 or words & _POINTERS):
            return None  # a labelled sentence or pointer, no math: "#### Answer: see above"
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
    return None if v is None else normalize_number(v)
