"""Code reward (HumanEval-style): 1.0 if the completion passes the problem's tests, judged outside
the sandbox that runs the completion (:mod:`das_jax.rl.rewards.code_check`)."""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from das_jax.rl.rewards.code_check import check_solution, free_names, stub_functions
from das_jax.rl.rewards.math_reward import as_text as _as_text
from das_jax.rl.rewards.sandbox import SandboxLimits

logger = logging.getLogger(__name__)

__all__ = ["code_reward", "make_code_reward", "build_program", "build_solution", "build_tests", "extract_code"]

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The code in a completion: the fenced block (```python ...```) that defines
    ``entry_point`` (else the first python/untagged block), or the raw text when there is no
    fence (a plain continuation of the function body)."""
    if "```" not in completion:
        return completion
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(completion)]
    if not blocks:
        return completion
    if entry_point:
        pat = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
        for _, body in blocks:
            if pat.search(body):
                return body
    for lang, body in blocks:
        if lang in ("python", "py", "python3", ""):
            return body
    return blocks[0][1]


def _defines(code: str, names: list[str]) -> bool:
    return any(re.search(rf"^def\s+{re.escape(n)}\s*\(", code, re.MULTILINE) for n in names)


def build_solution(completion: str, *, code_prompt: str | None = None, entry_point: str | None = None) -> str:
    """The untrusted solution source: ``code_prompt`` + the completion's code.

    If the code redefines ``entry_point`` (default: the prompt's stub functions) at top level, it
    is appended after the prompt with the stub completed by ``pass`` (so helper functions and
    imports of the prompt stay available); otherwise it is the continuation of the prompt's
    function body.
    """
    code = extract_code(completion, entry_point)
    prompt = code_prompt or ""
    names = [entry_point] if entry_point else stub_functions(prompt)
    if prompt and names and _defines(code, names):
        return prompt.rstrip("\n") + "\n    pass\n\n\n" + code
    return prompt + code


def build_tests(*, test: str | None = None, entry_point: str | None = None, harness: str | None = None) -> str:
    """The trusted test code: ``test`` + ``check(entry_point)`` when both are given, else ``harness``
    (e.g. a Problem's ``answer``).

    Raises:
        ValueError: neither (``test``, ``entry_point``) nor ``harness`` is given.
    """
    if test is not None and entry_point:
        return f"{test}\n\ncheck({entry_point})\n"
    if harness is not None:
        return harness
    raise ValueError("code_reward needs test + entry_point, or harness (answer)")


def build_program(
    completion: str,
    *,
    code_prompt: str | None = None,
    test: str | None = None,
    entry_point: str | None = None,
    harness: str | None = None,
) -> str:
    """One program (solution + tests), for running outside the reward path (e.g. by hand with
    :func:`run_in_sandbox`). The code reward does NOT run this: it keeps tests and solution in
    separate sandboxes (:func:`das_jax.rl.rewards.code_check.check_solution`).

    Raises:
        ValueError: neither (``test``, ``entry_point``) nor ``harness`` is given.
    """
    tail = build_tests(test=test, entry_point=entry_point, harness=harness)
    return f"{build_solution(completion, code_prompt=code_prompt, entry_point=entry_point)}\n\n\n{tail}"


def _col(kwargs: dict, name: str, n: int) -> list | None:
    col = kwargs.get(name)
    if col is None:
        return None
    col = list(col)
    if len(col) != n:
        raise ValueError(f"code_reward: column {name!r} has {len(col)} values for {n} completions")
    return col


def make_code_reward(
    *, timeout_s: float = 5.0, memory_mb: int = 1024, num_workers: int = 2, max_procs: int = 1
) -> Callable[..., list[float]]:
    """Build a TRL-style code reward with the given sandbox limits.

    Args:
        timeout_s: wall-clock seconds per sample (then both of its sandboxes are killed).
        memory_mb: memory of each sandbox as a whole (processes + tmpfs), MiB.
        num_workers: samples checked in parallel (threads, each waiting on two child processes).
        max_procs: processes/threads each sandbox may have at once; 1 (default) = no fork.

    Returns:
        ``fn(prompts, completions, **columns) -> list[float]``; see :func:`code_reward`.

    Raises:
        ValueError: non-positive limits, or ``memory_mb`` too small for ``max_procs`` processes.
    """
    if num_workers < 1:
        raise ValueError(f"code reward num_workers must be >= 1, got {num_workers}")
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs)

    def code_reward(prompts: Sequence[str], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """1.0 if the completion passes the problem's tests, else 0.0.

        The completion's code runs in one sandbox; the tests run in another that holds no
        untrusted code and receives the solution's results as plain data only, so the verdict
        cannot be forged from inside the solution (see :mod:`das_jax.rl.rewards.code_check`).

        Columns (kwargs, one value per completion): ``test`` + ``entry_point`` (HumanEval), or
        ``answer`` (a full test harness, as in ``Problem.answer`` for code problems); optional
        ``code_prompt`` (the function signature + docstring the completion continues; see
        ``das_jax.data.reward_kwargs``).

        Raises:
            ValueError: no test columns, or a column of the wrong length.
        """
        comps = [_as_text(c) for c in completions]
        n = len(comps)
        tests, eps = _col(kwargs, "test", n), _col(kwargs, "entry_point", n)
        answers, code_prompts = _col(kwargs, "answer", n), _col(kwargs, "code_prompt", n)
        if (tests is None or eps is None) and answers is None:
            raise ValueError(f"code_reward: needs columns test + entry_point, or answer; got {sorted(kwargs)}")

        def one(i: int) -> float:
            prompt = code_prompts[i] if code_prompts else None
            ep = eps[i] if eps else None
            try:
                tests_src = build_tests(test=tests[i] if tests and ep else None, entry_point=ep,
                                        harness=answers[i] if answers else None)
                # the functions the tests take from the solution: the prompt's stubs, the names the
                # tests use without defining them, and the entry point
                names = stub_functions(prompt) if prompt else []
                names += [x for x in free_names(*(s for s in (prompt, tests_src) if s)) if x not in names]
                names += [ep] if ep and ep not in names else []
            except (ValueError, SyntaxError) as e:  # a dataset problem: this sample only
                logger.error("code_reward: sample %d: unusable tests (%s: %s); reward 0", i, type(e).__name__, e)
                return 0.0
            solution = build_solution(comps[i], code_prompt=prompt, entry_point=ep)
            r = check_solution(solution, tests_src, prompt=prompt, functions=names, limits=limits)
            if r.status == "error":
                logger.error("code_reward: sandbox error: %s", r.detail[-500:])
            return 1.0 if r.passed else 0.0

        if num_workers == 1 or n <= 1:
            return [one(i) for i in range(n)]
        with ThreadPoolExecutor(max_workers=min(num_workers, n), thread_name_prefix="das-code-reward") as ex:
            return list(ex.map(one, range(n)))

    code_reward.__name__ = "code_reward"
    return code_reward


#: The default code reward: 5 s timeout, 1 GiB per sandbox, no fork, 2 parallel workers.
code_reward = make_code_reward()
