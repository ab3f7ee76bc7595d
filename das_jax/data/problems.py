"""The `Problem` record and loaders for file-based datasets (GSM8K, MATH, HumanEval, HF hub).

Every loader returns ``list[Problem]`` in file order, so ``problem_id`` values are stable across
runs (the drafter keys its per-problem history on them).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = [
    "Problem",
    "DatasetError",
    "read_jsonl",
    "extract_gsm8k_answer",
    "extract_last_boxed",
    "load_gsm8k",
    "load_math",
    "load_humaneval",
    "load_hf_dataset",
    "reward_kwargs",
    "normalize_number",
    "humaneval_harness",
]


class DatasetError(ValueError):
    """A dataset could not be found, read, or parsed (subclass of ``ValueError``)."""


@dataclass(frozen=True)
class Problem:
    """One RL problem.

    Attributes:
        problem_id: stable identifier, e.g. ``"gsm8k-train-17"`` or ``"HumanEval/0"``.
        prompt: the question text without any instruction or chat formatting (for code tasks:
            the function signature + docstring to complete).
        answer: ground truth. Math: the final number / boxed expression as a string (GSM8K
            numbers are normalised: no thousands separators). Code: the test harness (the test
            code followed by ``check(<entry_point>)``).
        metadata: optional extra columns (HumanEval: ``entry_point``, ``test``, ``prompt``,
            ``canonical_solution``, ``task_id``; synthetic: ``num_steps``, ``template``,
            ``solution``). Not part of equality/hash.
    """

    problem_id: str
    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict view (``problem_id``, ``prompt``, ``answer``, ``metadata``)."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# file helpers


def _check_path(path: str | os.PathLike, what: str) -> str:
    if path is None:
        raise DatasetError(f"{what}: a path to a local file is required (got None)")
    p = os.fspath(path)
    if not os.path.exists(p):
        raise DatasetError(f"{what}: file not found: {os.path.abspath(p)!r}")
    if os.path.isdir(p):
        raise DatasetError(f"{what}: expected a .jsonl or .jsonl.gz file, got a directory: {p!r}")
    return p


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Yield one dict per non-empty line of a ``.jsonl`` or gzip-compressed ``.jsonl.gz`` file.

    Raises:
        DatasetError: the file is missing, a line is not UTF-8 or not a JSON object, or the
            gzip stream is corrupt (message names the file and line number).
    """
    p = _check_path(path, "read_jsonl")
    with open(p, "rb") as fb:
        magic = fb.read(2)
    opener = gzip.open if magic == b"\x1f\x8b" else open
    with opener(p, "rb") as fb:
        for lineno, raw_bytes in enumerate(_lines(fb, p), start=1):
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{p}:{lineno}: invalid UTF-8 at byte {e.start} of the line; "
                                   "save the file as UTF-8") from None
            line = raw.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p}:{lineno}: invalid JSON ({e})") from e
            if not isinstance(obj, dict):
                raise DatasetError(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield obj


def _lines(fb, path: str) -> Iterator[bytes]:
    try:
        yield from fb
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise DatasetError(f"{path}: cannot read the file ({e})") from None


def _require(obj: dict, keys: tuple[str, ...], path: str, lineno: int) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise DatasetError(
            f"{path}: record {lineno} lacks field(s) {missing}; has {sorted(obj)}"
        )


# --------------------------------------------------------------------------------------------
# answer extraction

_NUM_RE = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str:
    """Normalise a number string: drop ``$``, thousands commas, spaces, trailing ``.0``/``.``.

    ``"$1,234.00" -> "1234"``, ``"-3.50" -> "-3.5"``. Non-numbers are returned stripped.
    """
    s = text.strip().replace("$", "").replace(",", "").replace(" ", "")
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")
    if s == "-0":
        s = "0"
    return s


def extract_gsm8k_answer(solution: str) -> str:
    """Return the normalised number after the last ``####`` in a GSM8K solution.

    Raises:
        DatasetError: there is no ``####`` marker followed by a number.
    """
    idx = solution.rfind("####")
    if idx < 0:
        raise DatasetError(f"GSM8K answer has no '####' marker: {solution[-80:]!r}")
    m = _NUM_RE.search(solution[idx + 4 :])
    if m is None:
        raise DatasetError(f"GSM8K answer has no number after '####': {solution[idx:][:80]!r}")
    return normalize_number(m.group(0))


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or None.

    ``extract_last_boxed(r"so \\boxed{\\frac{1}{2}}.") == r"\\frac{1}{2}"``. Also accepts the
    brace-less form ``\\boxed 5``.
    """
    best = None
    for cmd in ("\\boxed", "\\fbox"):
        i = text.rfind(cmd)
        if i >= 0 and (best is None or i > best[0]):
            best = (i, cmd)
    if best is None:
        return None
    i = best[0] + len(best[1])
    rest = text[i:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        return _balanced(text, i)
    m = re.match(r"\s+([^\s$]+)", rest)  # brace-less "\boxed 5"
    return m.group(1) if m else None


def _balanced(text: str, i: int) -> str | None:
    j = text.find("{", i)
    if j < 0:
        return None
    depth = 0
    for k in range(j, len(text)):
        c = text[k]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k]
    return None  # unbalanced


# --------------------------------------------------------------------------------------------
# loaders


def _limit(limit: int | None) -> int | None:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    return limit


def load_gsm8k(
    path: str | os.PathLike, split: str | None = None, limit: int | None = None
) -> list[Problem]:
    """Load a GSM8K-format jsonl(.gz) file (fields ``question``, ``answer`` with ``#### N``).

    Args:
        path: the jsonl file, e.g. ``data/gsm8k/test.jsonl``.
        split: name used in ids (``"gsm8k-<split>-<i>"``); default: the file stem
            (``train``/``test``).
        limit: keep only the first ``limit`` problems.

    Returns:
        Problems with ``answer`` = normalised final number (``"1,234"`` -> ``"1234"``) and
        ``metadata["solution"]`` = the reference solution text.

    Raises:
        DatasetError: missing file, missing fields, or an answer without ``#### <number>``.
    """
    limit = _limit(limit)
    p = _check_path(path, "load_gsm8k")
    if split is None:
        split = os.path.basename(p).split(".")[0] or "data"
    out: list[Problem] = []
    for i, obj in enumerate(read_jsonl(p)):
        if limit is not None and len(out) >= limit:
            break
        _require(obj, ("question", "answer"), p, i + 1)
        out.append(
            Problem(
                problem_id=f"gsm8k-{split}-{i}",
                prompt=str(obj["question"]).strip(),
                answer=extract_gsm8k_answer(str(obj["answer"])),
                metadata={"solution": obj["answer"]},
            )
        )
    return out


def load_math(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """Load a MATH-format jsonl(.gz) file (fields ``problem``, ``solution`` with ``\\boxed{}``).

    The answer is the last ``\\boxed{...}`` of the solution (balanced braces), or the ``answer``
    field when the record has one. Ids are ``"math-<i>"`` unless the record has ``unique_id``/
    ``id``. ``level``/``type``/``subject`` fields are kept in ``metadata``.

    Raises:
        DatasetError: missing file, missing fields, or no boxed answer and no ``answer`` field.
    """
    limit = _limit(limit)
    p = _check_path(path, "load_math")
    out: list[Problem] = []
    for i, obj in enumerate(read_jsonl(p)):
        if limit is not None and len(out) >= limit:
            break
        _require(obj, ("problem",), p, i + 1)
        solution = str(obj.get("solution", ""))
        ans = extract_last_boxed(solution) if solution else None
        if ans is None and obj.get("answer") is not None:
            ans = str(obj["answer"])
        if ans is None:
            raise DatasetError(f"{p}: record {i + 1} has no \\boxed{{}} answer in 'solution' and no 'answer'")
        pid = obj.get("unique_id") or obj.get("id") or f"math-{i}"
        meta = {k: obj[k] for k in ("level", "type", "subject", "solution") if k in obj}
        out.append(Problem(problem_id=str(pid), prompt=str(obj["problem"]).strip(), answer=ans.strip(), metadata=meta))
    return out


def humaneval_harness(test: str, entry_point: str) -> str:
    """The test harness appended after a HumanEval solution: ``test`` + ``check(entry_point)``."""
    return f"{test}\n\ncheck({entry_point})\n"


def load_humaneval(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """Load HumanEval jsonl or jsonl.gz (``task_id``, ``prompt``, ``canonical_solution``, ``test``,
    ``entry_point``).

    Returns:
        Problems with ``problem_id`` = ``task_id`` (e.g. ``"HumanEval/0"``), ``prompt`` = the code
        prompt (signature + docstring), ``answer`` = :func:`humaneval_harness` (test + check call),
        ``metadata`` = ``{task_id, prompt, entry_point, test, canonical_solution}``.

    Raises:
        DatasetError: missing file or missing fields.
    """
    limit = _limit(limit)
    p = _check_path(path, "load_humaneval")
    out: list[Problem] = []
    for i, obj in enumerate(read_jsonl(p)):
        if limit is not None and len(out) >= limit:
            break
        _require(obj, ("task_id", "prompt", "test", "entry_point"), p, i + 1)
        meta = {
            "task_id": obj["task_id"],
            "prompt": obj["prompt"],
            "entry_point": obj["entry_point"],
            "test": obj["test"],
            "canonical_solution": obj.get("canonical_solution", ""),
        }
        out.append(
            Problem(
                problem_id=str(obj["task_id"]),
                prompt=obj["prompt"],
                answer=humaneval_harness(obj["test"], obj["entry_point"]),
                metadata=meta,
            )
        )
    return out


def load_hf_dataset(
    name: str,
    *,
    kind: str = "gsm8k",
    config: str | None = None,
    split: str = "train",
    limit: int | None = None,
    cache_dir: str | None = None,
) -> list[Problem]:
    """Load a dataset from the Hugging Face hub via the optional ``datasets`` library.

    Records are converted with the same rules as the file loaders, chosen by ``kind``
    (``gsm8k``: question/answer; ``math``: problem/solution; ``humaneval``).

    Args:
        name: hub dataset name, e.g. ``"openai/gsm8k"``.
        kind: record format, one of ``gsm8k``, ``math``, ``humaneval``.
        config: hub config name (e.g. ``"main"`` for GSM8K).
        split: split name.
        limit: keep only the first ``limit`` records.

    Raises:
        DatasetError: ``datasets`` is not installed, or the hub is unreachable (the message says
            how to use a local jsonl file instead), or ``kind`` is unknown.
    """
    limit = _limit(limit)
    if kind not in ("gsm8k", "math", "humaneval"):
        raise DatasetError(f"load_hf_dataset: unknown kind {kind!r}; valid: gsm8k, math, humaneval")
    hint = (
        f"Download the data as jsonl and load it with load_dataset_from_config({kind!r}, "
        f"path='/path/to/file.jsonl') (or kind: {kind} / path: ... in the YAML config)."
    )
    try:
        import datasets  # type: ignore  # noqa: PLC0415  # deferred import: datasets (optional)
    except ImportError as e:
        raise DatasetError(f"load_hf_dataset({name!r}): the 'datasets' package is not installed. {hint}") from e
    try:
        ds = datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
    except Exception as e:  # offline, missing dataset, auth, ...
        raise DatasetError(
            f"load_hf_dataset({name!r}, config={config!r}, split={split!r}) failed "
            f"({type(e).__name__}: {e}); are you offline? {hint}"
        ) from e

    n = len(ds) if limit is None else min(limit, len(ds))
    with tempfile.TemporaryDirectory(prefix="das_jax_hf_") as d:
        fp = os.path.join(d, f"{split}.jsonl")
        with open(fp, "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(json.dumps(dict(ds[i])) + "\n")
        if kind == "gsm8k":
            probs = load_gsm8k(fp, split=split)
        elif kind == "math":
            probs = load_math(fp)
        else:
            probs = load_humaneval(fp)
    return probs


# --------------------------------------------------------------------------------------------
# reward columns


def reward_kwargs(problems: list[Problem]) -> dict[str, list[Any]]:
    """Per-sample dataset columns for reward functions (TRL convention: one list per column).

    Always has ``problem_id`` and ``answer``; every metadata key becomes a column too (missing
    values are None), except that metadata ``prompt`` (HumanEval code prompt) is renamed
    ``code_prompt`` so that it cannot clash with the ``prompts`` argument.
    Repeat problems yourself when a problem has several completions (GRPO groups).
    """
    cols: dict[str, list[Any]] = {
        "problem_id": [p.problem_id for p in problems],
        "answer": [p.answer for p in problems],
    }
    keys: list[str] = []
    for p in problems:
        for k in p.metadata:
            if k not in keys:
                keys.append(k)
    for k in keys:
        col = "code_prompt" if k == "prompt" else k
        if col in cols:
            continue
        cols[col] = [p.metadata.get(k) for p in problems]
    return cols
