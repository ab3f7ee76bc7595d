"""Code reward (HumanEval-style): 1.0 if the completion passes the problem's tests, judged outside
the sandbox that runs the completion (:mod:`das_jax.rl.rewards.code_check`)."""

from __future__ import annotations

import collections
import logging
import os
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from das_jax.rl.rewards.code_check import MAX_MESSAGE_MB, check_solution, free_names, stub_functions
from das_jax.rl.rewards.math_reward import as_text as _as_text
from das_jax.rl.rewards.sandbox import SANDBOX_MODES, SandboxLimits, SandboxUnavailableError, require_sandbox

logger = logging.getLogger(__name__)

__all__ = ["code_reward", "make_code_reward", "build_program", "build_solution", "build_tests", "extract_code",
           "RewardEvents", "default_workers"]

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


def default_workers() -> int:
    """Code samples judged in parallel by default: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class RewardEvents:
    """Thread-safe counts of a reward's notable outcomes since the last :meth:`take`: ``timeout``
    (a sample used up its CPU time or hit the wall-clock backstop), ``too_large`` (a call's
    arguments or reply went over the message limit), ``error`` (the sandbox failed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter = collections.Counter()

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._counts[kind] += n

    def take(self) -> dict[str, int]:
        """The counts so far (``{kind: n}``), and reset them."""
        with self._lock:
            out, self._counts = dict(self._counts), collections.Counter()
        return out


_SELF_TEST_TESTS = "assert f(1) == 2\nassert f(-3) == -2\nassert f(10 ** 5000) == 10 ** 5000 + 1\n"
_SELF_TESTED: set = set()
_SELF_TEST_CASES = (("def f(x):\n    return x + 1\n", True), ("def f(x):\n    return x\n", False))


def make_code_reward(
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    num_workers: int | None = None,
    max_procs: int = 1,
    sandbox: str = "isolated",
    max_message_mb: float = MAX_MESSAGE_MB,
    wall_timeout_s: float | None = None,
) -> Callable[..., list[float]]:
    """Build a TRL-style code reward with the given sandbox limits.

    Args:
        timeout_s: CPU seconds per sample, for each of its two sandboxes (``RLIMIT_CPU``, counted
            from the program's start: interpreter start-ups and waiting on a busy machine do
            not count).
        memory_mb: memory of each sandbox as a whole (processes + tmpfs), MiB.
        num_workers: samples checked in parallel (threads, each waiting on two child processes);
            None: :func:`default_workers` (the CPU count).
        max_procs: processes/threads each sandbox may have at once; 1 (default) = no fork.
        sandbox: ``"isolated"`` (Linux namespaces; refuse where unavailable) or ``"unisolated"``
            (accept the Landlock + seccomp sandbox where namespaces are unavailable); the
            ``rewards.sandbox`` setting.
        max_message_mb: largest arguments / reply of one call, MiB of JSON.
        wall_timeout_s: wall-clock backstop per sample (default ``4 * timeout_s + 10``).

    Returns:
        ``fn(prompts, completions, **columns) -> list[float]``; see :func:`code_reward`. It also
        has ``fn.events`` (a :class:`RewardEvents`: timeouts, oversize messages and sandbox errors,
        for the trainer's ``reward_timeouts`` metric) and ``fn.self_test()``.

    Raises:
        ValueError: non-positive limits, ``memory_mb`` too small for ``max_procs`` processes, or
            an unknown ``sandbox``.
    """
    if num_workers is None:
        num_workers = default_workers()
    if num_workers < 1:
        raise ValueError(f"code reward num_workers must be >= 1, got {num_workers}")
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"code reward sandbox must be one of {', '.join(SANDBOX_MODES)}, got {sandbox!r}")
    if not max_message_mb > 0:
        raise ValueError(f"code reward max_message_mb must be > 0, got {max_message_mb}")
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs,
                           wall_timeout_s=wall_timeout_s)
    events = RewardEvents()

    def check(solution: str, tests_src: str, prompt: str | None, names: list[str]):
        return check_solution(solution, tests_src, prompt=prompt, functions=names, limits=limits, sandbox=sandbox,
                              max_message_mb=max_message_mb)

    def code_reward(prompts: Sequence[str], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """1.0 if the completion passes the problem's tests, else 0.0.

        The completion's code runs in one sandbox; the tests run in another that holds no
        untrusted code and receives the solution's results as plain data only, so the verdict
        cannot be forged from inside the solution (see :mod:`das_jax.rl.rewards.code_check`).
        Samples that time out, exceed the message limit or meet a sandbox error score 0.0 and
        are counted in ``code_reward.events``; one log line per call sums them up.

        Columns (kwargs, one value per completion): ``test`` + ``entry_point`` (HumanEval), or
        ``answer`` (a full test harness, as in ``Problem.answer`` for code problems); optional
        ``code_prompt`` (the function signature + docstring the completion continues; see
        ``das_jax.data.reward_kwargs``).

        Raises:
            ValueError: no test columns, or a column of the wrong length.
            SandboxUnavailableError: the sandbox cannot run here (see ``sandbox``).
        """
        comps = [_as_text(c) for c in completions]
        n = len(comps)
        tests, eps = _col(kwargs, "test", n), _col(kwargs, "entry_point", n)
        answers, code_prompts = _col(kwargs, "answer", n), _col(kwargs, "code_prompt", n)
        if (tests is None or eps is None) and answers is None:
            raise ValueError(f"code_reward: needs columns test + entry_point, or answer; got {sorted(kwargs)}")
        require_sandbox(sandbox)  # refuse before any sample, in one line
        statuses: list[str] = [""] * n

        def one(i: int) -> float:
            score, statuses[i] = _score_sample(
                comps[i], check, test=tests[i] if tests else None, entry_point=eps[i] if eps else None,
                harness=answers[i] if answers else None,
                prompt=code_prompts[i] if code_prompts else None, index=i)
            return score

        if num_workers == 1 or n <= 1:
            out = [one(i) for i in range(n)]
        else:
            with ThreadPoolExecutor(max_workers=min(num_workers, n), thread_name_prefix="das-code-reward") as ex:
                out = list(ex.map(one, range(n)))
        counts = collections.Counter(s for s in statuses if s in ("timeout", "too_large", "error"))
        for kind, k in counts.items():
            events.add(kind, k)
        if counts:
            logger.warning(
                "code_reward: %d of %d sample(s) scored 0 without a verdict: %s (limits: %g s CPU per sandbox, "
                "%g s wall; %g MiB per message)", sum(counts.values()), n,
                ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), limits.timeout_s, limits.wall_s,
                max_message_mb)
        return out

    def self_test() -> None:
        """Judge one correct and one wrong solution; raise if either verdict is wrong (once per
        process and configuration: a passing self-test is remembered).

        Raises:
            SandboxUnavailableError: the sandbox cannot run here, or gave a wrong verdict (the
                one-line message names ``rewards.sandbox`` and what went wrong).
        """
        _self_test(check, sandbox, limits, max_message_mb)

    code_reward.__name__ = "code_reward"
    code_reward.events = events  # type: ignore[attr-defined]
    code_reward.self_test = self_test  # type: ignore[attr-defined]
    code_reward.sandbox = sandbox  # type: ignore[attr-defined]
    return code_reward


def _score_sample(completion: str, check: Callable, *, test: str | None, entry_point: str | None,
                  harness: str | None, prompt: str | None, index: int) -> tuple[float, str]:
    """(reward, sandbox status) of one completion: 1.0 when it passes its tests in `check`'s
    sandboxes; 0.0 with status "" when the sample's tests are unusable (a dataset problem,
    logged)."""
    ep = entry_point
    try:
        tests_src = build_tests(test=test if ep else None, entry_point=ep, harness=harness)
        # the functions the tests take from the solution: the prompt's stubs, the names the
        # tests use without defining them, and the entry point
        names = stub_functions(prompt) if prompt else []
        names += [x for x in free_names(*(s for s in (prompt, tests_src) if s)) if x not in names]
        names += [ep] if ep and ep not in names else []
    except (ValueError, SyntaxError) as e:  # a dataset problem: this sample only
        logger.error("code_reward: sample %d: unusable tests (%s: %s); reward 0", index, type(e).__name__, e)
        return 0.0, ""
    solution = build_solution(completion, code_prompt=prompt, entry_point=ep)
    r = check(solution, tests_src, prompt, names)
    if r.status == "error":
        logger.error("code_reward: sandbox error: %s", r.detail[-500:])
    return (1.0 if r.passed else 0.0), r.status


def _self_test(check: Callable, sandbox: str, limits: SandboxLimits, max_message_mb: float) -> None:
    """`fn.self_test()` of :func:`make_code_reward`: judges one correct and one wrong solution
    with `check`; raises SandboxUnavailableError if either verdict is wrong."""
    caps = require_sandbox(sandbox)
    # a passing verdict holds for this temp dir (the sandbox's work dirs live under it)
    key = (sandbox, caps.mode, limits, max_message_mb, tempfile.gettempdir())
    if key in _SELF_TESTED:
        return
    for solution, want in _SELF_TEST_CASES:
        r = check(solution, _SELF_TEST_TESTS, None, ["f"])
        if r.passed != want:
            why = " ".join((r.detail or r.solution_stderr or "no output").split())[-300:]
            raise SandboxUnavailableError(
                f"code reward self-test: the sandbox judged a {'correct' if want else 'wrong'} solution "
                f"{r.status} (rewards.sandbox={sandbox}, mode {caps.mode}: {why}); code rewards would be "
                "wrong, so training stops: fix the sandbox (a writable temp dir, $DAS_JAX_SANDBOX_PYTHON "
                "readable by other users) or set rewards.sandbox")
    _SELF_TESTED.add(key)


#: The default code reward: 5 CPU-seconds per sandbox, 1 GiB per sandbox, no fork, isolated
#: sandbox only, one worker per CPU.
code_reward = make_code_reward()
