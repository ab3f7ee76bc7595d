"""Confinement of the sandboxed process, set up by the runner before any untrusted code runs: the
private filesystem view (mounts, ``pivot_root``) or the unisolated mode's private directory,
resource limits, the privilege drop, capabilities, prctl hardening, Landlock, seccomp and the
reliability guard. Standard library only: the sandbox's runner imports this file as the top-level
module ``confine``."""

import ctypes
import math
import os
import signal
import sys

# ---------------------------------------------------------------------------------------------
# Isolation (runs as root of the new mount namespace, before any untrusted code).
# ---------------------------------------------------------------------------------------------
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
MNT_DETACH = 2
# statvfs f_flag bits that a read-only remount must keep (they equal the MS_* values)
_KEEP_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | (1 << 21)  # + NOATIME, NODIRATIME, RELATIME
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}


def load_libc():
    libc = ctypes.CDLL(None, use_errno=True)
    return ctypes, libc


def _check(ctypes, r, what):
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src, target, fstype, flags, data=None):
    ctypes, libc = load_libc()
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    r = libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(ctypes, r, f"mount {target}")


def _bind_ro(src, dst):
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "w"):
            pass
    _mount(src, dst, None, MS_BIND | MS_REC)
    keep = os.statvfs(src).f_flag & _KEEP_FLAGS
    _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)


def _scratch_mountpoint(ro_paths):
    """A directory to mount the new root on, inside this (private) mount namespace only: one that
    neither holds nor lies inside a path that must stay visible."""
    for d in ("/mnt", "/media", "/srv", "/opt", "/home", "/run", "/var/tmp", "/tmp"):
        if os.path.isdir(d) and not os.path.islink(d) and not any(
                p == d or p.startswith(d + "/") or d.startswith(p + "/") for p in ro_paths):
            return d
    raise OSError("sandbox: no directory to mount the private root on (tried /mnt, /media, /srv, /opt, "
                  "/home, /run, /var/tmp, /tmp)")


def build_root(job):
    """Private filesystem view; switch root into it. Nothing of the host but ``ro_paths`` stays.
    Everything is mounted inside the new mount namespace: nothing is left on the host."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = _scratch_mountpoint([p for p in job["ro_paths"] if os.path.lexists(p)])
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    for path in job["ro_paths"]:
        if not os.path.lexists(path):
            continue
        dst = root + path
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin etc.
            os.symlink(os.readlink(path), dst)
        else:
            _bind_ro(path, dst)
    dev = root + "/dev"
    os.makedirs(dev, exist_ok=True)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name in ("null", "zero", "random", "urandom"):
        with open(f"{dev}/{name}", "w"):
            pass
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    os.symlink("/proc/self/fd", dev + "/fd")
    tmpfs_opts = f"size={int(job['disk_bytes'])},nr_inodes=4096,mode=1777"
    for d in (root + "/tmp", dev + "/shm"):
        os.makedirs(d, exist_ok=True)
        _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, tmpfs_opts)
    os.makedirs(root + "/proc", exist_ok=True)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    ctypes, libc = load_libc()
    nr = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is not None and libc.syscall(nr, b".", b".") == 0:
        # the old root now sits on top of the new one: detach it
        _check(ctypes, libc.umount2(b".", MNT_DETACH), "umount old root")
    else:
        _mount(root, "/", None, MS_MOVE)
        os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def private_dir(job):
    """Unisolated mode: a fresh 0700 working directory owned by the sandbox's uid, holding nothing."""
    # deferred import: unisolated mode only (tempfile loads random, shutil, ...)
    import tempfile

    d = tempfile.mkdtemp(prefix=job["dir_prefix"], dir=job["tmp_root"])
    if job.get("uid") is not None:
        os.chown(d, job["uid"], job["uid"])
    return d


def set_limits(lim):
    import resource  # deferred import: not a global of this module (the guard blocks resource)

    for name, value in (("RLIMIT_AS", lim["as"]), ("RLIMIT_DATA", lim["as"]), ("RLIMIT_FSIZE", lim["fsize"]),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", lim["nofile"]), ("RLIMIT_NPROC", lim["nproc"]),
                        ("RLIMIT_MEMLOCK", 0), ("RLIMIT_MSGQUEUE", 0)):
        res = getattr(resource, name, None)
        if res is not None and value is not None:
            resource.setrlimit(res, (value, value))


def start_cpu_clock(seconds):
    """``RLIMIT_CPU`` = the CPU time used so far (interpreter start-up, sandbox set-up) + ``seconds``:
    SIGXCPU then, SIGKILL a second later. Returns the soft limit (s)."""
    import resource  # deferred import: not a global of this module (the guard blocks resource)

    ru = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(math.ceil(ru.ru_utime + ru.ru_stime + float(seconds)))
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    return soft


def drop_privileges(job):
    """Switch to the job's unused uid (started as root), or, inside a user namespace, into a nested
    one where we are an unprivileged uid; as root without a spare uid, drop every capability.
    Either way no capabilities remain."""
    uid = job.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif job.get("nested_userns"):
        ctypes, libc = load_libc()
        _check(ctypes, libc.unshare(0x10000000), "unshare(CLONE_NEWUSER)")
        inner = 1000
        for fname, text in (("setgroups", "deny"), ("uid_map", f"{inner} 0 1"), ("gid_map", f"{inner} 0 1")):
            with open(f"/proc/self/{fname}", "w") as f:
                f.write(text)
        os.setresgid(inner, inner, inner)
        os.setresuid(inner, inner, inner)
    elif os.geteuid() == 0:
        _drop_capabilities()
        return
    else:
        return
    if 0 in os.getresuid():  # pragma: no cover - paranoia
        raise SystemExit("sandbox: privilege drop failed")


def _drop_capabilities():
    ctypes, libc = load_libc()
    for cap in range(64):  # bounding set: no capability can come back through exec
        if libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # PR_CAPBSET_DROP; EINVAL: past the last
            break
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2): all empty
    _check(ctypes, libc.capset(hdr, data), "capset")


def prctl_hardening():
    ctypes, libc = load_libc()
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG (a uid change clears it)
    _check(ctypes, libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0: no ptrace / /proc/<pid>/mem by same uid


# Landlock (Linux >= 5.13): an unprivileged process restricts its own filesystem (and, from ABI 4,
# TCP; from ABI 6, signals and abstract unix sockets) access for itself and its descendants.
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446  # same numbers on every architecture
_LL_FS_FILE = 1 | 2 | 4  # EXECUTE, WRITE_FILE, READ_FILE: the rights a rule on a file may hold
_LL_FS_READ = 1 | 4 | 8  # EXECUTE, READ_FILE, READ_DIR


def landlock_abi():
    """The running kernel's Landlock ABI version (0: unavailable)."""
    ctypes, libc = load_libc()
    r = libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # ..._VERSION
    return max(int(r), 0)


def landlock(job):
    """Restrict this process to: read/execute ``ro_paths``; read/write its working directory and a
    few device files; no TCP bind/connect (ABI >= 4); no signals to, and no abstract unix sockets of,
    processes outside the sandbox (ABI >= 6)."""
    ctypes, libc = load_libc()
    abi = landlock_abi()
    if abi < 1:
        raise OSError("sandbox: Landlock unavailable")
    fs = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    file_rights = _LL_FS_FILE
    if abi >= 2:
        fs |= 1 << 13  # REFER
    if abi >= 3:
        fs |= 1 << 14  # TRUNCATE
        file_rights |= 1 << 14
    if abi >= 5:
        fs |= 1 << 15  # IOCTL_DEV
    net = 3 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP
    scoped = 3 if abi >= 6 else 0  # ABSTRACT_UNIX_SOCKET | SIGNAL
    attr = (ctypes.c_uint64 * 3)(fs, net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    fd = libc.syscall(_LL_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        _check(ctypes, -1, "landlock_create_ruleset")

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    def allow(path, rights):
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if not os.path.isdir(path):
                rights &= file_rights
            rule = PathBeneath(rights & fs, pfd)
            r = libc.syscall(_LL_ADD_RULE, fd, 1, ctypes.byref(rule), 0)  # LANDLOCK_RULE_PATH_BENEATH
            _check(ctypes, 0 if r == 0 else -1, f"landlock_add_rule {path}")
        finally:
            os.close(pfd)

    try:
        for p in job["ro_paths"]:
            allow(p, _LL_FS_READ)
        allow("/dev/null", 2 | 4 | (1 << 14 if abi >= 3 else 0))
        for p in ("/dev/zero", "/dev/random", "/dev/urandom"):
            allow(p, 4)
        allow(job["cwd"], fs)
        _check(ctypes, libc.syscall(_LL_RESTRICT, fd, 0), "landlock_restrict_self")
    finally:
        os.close(fd)
    return abi


# seccomp: these system calls fail with EPERM in the sandbox (signals and tracing reach nothing
# outside it; the process group cannot be left, so killing it kills every descendant).
_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH_*, x32 bit or 0, {name: number})
    "x86_64": (0xC000003E, 0x40000000, {
        "kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438, "setsid": 112, "setpgid": 109}),
    "aarch64": (0xC00000B7, 0, {
        "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438, "setsid": 157, "setpgid": 154}),
}


def seccomp_supported():
    return os.uname().machine in _SECCOMP_ARCH


def seccomp():
    """Install the filter (needs no_new_privs, set by :func:`prctl_hardening`)."""
    ctypes, libc = load_libc()
    arch, x32, calls = _SECCOMP_ARCH[os.uname().machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000  # ALLOW, ERRNO(EPERM), KILL_PROCESS
    nrs = sorted(set(calls.values()))
    n = len(nrs)
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if x32:
        prog.append((jge, n + 1, 0, x32))  # x32 system calls: denied
    for i, nr in enumerate(nrs):
        prog.append((jeq, n - i, 0, nr))  # to the deny below
    prog += [(ret, 0, 0, allow), (ret, 0, 0, deny)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]

    arr = (Filter * len(prog))(*[Filter(*f) for f in prog])
    fprog = Prog(len(prog), arr)
    _check(ctypes, libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "seccomp")  # PR_SET_SECCOMP, FILTER


# ---------------------------------------------------------------------------------------------
# Reliability guard (defence in depth only; the isolation above is the boundary).
# ---------------------------------------------------------------------------------------------
def _blocked(name):
    def f(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the sandbox")

    return f


def reliability_guard():
    """Disable destructive / escaping functions (after OpenAI human-eval's reliability_guard)."""
    # deferred import: the modules it patches (loaded only where the guard runs)
    import builtins
    import faulthandler
    import shutil
    import socket
    import subprocess

    import _socket
    import posix

    faulthandler.disable()
    for mod in (os, posix):
        for name in (
            "kill", "killpg", "system", "putenv", "unsetenv", "remove", "removedirs", "rmdir",
            "fchdir", "chdir", "setuid", "setgid", "setsid", "setpgid", "setpgrp", "fork", "forkpty",
            "vfork", "rename", "renames", "truncate", "ftruncate", "replace", "unlink", "fchmod",
            "fchown", "chmod", "chown", "chroot", "lchown", "lchmod", "link", "symlink", "popen",
            "posix_spawn", "posix_spawnp", "execv", "execve", "execl", "execle", "execlp",
            "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp",
            "spawnlpe", "spawnvp", "spawnvpe",
        ):
            if hasattr(mod, name):
                setattr(mod, name, _blocked(f"os.{name}"))
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, _blocked(f"shutil.{name}"))
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(subprocess, name, _blocked(f"subprocess.{name}"))
    try:
        import _posixsubprocess  # deferred import: patched here; absent on some builds

        _posixsubprocess.fork_exec = _blocked("_posixsubprocess.fork_exec")
    except ImportError:
        pass
    for name in ("socket", "socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo"):
        if hasattr(socket, name):
            setattr(socket, name, _blocked(f"socket.{name}"))
    for name in ("socket", "socketpair"):
        if hasattr(_socket, name):
            setattr(_socket, name, _blocked(f"_socket.{name}"))
    builtins.help = None
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter", "multiprocessing", "pty"):
        sys.modules[name] = None
