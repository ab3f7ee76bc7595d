"""Judge untrusted solution code against trusted tests, with the verdict computed outside the
process that runs the untrusted code.

Two sandboxes (:mod:`das_jax.rl.rewards.sandbox`) per check, connected by two pipes:

* the **solution** sandbox runs the prompt + model-written code (untrusted) and then only answers
  call requests: it calls the named function on the given arguments and replies with the result
  as plain data (``None``/bool/int/float/str/bytes/complex and lists, tuples, dicts, sets of
  them; subclasses are sent as their base type; anything else, and any exception, fails the call);
* the **tests** sandbox runs only trusted code (the dataset's prompt, for helper functions, and
  its tests). There the solution's functions are proxies that send the arguments and rebuild the
  reply from plain data with builtin types. So every comparison (``==``, ``abs(x - y) < 1e-6``,
  ...) runs on builtin values in a process with no untrusted code; its verdict goes to this
  process over a pipe that the solution sandbox does not hold.

An object whose ``__eq__`` always returns True cannot cross the boundary; exiting early, printing
a success marker, or reading anything from the launcher's frames gives the solution process
nothing to forge. Only plain outcomes cross: a call that raises reaches the tests as
``CandidateCallError`` (for plain builtin exceptions such as ``ValueError``, a subclass of both,
so ``except ValueError`` in a test still works), never as a control-flow exception
(``StopIteration``, ``GeneratorExit``, ``SystemExit``, ...) that the solution picked.

Limits: the tests may call the solution's functions only with plain-data arguments, and
mutations of arguments do not travel back. Ints of any size cross (as hex beyond ~1200 digits). A
call's arguments or reply may be at most ``max_message_mb`` MiB of JSON (default 64) and nested at
most 64 levels deep (lists, dicts, tuples, sets): beyond either the call fails and the check's
status is ``"too_large"`` (reported, not a silent failure). Time:
each sandbox may use ``limits.timeout_s`` seconds of CPU (not counting interpreter start-up); a
wall-clock backstop (``limits.wall_s``) ends sandboxes that sleep or block.
"""

from __future__ import annotations

import ast
import builtins
import json
import logging
import os
import time
from dataclasses import dataclass

from das_jax.rl.rewards.sandbox import CPU_LIMIT_EXIT, SETUP_FAILED_EXIT, SandboxLimits, SandboxProcess, \
    require_sandbox

logger = logging.getLogger(__name__)

__all__ = ["CheckResult", "check_solution", "stub_functions", "free_names"]

#: Default limit of one call's arguments or reply, MiB of JSON.
MAX_MESSAGE_MB = 64


@dataclass(frozen=True)
class CheckResult:
    """Outcome of :func:`check_solution`.

    Attributes:
        passed: the trusted tests ran to their end without an exception.
        status: ``"passed"``, ``"failed"``, ``"timeout"`` (a sandbox used up its CPU time, or the
            wall-clock backstop), ``"too_large"`` (the tests failed after a call's arguments or
            reply went over ``max_message_mb`` or 64 levels of nesting) or ``"error"`` (the sandbox itself failed).
        calls: calls the tests made to the solution (when passed; else 0).
        elapsed_s: wall-clock seconds.
        detail: the last lines of the tests' stderr (why it failed), or the error.
        solution_stdout, solution_stderr: the last few KB of the solution process's output.
    """

    passed: bool
    status: str
    calls: int
    elapsed_s: float
    detail: str = ""
    solution_stdout: str = ""
    solution_stderr: str = ""


def _is_stub(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # docstring
    return all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                            and s.value.value is Ellipsis) for s in body)


def stub_functions(prompt: str) -> list[str]:
    """Top-level functions of ``prompt`` without a body (docstring / ``pass`` / ``...`` only):
    what a completion must implement. ``[]`` if the prompt does not parse."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_stub(n)]


def free_names(*sources: str) -> list[str]:
    """Names loaded in ``sources`` that none of them binds and that are not builtins (the
    functions the tests expect the solution to define), in order of first use.

    Raises:
        SyntaxError: a source does not parse.
    """
    bound: set[str] = set(dir(builtins)) | {"__name__", "__file__", "__doc__"}
    loaded: list[str] = []
    for src in sources:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Load):
                    loaded.append(node.id)
                else:
                    bound.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    bound.add((a.asname or a.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.add(node.name)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                pass
            elif hasattr(ast, "MatchAs") and isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
                bound.add(node.name)
    out: list[str] = []
    for n in loaded:
        if n not in bound and n not in out:
            out.append(n)
    return out


def _last_lines(text: str, n: int = 3) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def check_solution(
    solution: str,
    tests: str,
    *,
    prompt: str | None = None,
    functions: list[str] | None = None,
    limits: SandboxLimits | None = None,
    sandbox: str = "isolated",
    max_message_mb: float = MAX_MESSAGE_MB,
) -> CheckResult:
    """Run ``tests`` (trusted) against the functions that ``solution`` (untrusted) defines.

    Args:
        solution: the full untrusted source (prompt + completion), run in the solution sandbox.
        tests: trusted test code, e.g. HumanEval's ``test`` + ``check(entry_point)``. It passes
            if it runs to its end without an exception.
        prompt: trusted code run before ``tests`` in the tests sandbox (helper functions the tests
            use, e.g. HumanEval's ``poly``); its stub functions become proxies.
        functions: names to proxy to the solution; default: ``prompt``'s stub functions plus the
            names ``tests`` uses without defining.
        limits: limits of EACH of the two sandboxes: ``timeout_s`` CPU seconds each (from the
            program's start), ``wall_s`` the wall-clock backstop of the whole check.
        sandbox: ``"isolated"`` or ``"unisolated"`` (see :func:`~das_jax.rl.rewards.sandbox.require_sandbox`).
        max_message_mb: largest JSON message (a call's arguments, or its reply), MiB.

    Returns:
        A :class:`CheckResult`; never raises for anything the solution does.

    Raises:
        SyntaxError: ``tests`` or ``prompt`` does not parse (a dataset problem, not a model's).
        SandboxUnavailableError: the requested sandbox cannot run on this machine.
    """
    limits = limits or SandboxLimits()
    if functions is None:
        names = stub_functions(prompt) if prompt else []
        names += [n for n in free_names(*(s for s in (prompt, tests) if s)) if n not in names]
    else:
        names = list(functions)
    caps = require_sandbox(sandbox)
    max_msg = max(1, int(float(max_message_mb) * (1 << 20)))
    t0 = time.monotonic()
    sol, chk = SandboxProcess(caps, limits), SandboxProcess(caps, limits)
    fds: list[int] = []
    try:
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        stat_r, stat_w = os.pipe()
        fds += [req_r, req_w, resp_r, resp_w, stat_r, stat_w]
        sol.start({"mode": "serve", "program": solution, "allowed": names, "max_msg_bytes": max_msg,
                   "guard": True}, {"req": req_r, "resp": resp_w})
        chk.start({"mode": "check", "program": tests, "prompt": prompt or "", "proxies": names,
                   "max_msg_bytes": max_msg}, {"req": req_w, "resp": resp_r, "status": stat_w})
        for fd in (req_r, req_w, resp_r, resp_w, stat_w):  # only the children hold these now
            os.close(fd)
            fds.remove(fd)
        rc = chk.wait(limits.wall_s)
        timed_out = rc is None
        chk.kill()
        # the solution ends by itself once the tests' end closes its request pipe; its exit status
        # says whether it used up its CPU time
        sol_rc = sol.wait(0 if timed_out else min(5.0, max(0.5, limits.wall_s - (time.monotonic() - t0))))
        sol.kill()
        sol_rc = sol.proc.returncode
        rc = chk.proc.returncode
        raw = b""
        os.set_blocking(stat_r, False)
        try:
            raw = os.read(stat_r, 4096)
        except BlockingIOError:
            pass
        verdict = {}
        try:
            verdict = json.loads(raw.decode()) if raw else {}
        except ValueError:
            pass
        if not isinstance(verdict, dict):
            verdict = {}
        passed = not timed_out and rc == 0 and verdict.get("verdict") == "pass"
        calls = int(verdict.get("calls", 0)) if passed else 0
        _, chk_err = chk.output()
        sol_out, sol_err = sol.output()
        if passed:
            status = "passed"
        elif timed_out or CPU_LIMIT_EXIT in (rc, sol_rc):
            status = "timeout"
        elif SETUP_FAILED_EXIT in (rc, sol_rc):
            status = "error"
        elif verdict.get("oversize"):
            status = "too_large"
        else:
            status = "failed"
        detail = _last_lines(chk_err) if status != "error" else _last_lines(chk_err + "\n" + sol_err)
        return CheckResult(passed, status, calls, time.monotonic() - t0, detail, sol_out, sol_err)
    except Exception as e:  # noqa: BLE001 - the sandbox must never crash the caller
        logger.error("code check failed: %s: %s", type(e).__name__, e)
        return CheckResult(False, "error", 0, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    finally:
        for fd in fds:
            os.close(fd)
        chk.cleanup()
        sol.cleanup()
