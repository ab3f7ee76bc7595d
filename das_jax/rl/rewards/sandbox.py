"""Run untrusted Python (model-written code + tests) in an isolated child process.

Layers, strongest first (each is used when this machine supports it; see
:func:`sandbox_capabilities`):

1. A separate process in a new session, killed as a whole process group on a wall-clock
   timeout, with resource limits set in the child before any untrusted code runs:
   ``RLIMIT_AS``/``RLIMIT_DATA`` (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``,
   ``RLIMIT_CORE=0``, ``RLIMIT_NPROC``. (Limits are set by the child launcher rather than a
   ``preexec_fn``, which is unsafe when the caller runs sandboxes from threads.)
2. Linux namespaces via ``unshare``: a new network namespace (no interfaces but a downed
   loopback: no network) and a new PID namespace (``--kill-child``: when the sandbox's first
   process dies, the kernel kills everything it spawned, so fork bombs and orphans cannot
   outlive the run). As root, ``unshare --net --pid``; otherwise a user namespace is tried.
3. Privilege drop: when started as root, the child switches to ``nobody`` before running the
   program. Then ``RLIMIT_NPROC`` is enforced (root ignores it), and the program cannot touch
   files it does not own (e.g. delete the caller's data).
4. A fresh temporary working directory (``HOME``/``TMPDIR`` point inside it), deleted afterwards.
5. A reliability guard (after OpenAI human-eval): ``os.remove/unlink/rmdir/kill/fork/system``,
   ``shutil.rmtree``, ``subprocess.*`` and ``socket.socket`` raise ``PermissionError``.

A run passes only if the program ran to completion without an exception: the child then writes
a secret per-run token; exiting early with status 0 (``sys.exit(0)``, ``os._exit(0)``) fails.
Known limits: code that introspects the launcher's frames could find the token; files written to
world-writable dirs outside the work dir (``/dev/shm``) are not cleaned up (size-capped by
``RLIMIT_FSIZE`` per file). Use a container / VM for adversarial code at scale.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["SandboxResult", "SandboxCapabilities", "run_in_sandbox", "sandbox_capabilities"]

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_runner.py")
_OUTPUT_TAIL = 4000


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        passed: the program ran to the end without an exception.
        status: ``"passed"``, ``"failed"`` (exception / non-zero exit / early exit),
            ``"timeout"`` (killed after ``timeout_s``) or ``"error"`` (the sandbox itself failed).
        returncode: the child's exit status (negative: killed by that signal), None if unknown.
        elapsed_s: wall-clock seconds, start to reap.
        stdout, stderr: the last few KB of each stream.
    """

    passed: bool
    status: str
    returncode: int | None
    elapsed_s: float
    stdout: str = ""
    stderr: str = ""


@dataclass(frozen=True)
class SandboxCapabilities:
    """What isolation this machine gives the sandbox (probed once per process).

    Attributes:
        prefix: the command prefix (``unshare ...``) or ``()``.
        net_namespace: network namespace in use (no network at all).
        pid_namespace: PID namespace in use (all descendants die with the run).
        drop_privileges: the program runs as ``drop_uid`` (root -> nobody).
        drop_uid, drop_gid: the ids switched to, or None.
        python: the interpreter that runs the program. ``sys.executable`` unless its standard
            library is unreadable after the privilege drop (e.g. a root-only pyenv), in which
            case a system ``python3`` is used; override with ``$DAS_JAX_SANDBOX_PYTHON``.
    """

    prefix: tuple[str, ...]
    net_namespace: bool
    pid_namespace: bool
    drop_privileges: bool
    drop_uid: int | None = None
    drop_gid: int | None = None
    python: str = sys.executable


_caps_lock = threading.Lock()
_caps: SandboxCapabilities | None = None


def _nobody() -> tuple[int, int]:
    try:
        import pwd  # noqa: PLC0415

        pw = pwd.getpwnam("nobody")
        return pw.pw_uid, pw.pw_gid
    except (ImportError, KeyError):
        return 65534, 65534


def _interpreters() -> list[str]:
    out: list[str] = []
    env = os.environ.get("DAS_JAX_SANDBOX_PYTHON")
    for p in (env, sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if p and os.path.exists(p) and all(os.path.realpath(p) != os.path.realpath(q) for q in out):
            out.append(p)
    return out


def _candidates() -> list[SandboxCapabilities]:
    unshare = shutil.which("unshare")
    out: list[SandboxCapabilities] = []
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    ns = ("--net", "--pid", "--fork", "--kill-child", "--")
    pys = _interpreters()
    uid, gid = _nobody()
    if unshare:
        if is_root:
            out += [SandboxCapabilities((unshare, *ns), True, True, True, uid, gid, py) for py in pys]
            out.append(SandboxCapabilities((unshare, *ns), True, True, False, python=pys[0]))
        else:
            out.append(SandboxCapabilities((unshare, "--user", "--map-root-user", *ns), True, True, False,
                                           python=pys[0]))
    if is_root:
        out += [SandboxCapabilities((), False, False, True, uid, gid, py) for py in pys]
    out.append(SandboxCapabilities((), False, False, False, python=pys[0]))
    return out


# Lazily imports stdlib modules (fails if the stdlib is unreadable after the privilege drop).
_PROBE = (
    "import os, fractions, heapq, bisect, decimal, json, itertools, collections, math, re, string\n"
    "assert os.getcwd() and sum(range(10)) == 45\n"
)


def sandbox_capabilities(refresh: bool = False) -> SandboxCapabilities:
    """The strongest isolation that works here, found by running a tiny probe program under
    each candidate configuration (once per process; ``refresh=True`` probes again)."""
    global _caps
    with _caps_lock:
        if _caps is not None and not refresh:
            return _caps
        for cand in _candidates():
            r = _run(_PROBE, cand, timeout_s=10.0, memory_mb=1024, max_procs=16, guard=True)
            if r.passed:
                _caps = cand
                break
            logger.info("sandbox candidate %s unavailable: %s %s", cand, r.status, r.stderr[-300:])
        else:  # pragma: no cover - even a bare subprocess failed
            _caps = _candidates()[-1]
            logger.error("code sandbox: no configuration passed the probe; using a bare subprocess")
        if not (_caps.net_namespace and _caps.pid_namespace):
            logger.warning("code sandbox: running with reduced isolation: %s", _caps)
        return _caps


def run_in_sandbox(
    program: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_procs: int = 16,
    max_file_mb: int = 16,
    guard: bool = True,
) -> SandboxResult:
    """Run ``program`` (Python source) in an isolated child process (see the module docstring).

    Args:
        program: the full source to run (e.g. prompt + completion + tests + ``check(f)``).
        timeout_s: wall-clock limit in seconds; on expiry the whole process group is SIGKILLed.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB.
        max_procs: ``RLIMIT_NPROC`` (effective when privileges are dropped / not root).
        max_file_mb: largest file (including captured stdout/stderr) the child may write, MiB.
        guard: install the reliability guard (disable file deletion, fork, subprocess, sockets).

    Returns:
        A :class:`SandboxResult`. Never raises for anything the program does; an internal
        failure (e.g. cannot create a temp dir) gives ``status="error"``.
    """
    caps = sandbox_capabilities()
    return _run(program, caps, timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs,
                guard=guard, max_file_mb=max_file_mb)


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _OUTPUT_TAIL))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run(program: str, caps: SandboxCapabilities, *, timeout_s: float, memory_mb: int, max_procs: int,
         guard: bool, max_file_mb: int = 16) -> SandboxResult:
    t0 = time.monotonic()
    work = io_dir = None
    try:
        work = tempfile.mkdtemp(prefix="das_jax_sbx_")
        io_dir = tempfile.mkdtemp(prefix="das_jax_sbxio_")  # 0700, caller-only: program, logs
        if caps.drop_privileges:
            os.chown(work, caps.drop_uid, caps.drop_gid)
        prog_path = os.path.join(io_dir, "program.py")
        with open(prog_path, "w", encoding="utf-8") as f:
            f.write(program)
        cfg = {
            "cwd": work,
            "memory_bytes": int(memory_mb) * 1024 * 1024,
            "max_file_bytes": int(max_file_mb) * 1024 * 1024,
            "max_open_files": 256,
            "cpu_seconds": int(math.ceil(timeout_s)) + 1,
            "max_procs": int(max_procs),
            "drop_uid": caps.drop_uid if caps.drop_privileges else None,
            "drop_gid": caps.drop_gid if caps.drop_privileges else None,
            "guard": bool(guard),
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": work,
            "TMPDIR": work,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        token = secrets.token_hex(16)
        out_path, err_path = os.path.join(io_dir, "stdout"), os.path.join(io_dir, "stderr")
        cmd = [*caps.prefix, caps.python, "-I", _RUNNER, prog_path, json.dumps(cfg)]
        with open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=fout, stderr=ferr, cwd=work, env=env,
                                    start_new_session=True, close_fds=True)
        status = None
        try:
            try:
                proc.stdin.write((token + "\n").encode())
                proc.stdin.close()
            except OSError:
                pass
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = "timeout"
            _kill_group(proc.pid)
            rc = proc.wait()
        except BaseException:
            _kill_group(proc.pid)
            proc.wait()
            raise
        else:
            # Leftover members of the group (background children, without a PID namespace).
            if not caps.pid_namespace:
                _kill_group(proc.pid)
        stdout, stderr = _tail(out_path), _tail(err_path)
        passed = status is None and rc == 0 and token in stdout
        if status is None:
            status = "passed" if passed else "failed"
        stdout = stdout.replace(token, "").rstrip("\n")
        return SandboxResult(passed, status, rc, time.monotonic() - t0, stdout, stderr)
    except Exception as e:  # noqa: BLE001 - the sandbox must never crash the caller
        logger.error("code sandbox failed: %s: %s", type(e).__name__, e)
        return SandboxResult(False, "error", None, time.monotonic() - t0, "", f"{type(e).__name__}: {e}")
    finally:
        for d in (work, io_dir):
            if d:
                shutil.rmtree(d, ignore_errors=True)

