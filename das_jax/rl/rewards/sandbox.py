"""Run untrusted Python (model-written code) in an isolated child process.

Isolation (each layer used when this machine allows it; :func:`sandbox_capabilities` says which):

1. **Namespaces** (``unshare`` from util-linux): new mount, PID, network and IPC namespaces. The
   child builds a private root: read-only ``/usr``, ``/bin``, ``/lib*``, ``/sbin``,
   ``/etc/ld.so.cache`` and the Python installation; a minimal ``/dev`` (null, zero, random,
   urandom); private, size-capped tmpfs ``/tmp`` (the working directory and ``HOME``) and
   ``/dev/shm``; a ``/proc`` that shows only the sandbox's own processes. The host root is
   detached (``pivot_root``): the project tree, datasets, the host's ``/tmp`` and other
   processes' command lines are not reachable, and everything written is gone when the sandbox
   ends. No network interface but a downed loopback. The sandbox's first process is PID 1 of its
   namespace: when it dies (timeout: the whole process group is SIGKILLed; or this process dies:
   ``setpriv --pdeathsig KILL``) the kernel kills every process it spawned. As root,
   ``unshare --mount --pid --net --ipc --fork``; otherwise the same inside a user namespace
   (``--user --map-root-user``).
2. **Privilege drop**: the program runs under a fresh, otherwise unused uid (as root), or as an
   unprivileged uid of a nested user namespace; no capabilities, ``no_new_privs``, not dumpable.
3. **Resource limits** (``setrlimit`` before the drop): the memory limit bounds the sandbox as a
   whole: ``RLIMIT_NPROC = max_procs`` (counted per uid, and the uid is the sandbox's own) and
   ``RLIMIT_AS = (memory_mb - 2 * max_file_mb) / max_procs`` per process, the two tmpfs being
   ``max_file_mb`` each. With the default ``max_procs=1`` the program cannot fork or start
   threads at all. Also ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``.
   (cgroups are not used: they need a delegated cgroup-v2 subtree, which a plain process has not.)
4. A reliability guard (after OpenAI human-eval) disables ``os.remove``/``fork``/``system``,
   ``subprocess``, ``socket``, ...: defence in depth, not the boundary.

Degraded mode: where namespaces are unavailable (e.g. a container without ``CAP_SYS_ADMIN`` and
without user namespaces), the program runs as a plain child process with the limits of layer 3
(as root still under a fresh uid, so the memory bound holds and descendants that left the
process group are killed by uid at the end; otherwise ``RLIMIT_NPROC`` counts all of the user's
processes) and a temporary working directory; it can then read world-readable
files, see other processes and leave files in world-writable directories. A WARNING is logged
once, naming the reason; ``sandbox_capabilities().isolated`` is False.

:func:`run_in_sandbox` reports whether a program ran to its end. It cannot be a reward verdict,
because the program could forge it; rewards use :mod:`das_jax.rl.rewards.code_check`, whose
verdict comes from a second sandbox that runs only trusted test code.
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

__all__ = ["SandboxResult", "SandboxCapabilities", "SandboxLimits", "run_in_sandbox", "sandbox_capabilities"]

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_runner.py")
_OUTPUT_TAIL = 4000
_NS_FLAGS = ("--mount", "--pid", "--net", "--ipc", "--fork", "--kill-child")
#: Host paths visible (read-only) inside the sandbox, besides the Python installation.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
#: Fresh uids for sandboxed programs (as root) are drawn from this range.
_UID_RANGE = (2_000_000, 2_000_000_000)


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        passed: the program ran to its end without an exception (reported by the program's own
            process: NOT proof against a hostile program; see the module docstring).
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
class SandboxLimits:
    """Limits of one sandbox.

    Attributes:
        timeout_s: wall-clock seconds; then the whole sandbox is SIGKILLed.
        memory_mb: MiB for the sandbox as a whole: its processes' address spaces plus its tmpfs.
        max_procs: processes (and threads) the sandbox may have at once; 1 = no fork.
        max_file_mb: MiB of each private tmpfs (``/tmp``, ``/dev/shm``) and the largest file
            (including captured stdout/stderr) a process may write.
    """

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_procs: int = 1
    max_file_mb: int = 16

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"sandbox timeout_s must be > 0, got {self.timeout_s}")
        if self.max_procs < 1 or self.max_file_mb < 1:
            raise ValueError(f"sandbox max_procs and max_file_mb must be >= 1, got {self.max_procs}, "
                             f"{self.max_file_mb}")
        if self.per_process_mb < 32:
            raise ValueError(f"sandbox memory_mb={self.memory_mb} leaves {self.per_process_mb} MiB per process "
                             f"(max_procs={self.max_procs}, 2 x max_file_mb={self.max_file_mb} of tmpfs); "
                             "need >= 32: raise memory_mb or lower max_procs")

    @property
    def per_process_mb(self) -> int:
        """``RLIMIT_AS`` of each process, MiB."""
        return (int(self.memory_mb) - 2 * int(self.max_file_mb)) // int(self.max_procs)


@dataclass(frozen=True)
class SandboxCapabilities:
    """What isolation this machine gives the sandbox (probed once per process).

    Attributes:
        mode: ``"namespaces"`` (as root), ``"user-namespaces"`` (unprivileged) or ``"none"``.
        prefix: the command prefix (``unshare ...``) or ``()``.
        mount_namespace: private filesystem view (layer 1 of the module docstring).
        pid_namespace: own PID namespace (all descendants die with the run; /proc shows only them).
        net_namespace: no network at all.
        drop_privileges: the program runs under an unprivileged uid of its own.
        python: the interpreter that runs the program (the Python of this process, or, in the
            degraded mode, one whose standard library the dropped uid can read; override with
            ``$DAS_JAX_SANDBOX_PYTHON``).
        reason: why the stronger modes were not used ("" when ``mode != "none"``).
    """

    mode: str
    prefix: tuple[str, ...]
    mount_namespace: bool
    pid_namespace: bool
    net_namespace: bool
    drop_privileges: bool
    python: str = sys.executable
    reason: str = ""

    @property
    def isolated(self) -> bool:
        """Mount, PID and network namespaces are all in use."""
        return self.mount_namespace and self.pid_namespace and self.net_namespace


_caps_lock = threading.Lock()
_caps: SandboxCapabilities | None = None


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _base_python() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _interpreters() -> list[str]:
    out: list[str] = []
    env = os.environ.get("DAS_JAX_SANDBOX_PYTHON")
    for p in (env, _base_python(), "/usr/bin/python3", "/usr/local/bin/python3"):
        if p and os.path.exists(p) and all(os.path.realpath(p) != os.path.realpath(q) for q in out):
            out.append(p)
    return out


def _python_paths(python: str) -> list[str]:
    """Host directories the interpreter needs (its installation prefix), outside SYSTEM_PATHS."""
    real = os.path.realpath(python)
    paths = []
    if real == os.path.realpath(_base_python()):
        paths += [os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)]
    else:  # another interpreter: its prefix is two levels above bin/python
        paths.append(os.path.dirname(os.path.dirname(real)))
    out = []
    for p in paths:
        if p not in out and not any(p == s or p.startswith(s + "/") for s in SYSTEM_PATHS):
            out.append(p)
    return out


def _candidates() -> list[SandboxCapabilities]:
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    # If this process dies, the sandbox dies with it (parent-death signal on the launcher).
    pd = (setpriv, "--pdeathsig", "KILL") if setpriv else ()
    out: list[SandboxCapabilities] = []
    pys = _interpreters()
    if unshare:
        if _is_root():
            out.append(SandboxCapabilities("namespaces", (*pd, unshare, *_NS_FLAGS, "--"), True, True, True, True,
                                           pys[0]))
        out.append(SandboxCapabilities("user-namespaces",
                                       (*pd, unshare, "--user", "--map-root-user", *_NS_FLAGS, "--"),
                                       True, True, True, True, pys[0]))
    out += [SandboxCapabilities("none", pd, False, False, False, _is_root(), py) for py in pys]
    return out


# Lazily imports stdlib modules (fails if the stdlib is unreadable by the sandbox's uid), and
# checks that the private view is in place where one is claimed.
_PROBE = (
    "import os, sys, fractions, heapq, bisect, decimal, json, itertools, collections, math, re, string\n"
    "assert os.getcwd() and sum(range(10)) == 45\n"
    "if sys.argv[-1] == 'isolated':\n"
    "    assert os.getpid() == 1, os.getpid()\n"
    "    assert not os.path.exists({runner!r})\n"
)


def sandbox_capabilities(refresh: bool = False) -> SandboxCapabilities:
    """The strongest isolation that works here, found by running a tiny probe program under
    each candidate configuration (once per process; ``refresh=True`` probes again). Logs a
    WARNING with the reason when only the degraded mode works."""
    global _caps
    with _caps_lock:
        if _caps is not None and not refresh:
            return _caps
        reasons = []
        limits = SandboxLimits(timeout_s=20.0, memory_mb=1024, max_procs=1)
        chosen = None
        for cand in _candidates():
            r = _run_exec(_PROBE.format(runner=_RUNNER), cand, limits, guard=True,
                          argv_tag="isolated" if cand.isolated else "plain")
            if r.passed:
                chosen = cand
                break
            msg = (r.stderr.strip().splitlines() or [r.status])[-1]
            reasons.append(f"{cand.mode}: {msg}")
            logger.info("sandbox mode %s (%s) unavailable: %s %s", cand.mode, cand.python, r.status, r.stderr[-300:])
        if chosen is None:  # pragma: no cover - even a bare subprocess failed
            chosen = _candidates()[-1]
            logger.error("code sandbox: no configuration passed the probe; using a bare subprocess")
        if not chosen.isolated:
            chosen = SandboxCapabilities(**{**chosen.__dict__, "reason": "; ".join(reasons)})
            logger.warning(
                "code sandbox: Linux namespaces unavailable (%s). Untrusted code runs as a plain child process "
                "with resource limits: it can read world-readable files, see other processes and leave files in "
                "/tmp. Rewards are still judged outside it.", chosen.reason)
        _caps = chosen
        return _caps


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _OUTPUT_TAIL))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class SandboxProcess:
    """One running sandbox (parent side). Use :meth:`start`, then :meth:`wait`/:meth:`kill`, and
    always :meth:`cleanup` (which kills it if still running)."""

    def __init__(self, caps: SandboxCapabilities, limits: SandboxLimits):
        self.caps, self.limits = caps, limits
        self.proc: subprocess.Popen | None = None
        self._dirs: list[str] = []
        self._uid: int | None = None
        self.out_path = self.err_path = ""

    def start(self, job: dict, pass_fds: dict[str, int], argv_tag: str = "") -> "SandboxProcess":
        """Write the job file and launch the runner. ``job`` holds ``mode``, ``program`` and the
        mode's fields; ``pass_fds`` maps the runner's names (``status``, ``req``, ``resp``) to
        this process's file descriptors, which the child inherits under the same numbers."""
        caps, lim = self.caps, self.limits
        io_dir = tempfile.mkdtemp(prefix="das_jax_sbxio_")  # 0700, caller-only: job, logs, root mount point
        self._dirs.append(io_dir)
        uid = secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0] if caps.mode != "user-namespaces" \
            and _is_root() else None
        self._uid = uid
        if caps.isolated:
            root_dir = os.path.join(io_dir, "root")
            os.mkdir(root_dir)
            cwd = "/tmp"
        else:
            cwd = tempfile.mkdtemp(prefix="das_jax_sbx_")
            self._dirs.append(cwd)
            root_dir = None
            if uid is not None:
                os.chown(cwd, uid, uid)
        job = {
            **job,
            "isolate": caps.isolated,
            "root_dir": root_dir,
            "ro_paths": [*SYSTEM_PATHS, *_python_paths(caps.python)],
            "disk_bytes": int(lim.max_file_mb) << 20,
            "cwd": cwd,
            "uid": uid,
            "nested_userns": caps.mode == "user-namespaces",
            "limits": {
                "as": int(lim.per_process_mb) << 20,
                "fsize": int(lim.max_file_mb) << 20,
                "nofile": 64,
                "cpu": int(math.ceil(lim.timeout_s)) + 1,
                "nproc": int(lim.max_procs),
            },
            "fds": dict(pass_fds),
        }
        job_path = os.path.join(io_dir, "job.json")
        with open(job_path, "w", encoding="utf-8") as f:
            json.dump(job, f)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": cwd,
            "TMPDIR": cwd,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        self.out_path, self.err_path = os.path.join(io_dir, "stdout"), os.path.join(io_dir, "stderr")
        cmd = [*caps.prefix, caps.python, "-I", "-S", _RUNNER, job_path, argv_tag]
        with open(self.out_path, "wb") as fout, open(self.err_path, "wb") as ferr:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fout, stderr=ferr, cwd="/", env=env,
                                         start_new_session=True, close_fds=True, pass_fds=tuple(pass_fds.values()))
        return self

    def wait(self, timeout_s: float | None) -> int | None:
        """Exit status, or None if still running after ``timeout_s``."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the whole sandbox (its process group; the PID namespace takes the rest)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        if not self.caps.pid_namespace and self._uid is not None:
            _kill_uid(self._uid, self.caps.python)

    def output(self) -> tuple[str, str]:
        """The last few KB of stdout and stderr."""
        return _tail(self.out_path), _tail(self.err_path)

    def cleanup(self) -> None:
        """Kill (if running) and delete the sandbox's host-side files."""
        try:
            self.kill()
        finally:
            for d in self._dirs:
                shutil.rmtree(d, ignore_errors=True)


def _kill_uid(uid: int, python: str) -> None:
    """SIGKILL every process of ``uid`` (degraded mode: descendants that left the process group).
    ``kill(-1)`` from a helper running as that uid reaches exactly those processes."""
    code = f"import os, signal\nos.setgroups([])\nos.setgid({uid})\nos.setuid({uid})\nos.kill(-1, signal.SIGKILL)\n"
    try:
        subprocess.run([python, "-I", "-S", "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=10, close_fds=True, env={})
    except (OSError, subprocess.SubprocessError) as e:  # pragma: no cover
        logger.warning("code sandbox: could not kill leftover processes of uid %d: %s", uid, e)


def run_in_sandbox(
    program: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_procs: int = 1,
    max_file_mb: int = 16,
    guard: bool = True,
) -> SandboxResult:
    """Run ``program`` (Python source) in an isolated child process (see the module docstring).

    Args:
        program: the full source to run.
        timeout_s: wall-clock limit in seconds; on expiry the whole sandbox is SIGKILLed.
        memory_mb: memory of the sandbox as a whole, MiB (see :class:`SandboxLimits`).
        max_procs: processes/threads at once (``RLIMIT_NPROC`` of the sandbox's own uid); 1 = no fork.
        max_file_mb: size of each private tmpfs and of the largest file written, MiB.
        guard: install the reliability guard (disable file deletion, fork, subprocess, sockets).

    Returns:
        A :class:`SandboxResult`. Never raises for anything the program does; an internal
        failure (e.g. cannot create a temp dir) gives ``status="error"``. ``passed`` is reported
        by the program's own process; do not use it as a verdict on hostile code.

    Raises:
        ValueError: limits that leave less than 32 MiB per process, or non-positive limits.
    """
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs, max_file_mb=max_file_mb)
    return _run_exec(program, sandbox_capabilities(), limits, guard=guard)


def _read_available(fd: int, limit: int = 1 << 16) -> bytes:
    """What is in the pipe now (non-blocking: a leftover writer cannot stall the caller)."""
    os.set_blocking(fd, False)
    chunks, n = [], 0
    while n < limit:
        try:
            b = os.read(fd, limit - n)
        except BlockingIOError:
            break
        if not b:
            break
        chunks.append(b)
        n += len(b)
    return b"".join(chunks)


def _run_exec(program: str, caps: SandboxCapabilities, limits: SandboxLimits, *, guard: bool,
              argv_tag: str = "") -> SandboxResult:
    t0 = time.monotonic()
    sp = SandboxProcess(caps, limits)
    status_r = status_w = -1
    try:
        status_r, status_w = os.pipe()
        sp.start({"mode": "exec", "program": program, "guard": bool(guard)}, {"status": status_w}, argv_tag)
        os.close(status_w)
        status_w = -1
        rc = sp.wait(limits.timeout_s)
        status = None
        if rc is None:
            status = "timeout"
            sp.kill()
            rc = sp.proc.returncode
        else:
            sp.kill()  # leftovers (degraded mode without a PID namespace)
        done = _read_available(status_r) == b"done\n"
        stdout, stderr = sp.output()
        passed = status is None and rc == 0 and done
        return SandboxResult(passed, status or ("passed" if passed else "failed"), rc, time.monotonic() - t0,
                             stdout.rstrip("\n"), stderr)
    except Exception as e:  # noqa: BLE001 - the sandbox must never crash the caller
        logger.error("code sandbox failed: %s: %s", type(e).__name__, e)
        return SandboxResult(False, "error", None, time.monotonic() - t0, "", f"{type(e).__name__}: {e}")
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        sp.cleanup()
