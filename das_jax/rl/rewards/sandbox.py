"""Run untrusted Python (model-written code) in an isolated child process.

Isolation (each layer used when this machine allows it; :func:`sandbox_capabilities` says which):

1. **Namespaces** (``unshare`` from util-linux): new mount, PID, network and IPC namespaces. The
   sandbox builds a private root (mounted inside its own mount namespace: nothing is created on
   the host): read-only ``/usr``, ``/bin``, ``/lib*``, ``/sbin``, ``/etc/ld.so.cache`` and the
   Python installation; a minimal ``/dev`` (null, zero, random, urandom); private, size-capped
   tmpfs ``/tmp`` (the working directory and ``HOME``) and ``/dev/shm``; a ``/proc`` that shows only
   the sandbox's own processes. The host root is detached (``pivot_root``): the project tree,
   datasets, the host's ``/tmp`` and other processes are not reachable, and everything written is
   gone when the sandbox ends. No network interface but a downed loopback. The sandbox's first
   process is PID 1 of its namespace: when it dies (wall-clock backstop: the whole process group
   is SIGKILLed; or this process dies: ``setpriv --pdeathsig KILL``) the kernel kills every
   process it spawned. As root, ``unshare --mount --pid --net --ipc --fork``; otherwise the same
   inside a user namespace (``--user --map-root-user``).
2. **Privilege drop**: the program runs under a fresh, otherwise unused uid that this user
   namespace maps (``/proc/self/uid_map``; as root), or as an unprivileged uid of a nested user
   namespace; as root without a spare mapped uid, with no capabilities. Always ``no_new_privs``,
   not dumpable, a session of its own, and a seccomp filter that makes ``kill``, ``tkill``,
   ``tgkill``, ``rt_sigqueueinfo``, ``pidfd_*``, ``ptrace``, ``process_vm_*``, ``kcmp``,
   ``setsid`` and ``setpgid`` fail: it can signal or trace nothing, and cannot leave its process
   group. Its parent is a supervisor process of the sandbox, never the caller.
3. **Resource limits** (``setrlimit``): ``RLIMIT_CPU`` = ``timeout_s`` seconds of CPU counted
   from the moment the program starts (interpreter start-up excluded); the memory limit bounds
   the sandbox as a whole: ``RLIMIT_NPROC = max_procs`` and ``RLIMIT_AS = (memory_mb - 2 *
   max_file_mb) / max_procs`` per process, the two tmpfs being ``max_file_mb`` each. With the
   default ``max_procs=1`` the program cannot fork or start threads at all. Also
   ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``. A generous wall-clock backstop
   (``SandboxLimits.wall_s``) ends programs that sleep. (cgroups are not used: they need a
   delegated cgroup-v2 subtree, which a plain process has not.)
4. A reliability guard (after OpenAI human-eval) disables ``os.remove``/``fork``/``system``,
   ``subprocess``, ``socket``, ...: defence in depth, not the boundary.

The job (the program, and for the tests sandbox the tests) reaches the sandbox over a pipe and is
never written to disk; stdout and stderr go to unlinked temporary files.

**Unisolated mode** (``sandbox="unisolated"``, the ``rewards.sandbox: unisolated`` setting):
where namespaces are unavailable (no ``unshare``, no user namespaces: e.g. Docker without
``CAP_SYS_ADMIN``, some rootless containers and clusters) a sandbox is refused unless this mode is
asked for. It needs Landlock (Linux >= 5.13) and a seccomp-capable architecture (x86_64,
aarch64): the program runs in a fresh 0700 directory (removed by its supervisor, also when the
caller dies; directories of dead callers are removed at the next start) with the layers 2-4 above,
and Landlock lets it read only the system directories and the Python installation and write only
its directory: no dataset, no tests, no caller's files, no ``/proc``; no TCP (Landlock ABI >= 4);
no signals out of the sandbox (seccomp; Landlock ABI >= 6). What it lacks against the isolated
modes: it can see that other processes exist (not their files), use UDP and unix sockets, and
read world-readable system files.
"""

from __future__ import annotations

import glob
import json
import logging
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

from das_jax.errors import UserError

logger = logging.getLogger(__name__)

__all__ = ["SandboxResult", "SandboxCapabilities", "SandboxLimits", "SandboxUnavailableError", "run_in_sandbox",
           "sandbox_capabilities", "require_sandbox", "SANDBOX_MODES"]

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_runner.py")
_OUTPUT_TAIL = 4000
_NS_FLAGS = ("--mount", "--pid", "--net", "--ipc", "--fork", "--kill-child")
#: Host paths visible (read-only) inside the sandbox, besides the Python installation.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
#: Fresh uids for sandboxed programs (as root) are drawn from this range where the user namespace
#: maps it (else from the highest mapped uids).
_UID_RANGE = (2_000_000, 2_000_000_000)
#: ``sandbox=`` values: ``isolated`` (namespaces, or refuse) and ``unisolated`` (namespaces where
#: available, else the unisolated mode of the module docstring).
SANDBOX_MODES = ("isolated", "unisolated")
#: Exit statuses of the sandbox runner (see ``_sandbox_runner``).
CPU_LIMIT_EXIT, SETUP_FAILED_EXIT = 124, 125
_DIR_PREFIX = "das_jax_sbx_"


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


_caps_lock = threading.Lock()
_caps: SandboxCapabilities | None = None
_warned_unisolated = False


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
    """An otherwise unused uid for one sandbox (as root): random in ``_UID_RANGE`` where the user
    namespace maps it, else among the highest mapped ids (a rootless container maps only its
    subordinate range). None if the namespace maps no spare id."""
    spare = _spare_uids()
    lo0, hi0 = _UID_RANGE
    wide = [(max(lo, lo0), min(hi, hi0)) for lo, hi in spare if min(hi, hi0) - max(lo, lo0) >= 1 << 16]
    if wide:
        lo, hi = wide[secrets.randbelow(len(wide))]
        return lo + secrets.randbelow(hi - lo)
    own = os.getuid()
    pool = [u for lo, hi in spare for u in range(max(lo, hi - 4096), hi) if u not in (own, 65534, 65535)]
    return pool[secrets.randbelow(len(pool))] if pool else None


def _which_unshare() -> str | None:
    return shutil.which("unshare")


def _userns_disabled() -> str:
    """Why the kernel refuses user namespaces, from its settings ("" if none says so)."""
    for path, name in (("/proc/sys/user/max_user_namespaces", "user.max_user_namespaces"),
                       ("/proc/sys/kernel/unprivileged_userns_clone", "kernel.unprivileged_userns_clone"),
                       ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
                        "kernel.apparmor_restrict_unprivileged_userns")):
        try:
            with open(path, encoding="ascii") as f:
                v = f.read().strip()
        except OSError:
            continue
        if (v == "0") != name.endswith("apparmor_restrict_unprivileged_userns"):
            return f"{name} = {v}"
    return ""


def _candidates() -> list[SandboxCapabilities]:
    """Configurations to probe, strongest first (the isolated ones, then the unisolated ones)."""
    unshare, setpriv = _which_unshare(), shutil.which("setpriv")
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
    out += [SandboxCapabilities("unisolated", (), False, False, False, _is_root(), py) for py in pys]
    return out


# Lazily imports stdlib modules (fails if the stdlib is unreadable by the sandbox's uid) and checks
# the confinement that is claimed: the private view (isolated), or that Landlock hides the host's
# temp dir and signals to the parent fail (unisolated).
_PROBE = (
    "import os, sys, fractions, heapq, bisect, decimal, json, itertools, collections, math, re, string\n"
    "assert os.getcwd() and sum(range(10)) == 45\n"
    "if sys.argv[-1] == 'isolated':\n"
    "    assert os.getpid() == 2, f'pid {{os.getpid()}} in the sandbox, expected 2'\n"
    "    assert not os.path.exists({runner!r}), 'the host tree is visible'\n"
    "else:\n"
    "    import ctypes\n"
    "    try:\n"
    "        os.listdir({tmp!r})\n"
    "        raise AssertionError('Landlock does not hide the temp dir')\n"
    "    except PermissionError:\n"
    "        pass\n"
    "    assert ctypes.CDLL(None).kill(os.getppid(), 0) != 0, 'the sandbox can signal its parent'\n"
)


def _unisolated_support() -> tuple[int, str]:
    """(Landlock ABI, why the unisolated mode cannot run here or "")."""
    import platform

    if platform.machine() not in ("x86_64", "aarch64"):
        return 0, f"no seccomp filter for {platform.machine()} (x86_64 and aarch64 only)"
    try:
        import ctypes

        r = ctypes.CDLL(None, use_errno=True).syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
        err = ctypes.get_errno()
    except (OSError, AttributeError) as e:  # pragma: no cover
        return 0, f"Landlock unavailable ({e})"
    if r < 1:
        why = {38: "the kernel has no Landlock (Linux >= 5.13 with CONFIG_SECURITY_LANDLOCK)",
               95: "Landlock is disabled (add landlock to the kernel's lsm= boot parameter)",
               1: "Landlock system calls are blocked (a seccomp profile)"}.get(err, f"Landlock errno {err}")
        return 0, why
    return int(r), ""


def _probe_line(r: SandboxResult) -> str:
    """The last meaningful line of a failed probe (never empty)."""
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    if lines:
        return lines[-1]
    return f"probe {r.status}, exit status {r.returncode}"


def _tmp_roots() -> list[str]:
    """Where unisolated-mode working directories may go: the temp dir, then common fallbacks."""
    out = []
    for d in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if d not in out and os.path.isdir(d):
            out.append(d)
    return out


def _tmp_root(other_uid: bool) -> str:
    """A writable temp dir for a sandbox's working directory; one that every uid can traverse when
    the sandbox runs under another uid (pytest's or a user's private ``$TMPDIR`` is not)."""
    import stat

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


def _sweep_stale_dirs() -> None:
    """Remove unisolated-mode working directories of callers that died (SIGKILL leaves them)."""
    for d in [p for root in _tmp_roots() for p in glob.glob(os.path.join(root, _DIR_PREFIX + "*"))]:
        try:
            pid = int(os.path.basename(d)[len(_DIR_PREFIX):].split("_", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(d, ignore_errors=True)


def sandbox_capabilities(refresh: bool = False) -> SandboxCapabilities:
    """The strongest sandbox that works here, found by running a tiny probe program under each
    candidate configuration (once per process; ``refresh=True`` probes again). ``mode == "none"``
    when nothing works; ``reason`` says why each isolated mode failed ("unshare not found on PATH",
    "user namespaces disabled: ..."), ``unisolated_reason`` why the unisolated mode did."""
    global _caps
    with _caps_lock:
        if _caps is not None and not refresh:
            return _caps
        _sweep_stale_dirs()
        reasons: list[str] = []
        uni_reasons: list[str] = []
        if _which_unshare() is None:
            reasons.append("unshare not found on PATH (util-linux)")
        abi, uni_why = _unisolated_support()
        limits = SandboxLimits(timeout_s=10.0, memory_mb=1024, max_procs=1)
        chosen = None
        for cand in _candidates():
            if cand.mode == "unisolated":
                if uni_why:
                    uni_reasons.append(uni_why)
                    break
                cand = SandboxCapabilities(**{**cand.__dict__, "landlock": abi})
            r = _run_exec(_PROBE.format(runner=_RUNNER, tmp=tempfile.gettempdir()), cand, limits, guard=True,
                          argv_tag="isolated" if cand.isolated else "plain")
            if r.passed:
                chosen = cand
                break
            line = _probe_line(r)
            if cand.mode == "user-namespaces":
                off = _userns_disabled()
                reasons.append(f"user namespaces disabled: {off or line}")
            elif cand.mode == "namespaces":
                reasons.append(f"namespaces as root: {line}")
            else:
                uni_reasons.append(f"{cand.python}: {line}")
            logger.info("sandbox mode %s (%s) unavailable: %s %s", cand.mode, cand.python, r.status, r.stderr[-300:])
        reason = "; ".join(reasons) or "the isolated modes were not tried"
        if chosen is None:
            chosen = SandboxCapabilities("none", (), False, False, False, False, _interpreters()[0], reason, abi,
                                         "; ".join(uni_reasons) or "not tried")
        elif not chosen.isolated:
            chosen = SandboxCapabilities(**{**chosen.__dict__, "reason": reason})
        _caps = chosen
        return _caps


def require_sandbox(mode: str = "isolated", *, setting: str = "rewards.sandbox") -> SandboxCapabilities:
    """The sandbox for running untrusted code with ``mode`` (one of :data:`SANDBOX_MODES`).

    ``"isolated"``: namespaces or refuse. ``"unisolated"``: namespaces where available, else the
    unisolated mode (Landlock + seccomp; a WARNING, once per process, names what it lacks).

    Raises:
        SandboxUnavailableError: the sandbox cannot run here; the one-line message names the
            reason, the fix and ``setting``.
        ValueError: an unknown ``mode``.
    """
    global _warned_unisolated
    if mode not in SANDBOX_MODES:
        raise ValueError(f"{setting} must be one of {', '.join(SANDBOX_MODES)}, got {mode!r}")
    caps = sandbox_capabilities()
    if caps.isolated:
        return caps
    fix_ns = ("install util-linux (unshare) and run as root or enable user namespaces "
              "(sysctl user.max_user_namespaces=15000 kernel.unprivileged_userns_clone=1; in Docker: "
              "--cap-add SYS_ADMIN or a seccomp profile that allows unshare)")
    if mode == "isolated":
        raise SandboxUnavailableError(
            f"code rewards refuse to run untrusted code without an isolated sandbox ({caps.reason}): {fix_ns}; "
            f"or set {setting}: unisolated to accept the weaker Landlock + seccomp sandbox knowingly"
            + ("" if caps.usable else f" (not available here either: {caps.unisolated_reason})"))
    if not caps.usable:
        raise SandboxUnavailableError(
            f"{setting}=unisolated: no sandbox works here (isolated: {caps.reason}; unisolated: "
            f"{caps.unisolated_reason}): {fix_ns}, or use a kernel with Landlock (Linux >= 5.13)")
    if not _warned_unisolated:
        _warned_unisolated = True
        logger.warning(
            "code sandbox: running untrusted code UNISOLATED (%s=unisolated; no isolated sandbox: %s). Landlock "
            "(ABI %d) and seccomp keep it from the dataset, the tests, your files and other processes, but it can "
            "read world-readable system files, see that other processes exist and use UDP/unix sockets.",
            setting, caps.reason, caps.landlock)
    return caps


class _Tail:
    """An unlinked temporary file for a child's stdout/stderr (nothing left on disk)."""

    def __init__(self) -> None:
        self.f = tempfile.TemporaryFile()

    def read(self) -> str:
        try:
            self.f.seek(0, os.SEEK_END)
            size = self.f.tell()
            self.f.seek(max(0, size - _OUTPUT_TAIL))
            return self.f.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def close(self) -> None:
        self.f.close()


class SandboxProcess:
    """One running sandbox (parent side). Use :meth:`start`, then :meth:`wait`/:meth:`kill`, and
    always :meth:`cleanup` (which kills it if still running)."""

    def __init__(self, caps: SandboxCapabilities, limits: SandboxLimits):
        self.caps, self.limits = caps, limits
        self.proc: subprocess.Popen | None = None
        self._uid: int | None = None
        self._out: _Tail | None = None
        self._err: _Tail | None = None

    def start(self, job: dict, pass_fds: dict[str, int], argv_tag: str = "") -> "SandboxProcess":
        """Launch the runner and send it the job over its stdin. ``job`` holds ``mode``,
        ``program`` and the mode's fields; ``pass_fds`` maps the runner's names (``status``,
        ``req``, ``resp``) to this process's file descriptors, which the child inherits under
        the same numbers."""
        caps, lim = self.caps, self.limits
        uid = fresh_uid() if caps.mode != "user-namespaces" and _is_root() else None
        self._uid = uid
        job = {
            **job,
            "isolate": caps.isolated,
            "landlock": caps.mode == "unisolated",
            "seccomp": True,
            "ro_paths": [*SYSTEM_PATHS, *_python_paths(caps.python)],
            "disk_bytes": int(lim.max_file_mb) << 20,
            "tmp_root": _tmp_root(uid is not None),
            "dir_prefix": f"{_DIR_PREFIX}{os.getpid()}_",
            "parent_pid": os.getpid(),
            "uid": uid,
            "nested_userns": caps.mode == "user-namespaces",
            "limits": {
                "as": int(lim.per_process_mb) << 20,
                "fsize": int(lim.max_file_mb) << 20,
                "nofile": 64,
                "cpu": float(lim.timeout_s),
                "nproc": int(lim.max_procs),
            },
            "fds": dict(pass_fds),
        }
        data = json.dumps(job).encode("utf-8")
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        self._out, self._err = _Tail(), _Tail()
        cmd = [*caps.prefix, caps.python, "-I", "-S", _RUNNER, argv_tag]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self._out.f, stderr=self._err.f, cwd="/",
                                     env=env, start_new_session=True, close_fds=True,
                                     pass_fds=tuple(pass_fds.values()))
        try:
            self.proc.stdin.write(data)
        except BrokenPipeError:  # the runner died first: its stderr says why
            pass
        finally:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        return self

    def wait(self, timeout_s: float | None) -> int | None:
        """Exit status, or None if still running after ``timeout_s``."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """End the whole sandbox. Isolated: SIGKILL its process group (the PID namespace takes the
        rest). Unisolated: SIGTERM to its supervisor, which kills the program's process group (and
        its uid's processes) and removes its directory; SIGKILL if it has not ended in 5 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None and not self.caps.isolated:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=5.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()

    def output(self) -> tuple[str, str]:
        """The last few KB of stdout and stderr."""
        return (self._out.read() if self._out else ""), (self._err.read() if self._err else "")

    def cleanup(self) -> None:
        """Kill (if running) and close the output files."""
        try:
            self.kill()
        finally:
            for t in (self._out, self._err):
                if t is not None:
                    t.close()


def run_in_sandbox(
    program: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_procs: int = 1,
    max_file_mb: int = 16,
    guard: bool = True,
    sandbox: str = "isolated",
    wall_timeout_s: float | None = None,
) -> SandboxResult:
    """Run ``program`` (Python source) in a sandboxed child process (see the module docstring).

    Args:
        program: the full source to run.
        timeout_s: CPU seconds (``RLIMIT_CPU``, from the program's start); then it is killed.
        memory_mb: memory of the sandbox as a whole, MiB (see :class:`SandboxLimits`).
        max_procs: processes/threads at once (``RLIMIT_NPROC`` of the sandbox's own uid); 1 = no fork.
        max_file_mb: size of each private tmpfs and of the largest file written, MiB.
        guard: install the reliability guard (disable file deletion, fork, subprocess, sockets).
        sandbox: ``"isolated"`` (namespaces, or raise) or ``"unisolated"`` (see :func:`require_sandbox`).
        wall_timeout_s: wall-clock backstop, seconds (default ``4 * timeout_s + 10``).

    Returns:
        A :class:`SandboxResult`. Never raises for anything the program does; an internal
        failure (e.g. no temp dir for the output) gives ``status="error"``. ``passed`` is reported
        by the program's own process; do not use it as a verdict on hostile code.

    Raises:
        ValueError: limits that leave less than 32 MiB per process, or non-positive limits.
        SandboxUnavailableError: the requested sandbox cannot run on this machine.
    """
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_procs=max_procs, max_file_mb=max_file_mb,
                           wall_timeout_s=wall_timeout_s)
    return _run_exec(program, require_sandbox(sandbox, setting="sandbox"), limits, guard=guard)


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
        rc = sp.wait(limits.wall_s)
        timed_out = rc is None
        sp.kill()
        rc = sp.proc.returncode
        done = _read_available(status_r) == b"done\n"
        stdout, stderr = sp.output()
        passed = not timed_out and rc == 0 and done
        status = ("timeout" if timed_out or rc == CPU_LIMIT_EXIT else "error" if rc == SETUP_FAILED_EXIT
                  else "passed" if passed else "failed")
        return SandboxResult(passed, status, rc, time.monotonic() - t0, stdout.rstrip("\n"), stderr)
    except Exception as e:  # noqa: BLE001 - the sandbox must never crash the caller
        logger.error("code sandbox failed: %s: %s", type(e).__name__, e)
        return SandboxResult(False, "error", None, time.monotonic() - t0, "", f"{type(e).__name__}: {e}")
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        sp.cleanup()
