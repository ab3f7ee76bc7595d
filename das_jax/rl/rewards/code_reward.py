"""Code reward (HumanEval-style): run completion + tests in the sandbox, 1.0 if they pass."""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from das_jax.rl.rewards.math_reward import as_text as _as_text
from das_jax.rl.rewards.sandbox import SandboxResult, run_in_sandbox

logger = logging.getLogger(__name__)

__all__ = ["code_reward", "make_code_reward", "build_program", "extract_code"]

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


def build_program(
    completion: str,
    *,
    code_prompt: str | None = None,
    test: str | None = None,
    entry_point: str | None = None,
    harness: str | None = None,
) -> str:
    """Assemble the program to run: ``code_prompt`` + the completion's code + the test harness.

    If the code redefines ``entry_point`` at top level it is appended after the prompt (so helper
    functions and imports of the prompt stay available); otherwise it is treated as the
    continuation of the prompt's function body. The harness is ``test`` + ``check(entry_point)``
    when both are given, else ``harness`` (e.g. a Problem's ``answer``).

    Raises:
        ValueError: neither (``test``, ``entry_point``) nor ``harness`` is given.
    """
    if test is not None and entry_point:
        tail = f"{test}\n\ncheck({entry_point})\n"
    elif harness is not None:
        tail = harness
    else:
        raise ValueError("build_program needs test + entry_point, or harness")
    code = extract_code(completion, entry_point)
    prompt = code_prompt or ""
    if prompt and entry_point and re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        body = prompt.rstrip("\n") + "\n    pass\n\n\n" + code
    else:
        body = prompt + code
    return f"{body}\n\n\n{tail}"


def _col(kwargs: dict, name: str, n: int) -> list | None:
    col = kwargs.get(name)
    if col is None:
        return None
    col = list(col)
    if len(col) != n:
        raise ValueError(f"code_reward: column {name!r} has {len(col)} values for {n} completions")
    return col


def make_code_reward(
    *, timeout_s: float = 5.0, memory_mb: int = 1024, num_workers: int = 2, max_procs: int = 16
) -> Callable[..., list[float]]:
    """Build a TRL-style code reward with the given sandbox limits.

    Args:
        timeout_s: wall-clock seconds per sample (the process group is killed after that).
        memory_mb: address-space limit per sample, MiB.
        num_workers: samples run in parallel (threads, each waiting on one child process).
        max_procs: ``RLIMIT_NPROC`` for the child.

    Returns:
        ``fn(prompts, completions, **columns) -> list[float]``; see :func:`code_reward`.
    """
    if timeout_s <= 0 or memory_mb <= 0 or num_workers < 1:
        raise ValueError("timeout_s and memory_mb must be > 0 and num_workers >= 1")

    def code_reward(prompts: Sequence[str], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """1.0 if the completion passes the problem's tests in the sandbox, else 0.0.

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
        programs = []
        for i, c in enumerate(comps):
            programs.append(
                build_program(
                    c,
                    code_prompt=code_prompts[i] if code_prompts else None,
                    test=tests[i] if tests and eps else None,
                    entry_point=eps[i] if eps else None,
                    harness=answers[i] if answers else None,
                )
            )

        def one(prog: str) -> SandboxResult:
            return run_in_sandbox(prog, timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs)

        if num_workers == 1 or n <= 1:
            results = [one(p) for p in programs]
        else:
            with ThreadPoolExecutor(max_workers=min(num_workers, n), thread_name_prefix="das-code-reward") as ex:
                results = list(ex.map(one, programs))
        for r in results:
            if r.status == "error":
                logger.error("code_reward: sandbox error: %s", r.stderr[-500:])
        return [1.0 if r.passed else 0.0 for r in results]

    code_reward.__name__ = "code_reward"
    return code_reward


#: The default code reward: 5 s timeout, 1 GiB memory, 2 parallel workers.
code_reward = make_code_reward()
