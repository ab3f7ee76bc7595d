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

import ctypes
import logging
import platform
import shutil
import tempfile
import threading

# The types and host facts live in sandbox_host, the running sandbox in sandbox_process; this module
# re-exports their public names (code_check imports CPU_LIMIT_EXIT, SETUP_FAILED_EXIT and
# SandboxProcess from here, the tests ``_UID_RANGE`` and ``_interpreters``).
from das_jax.rl.rewards.sandbox_host import (CPU_LIMIT_EXIT, RUNNER, SANDBOX_MODES, SETUP_FAILED_EXIT,  # noqa: F401
                                             SYSTEM_PATHS, SandboxCapabilities, SandboxLimits, SandboxResult,
                                             SandboxUnavailableError, fresh_uid, is_root, sweep_stale_dirs)
from das_jax.rl.rewards.sandbox_host import UID_RANGE as _UID_RANGE  # noqa: F401
from das_jax.rl.rewards.sandbox_host import interpreters as _interpreters
from das_jax.rl.rewards.sandbox_process import SandboxProcess, run_exec  # noqa: F401

logger = logging.getLogger(__name__)

__all__ = ["SandboxResult", "SandboxCapabilities", "SandboxLimits", "SandboxUnavailableError", "run_in_sandbox",
           "sandbox_capabilities", "require_sandbox", "SANDBOX_MODES"]

_NS_FLAGS = ("--mount", "--pid", "--net", "--ipc", "--fork", "--kill-child")

_caps_lock = threading.Lock()
_caps: SandboxCapabilities | None = None
_warned_unisolated = False


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
        if is_root():
            out.append(SandboxCapabilities("namespaces", (*pd, unshare, *_NS_FLAGS, "--"), True, True, True, True,
                                           pys[0]))
        out.append(SandboxCapabilities("user-namespaces",
                                       (*pd, unshare, "--user", "--map-root-user", *_NS_FLAGS, "--"),
                                       True, True, True, True, pys[0]))
    out += [SandboxCapabilities("unisolated", (), False, False, False, is_root(), py) for py in pys]
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
    if platform.machine() not in ("x86_64", "aarch64"):
        return 0, f"no seccomp filter for {platform.machine()} (x86_64 and aarch64 only)"
    try:
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


def sandbox_capabilities(refresh: bool = False) -> SandboxCapabilities:
    """The strongest sandbox that works here, found by running a tiny probe program under each
    candidate configuration (once per process; ``refresh=True`` probes again). ``mode == "none"``
    when nothing works; ``reason`` says why each isolated mode failed ("unshare not found on PATH",
    "user namespaces disabled: ..."), ``unisolated_reason`` why the unisolated mode did."""
    global _caps
    with _caps_lock:
        if _caps is not None and not refresh:
            return _caps
        sweep_stale_dirs()
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
            r = run_exec(_PROBE.format(runner=RUNNER, tmp=tempfile.gettempdir()), cand, limits, guard=True,
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
    return run_exec(program, require_sandbox(sandbox, setting="sandbox"), limits, guard=guard)
