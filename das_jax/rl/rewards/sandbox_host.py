"""Host side of the code sandbox, the facts it runs on: its types and constants, this machine's
uids, interpreters and temp dirs (see :mod:`das_jax.rl.rewards.sandbox`, which re-exports the
public names)."""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass

from das_jax.errors import UserError

#: The child side, executed as a script (``python -I -S runner.py [tag]``) in every sandbox.
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child", "runner.py")
#: Host paths visible (read-only) inside the sandbox, besides the Python installation.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
#: Fresh uids for sandboxed programs (as root) are drawn from this range where the user namespace
#: maps it (else from the highest mapped uids).
UID_RANGE = (2_000_000, 2_000_000_000)
#: ``sandbox=`` values: ``isolated`` (namespaces, or refuse) and ``unisolated`` (namespaces where
#: available, else the unisolated mode of the module docstring).
SANDBOX_MODES = ("isolated", "unisolated")
#: Exit statuses of the sandbox runner (see ``sandbox_child/runner.py``).
CPU_LIMIT_EXIT, SETUP_FAILED_EXIT = 124, 125
DIR_PREFIX = "das_jax_sbx_"


class SandboxUnavailableError(UserError):
    """The requested sandbox cannot run on this machine (the message names the reason and the fix)."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        passed: the program ran to its end without an exception (reported by the program's own
            process: NOT proof against a hostile program; see the module docstring).
        status: ``"passed"``, ``"failed"`` (exception / non-zero exit / early exit),
            ``"timeout"`` (used up its CPU time, or the wall-clock backstop) or ``"error"`` (the
            sandbox itself failed).
        returncode: the sandbox's exit status (negative: killed by that signal), None if unknown.
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
        timeout_s: CPU seconds the program may use (``RLIMIT_CPU``, counted from the program's
            start; rounded up to whole seconds by the kernel's accounting).
        memory_mb: MiB for the sandbox as a whole: its processes' address spaces plus its tmpfs.
        max_procs: processes (and threads) the sandbox may have at once; 1 = no fork.
        max_file_mb: MiB of each private tmpfs (``/tmp``, ``/dev/shm``) and the largest file
            (including captured stdout/stderr) a process may write.
        wall_timeout_s: wall-clock backstop in seconds (a program that sleeps uses no CPU); then
            the whole sandbox is SIGKILLed. None: ``4 * timeout_s + 10`` (:attr:`wall_s`), generous
            so that a busy machine does not turn a correct program into a timeout.
    """

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_procs: int = 1
    max_file_mb: int = 16
    wall_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"sandbox timeout_s must be > 0, got {self.timeout_s}")
        if self.wall_timeout_s is not None and not self.wall_timeout_s > 0:
            raise ValueError(f"sandbox wall_timeout_s must be > 0 or None, got {self.wall_timeout_s}")
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

    @property
    def wall_s(self) -> float:
        """The wall-clock backstop, seconds."""
        return float(self.wall_timeout_s) if self.wall_timeout_s is not None else 4.0 * self.timeout_s + 10.0


@dataclass(frozen=True)
class SandboxCapabilities:
    """What isolation this machine gives the sandbox (probed once per process).

    Attributes:
        mode: ``"namespaces"`` (as root), ``"user-namespaces"`` (unprivileged), ``"unisolated"``
            (Landlock + seccomp, no namespaces) or ``"none"`` (nothing works; see ``reason``).
        prefix: the command prefix (``setpriv ... unshare ...``) or ``()``.
        mount_namespace: private filesystem view (layer 1 of the module docstring).
        pid_namespace: own PID namespace (all descendants die with the run; /proc shows only them).
        net_namespace: no network at all.
        drop_privileges: the program runs under an unprivileged uid of its own.
        python: the interpreter that runs the program (the Python of this process or, where the
            sandbox's uid cannot read it, another; override with ``$DAS_JAX_SANDBOX_PYTHON``).
        reason: why the isolated modes are not used ("" when ``isolated``): one clause per
            mode, e.g. ``"unshare not found on PATH"``.
        landlock: the Landlock ABI version the unisolated mode uses (0: none).
        unisolated_reason: why the unisolated mode cannot run here ("" when it can, or when it
            was not needed).
    """

    mode: str
    prefix: tuple[str, ...]
    mount_namespace: bool
    pid_namespace: bool
    net_namespace: bool
    drop_privileges: bool
    python: str = sys.executable
    reason: str = ""
    landlock: int = 0
    unisolated_reason: str = ""

    @property
    def isolated(self) -> bool:
        """Mount, PID and network namespaces are all in use."""
        return self.mount_namespace and self.pid_namespace and self.net_namespace

    @property
    def usable(self) -> bool:
        """Some sandbox (isolated or unisolated) works here."""
        return self.mode != "none"


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _base_python() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def interpreters() -> list[str]:
    out: list[str] = []
    env = os.environ.get("DAS_JAX_SANDBOX_PYTHON")
    for p in (env, _base_python(), "/usr/bin/python3", "/usr/local/bin/python3"):
        if p and os.path.exists(p) and all(os.path.realpath(p) != os.path.realpath(q) for q in out):
            out.append(p)
    return out


def python_paths(python: str) -> list[str]:
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


def _read_id_map(path: str) -> list[tuple[int, int]]:
    """``[(first inside id, count)]`` of a ``/proc/self/{uid,gid}_map``; the full range if unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            rows = [line.split() for line in f if line.strip()]
        return [(int(r[0]), int(r[2])) for r in rows if len(r) == 3]
    except (OSError, ValueError):
        return [(0, 1 << 32)]


def _spare_uids() -> list[tuple[int, int]]:
    """Half-open ranges ``[lo, hi)`` of ids mapped in both the uid and gid maps of this user
    namespace, above the system ids (>= 1000), without this process's uid and ``nobody``."""
    def ranges(path):
        return [(a, a + n) for a, n in _read_id_map(path)]

    out = []
    for ulo, uhi in ranges("/proc/self/uid_map"):
        for glo, ghi in ranges("/proc/self/gid_map"):
            lo, hi = max(ulo, glo, 1000), min(uhi, ghi, (1 << 32) - 1)
            if hi > lo:
                out.append((lo, hi))
    return out


def fresh_uid() -> int | None:
    """An otherwise unused uid for one sandbox (as root): random in ``UID_RANGE`` where the user
    namespace maps it, else among the highest mapped ids (a rootless container maps only its
    subordinate range). None if the namespace maps no spare id."""
    spare = _spare_uids()
    lo0, hi0 = UID_RANGE
    wide = [(max(lo, lo0), min(hi, hi0)) for lo, hi in spare if min(hi, hi0) - max(lo, lo0) >= 1 << 16]
    if wide:
        lo, hi = wide[secrets.randbelow(len(wide))]
        return lo + secrets.randbelow(hi - lo)
    own = os.getuid()
    pool = [u for lo, hi in spare for u in range(max(lo, hi - 4096), hi) if u not in (own, 65534, 65535)]
    return pool[secrets.randbelow(len(pool))] if pool else None


def _tmp_roots() -> list[str]:
    """Where unisolated-mode working directories may go: the temp dir, then common fallbacks."""
    out = []
    for d in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if d not in out and os.path.isdir(d):
            out.append(d)
    return out


def tmp_root(other_uid: bool) -> str:
    """A writable temp dir for a sandbox's working directory; one that every uid can traverse when
    the sandbox runs under another uid (pytest's or a user's private ``$TMPDIR`` is not)."""
    roots = _tmp_roots()
    for d in roots:
        if not os.access(d, os.W_OK | os.X_OK):
            continue
        if other_uid:
            path, ok = os.path.realpath(d), True
            while ok:
                try:
                    ok = bool(os.stat(path).st_mode & stat.S_IXOTH)
                except OSError:
                    ok = False
                if path == "/":
                    break
                path = os.path.dirname(path)
            if not ok:
                continue
        return d
    return roots[0] if roots else tempfile.gettempdir()


def sweep_stale_dirs() -> None:
    """Remove unisolated-mode working directories of callers that died (SIGKILL leaves them)."""
    for d in [p for root in _tmp_roots() for p in glob.glob(os.path.join(root, DIR_PREFIX + "*"))]:
        try:
            pid = int(os.path.basename(d)[len(DIR_PREFIX):].split("_", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(d, ignore_errors=True)
