"""Child side of the code sandbox. NOT imported by the package: executed as
``python -I -S _sandbox_runner.py [tag]`` by :mod:`das_jax.rl.rewards.sandbox`, which writes the
job (JSON: program, limits, file descriptors) to its stdin. The job never touches the disk.

Order: read the job while still privileged; in the isolated modes build a private filesystem view
(read-only system directories and the Python prefix, private tmpfs ``/tmp`` and ``/dev/shm``, a
``/proc`` of the new PID namespace, nothing else) and switch root into it; in the unisolated mode
make a private 0700 working directory. Then fork: this process stays as the *supervisor* (the
untrusted code's parent, never the trainer), and the child starts a new session, sets resource
limits, drops privileges (an otherwise unused uid that the user namespace maps; or, without one,
no capabilities), restricts itself with Landlock (unisolated mode: read-only system paths and its
own directory, no TCP, no signals outside its domain) and a seccomp filter (no kill / ptrace /
process_vm_* / pidfd / setsid / setpgid system calls in every mode), and runs one of three modes:

* ``exec``: run an untrusted program; on completion write ``done`` to the status fd. The program
  can forge this (it shares the process), so it is a convenience, never a reward verdict.
* ``serve``: run untrusted solution code, then answer call requests ``{"id", "fn", "args",
  "kwargs"}`` (one JSON line each on the request fd) with ``{"id", "ok": value}`` or ``{"id",
  "err": exception name}`` on the response fd. Values cross as plain data only (see ``encode``).
* ``check``: run TRUSTED test code (dataset prompt + tests) in which the solution's functions are
  proxies that send requests to a ``serve`` process and decode its plain-data replies; write the
  verdict (``pass`` / ``fail``, and whether a message was over the size limit) to the status fd.
  The verdict is computed by a process that runs no untrusted code and receives only plain data.

The supervisor's exit status is the child's, or ``CPU_LIMIT_EXIT`` when the child used up its CPU
time (``RLIMIT_CPU``, counted from the moment the program starts, not the interpreter), or
``SETUP_FAILED_EXIT`` when the sandbox could not be set up. When the supervisor gets SIGTERM (from
the launcher, or as its parent-death signal) it kills the child's process group (and, under a
fresh uid, every process of that uid), removes the working directory and exits.
"""

import json
import os
import sys

# ---------------------------------------------------------------------------------------------
# Plain-data wire format (shared by both sides). JSON with tagged objects for the types JSON lacks.
#   None, bool, str: themselves; int: itself, or {"i": "<hex>"} beyond BIG_INT_BITS (the decimal
#   form is capped at 4300 digits by Python's int/str limit, hex is not, and it parses in linear
#   time); float: itself if finite, else {"f": "nan" | "inf" | "-inf"};
#   list: a JSON array; tuple {"t": [...]}; dict {"d": [[k, v], ...]}; set {"s": [...]};
#   frozenset {"fs": [...]}; complex {"c": [re, im]}; bytes {"b": "<hex>"}.
# Subclasses of these types are sent as their base type (their methods never reach the other
# side); anything else cannot be encoded and fails the call.
# ---------------------------------------------------------------------------------------------
MAX_DEPTH = 64
BIG_INT_BITS = 4096  # ~1233 decimal digits: larger ints cross as hex


class WireError(Exception):
    """A value that is not plain data, or a malformed message."""


class WireTooDeep(WireError):
    """A value nested deeper than ``MAX_DEPTH``: reported as a message over the limits."""


def encode(x, depth=0):
    if depth > MAX_DEPTH:
        raise WireTooDeep(f"value nested deeper than {MAX_DEPTH} levels")
    if x is None or x is True or x is False:
        return x
    d = depth + 1
    if isinstance(x, bool):  # pragma: no cover - bool cannot be subclassed
        return bool(x)
    if isinstance(x, int):
        v = int.__index__(x)
        return {"i": hex(v)} if v.bit_length() > BIG_INT_BITS else v
    if isinstance(x, float):
        v = float.__float__(x)
        if v != v:
            return {"f": "nan"}
        if v in (float("inf"), float("-inf")):
            return {"f": "inf" if v > 0 else "-inf"}
        return v
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, list):
        return [encode(v, d) for v in list.__iter__(x)]
    if isinstance(x, tuple):
        return {"t": [encode(v, d) for v in tuple.__iter__(x)]}
    if isinstance(x, dict):
        return {"d": [[encode(k, d), encode(v, d)] for k, v in dict.items(x)]}
    if isinstance(x, frozenset):
        return {"fs": [encode(v, d) for v in frozenset.__iter__(x)]}
    if isinstance(x, set):
        return {"s": [encode(v, d) for v in set.__iter__(x)]}
    if isinstance(x, complex):
        return {"c": [encode(complex.__complex__(x).real, d), encode(complex.__complex__(x).imag, d)]}
    if isinstance(x, (bytes, bytearray)):
        return {"b": bytes(x).hex()}
    raise WireError(f"{type(x).__name__} is not plain data")


_FLOATS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def decode(x, depth=0):
    """Rebuild a value from :func:`encode`'s output using builtin types only."""
    if depth > MAX_DEPTH:
        raise WireTooDeep(f"value nested deeper than {MAX_DEPTH} levels")
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    d = depth + 1
    if t is list:
        return [decode(v, d) for v in x]
    if t is not dict or len(x) != 1:
        raise WireError("malformed value")
    (tag, v), = x.items()
    if tag == "f" and v in _FLOATS:
        return _FLOATS[v]
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "i" and type(v) is str:
        try:
            return int(v, 16)
        except ValueError:
            raise WireError("malformed int") from None
    if type(v) is not list:
        raise WireError("malformed value")
    if tag == "t":
        return tuple(decode(e, d) for e in v)
    if tag == "s":
        return {decode(e, d) for e in v}
    if tag == "fs":
        return frozenset(decode(e, d) for e in v)
    if tag == "c" and len(v) == 2 and all(type(e) in (int, float) for e in v):
        return complex(v[0], v[1])
    if tag == "d":
        out = {}
        for kv in v:
            if type(kv) is not list or len(kv) != 2:
                raise WireError("malformed dict item")
            out[decode(kv[0], d)] = decode(kv[1], d)
        return out
    raise WireError("malformed value")


def _reject_constant(name):
    raise WireError(f"bare {name} in message")


def loads(line):
    return json.loads(line, parse_constant=_reject_constant)


def dumps(obj):
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------
# Isolation (runs as root of the new mount namespace, before any untrusted code).
# ---------------------------------------------------------------------------------------------
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
MNT_DETACH = 2
# statvfs f_flag bits that a read-only remount must keep (they equal the MS_* values)
_KEEP_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | (1 << 21)  # + NOATIME, NODIRATIME, RELATIME
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return ctypes, libc


def _check(ctypes, r, what):
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src, target, fstype, flags, data=None):
    ctypes, libc = _libc()
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


def _build_root(job):
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
    ctypes, libc = _libc()
    nr = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is not None and libc.syscall(nr, b".", b".") == 0:
        # the old root now sits on top of the new one: detach it
        _check(ctypes, libc.umount2(b".", MNT_DETACH), "umount old root")
    else:
        _mount(root, "/", None, MS_MOVE)
        os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _private_dir(job):
    """Unisolated mode: a fresh 0700 working directory owned by the sandbox's uid, holding nothing."""
    import tempfile

    d = tempfile.mkdtemp(prefix=job["dir_prefix"], dir=job["tmp_root"])
    if job.get("uid") is not None:
        os.chown(d, job["uid"], job["uid"])
    return d


def _limits(lim):
    import resource

    for name, value in (("RLIMIT_AS", lim["as"]), ("RLIMIT_DATA", lim["as"]), ("RLIMIT_FSIZE", lim["fsize"]),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", lim["nofile"]), ("RLIMIT_NPROC", lim["nproc"]),
                        ("RLIMIT_MEMLOCK", 0), ("RLIMIT_MSGQUEUE", 0)):
        res = getattr(resource, name, None)
        if res is not None and value is not None:
            resource.setrlimit(res, (value, value))


def _start_cpu_clock(seconds):
    """``RLIMIT_CPU`` = the CPU time used so far (interpreter start-up, sandbox set-up) + ``seconds``:
    SIGXCPU then, SIGKILL a second later. Returns the soft limit (s)."""
    import math
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(math.ceil(ru.ru_utime + ru.ru_stime + float(seconds)))
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    return soft


def _drop_privileges(job):
    """Switch to the job's unused uid (started as root), or, inside a user namespace, into a nested
    one where we are an unprivileged uid; as root without a spare uid, drop every capability.
    Either way no capabilities remain."""
    uid = job.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif job.get("nested_userns"):
        ctypes, libc = _libc()
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
    ctypes, libc = _libc()
    for cap in range(64):  # bounding set: no capability can come back through exec
        if libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # PR_CAPBSET_DROP; EINVAL: past the last
            break
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2): all empty
    _check(ctypes, libc.capset(hdr, data), "capset")


def _prctl_hardening():
    import signal

    ctypes, libc = _libc()
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
    ctypes, libc = _libc()
    r = libc.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # ..._VERSION
    return max(int(r), 0)


def _landlock(job):
    """Restrict this process to: read/execute ``ro_paths``; read/write its working directory and a
    few device files; no TCP bind/connect (ABI >= 4); no signals to, and no abstract unix sockets of,
    processes outside the sandbox (ABI >= 6)."""
    ctypes, libc = _libc()
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


def _seccomp():
    """Install the filter (needs no_new_privs, set by :func:`_prctl_hardening`)."""
    ctypes, libc = _libc()
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


def _reliability_guard():
    """Disable destructive / escaping functions (after OpenAI human-eval's reliability_guard)."""
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
        import _posixsubprocess

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


# ---------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------
def _write_all(fd, data):
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _print_exc():
    import traceback

    try:
        traceback.print_exc()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass


def _run_exec(job, src, fds, guard):
    status = fds["status"]
    _write, _exit = os.write, os._exit
    if guard:
        _reliability_guard()
    try:
        exec(compile(src, "<program>", "exec"), {"__name__": "__main__"})
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - includes SystemExit: an early exit is a failure
        _print_exc()
        _exit(1)
    _write(status, b"done\n")
    _exit(0)


def _run_serve(job, src, fds, guard):
    req = os.fdopen(fds["req"], "rb", buffering=1 << 16)
    resp = fds["resp"]
    allowed = set(job["allowed"])
    max_msg = job["max_msg_bytes"]
    if guard:
        _reliability_guard()
    g = {"__name__": "__main__"}
    try:
        exec(compile(src, "<solution>", "exec"), g)
    except BaseException:  # noqa: BLE001
        _print_exc()
        os._exit(1)
    while True:
        line = req.readline(max_msg + 2)
        if not line:
            os._exit(0)
        rid = None
        try:
            msg = loads(line)
            rid, name = msg["id"], msg["fn"]
            fn = g[name] if name in allowed else None
            if fn is None or not callable(fn):
                raise NameError(f"{name!r} is not defined by the solution")
            res = fn(*decode(msg["args"]), **decode(msg["kwargs"]))
        except BaseException as e:  # noqa: BLE001 - reported to the checker as a failed call
            out = {"id": rid, "err": _plain_name(e)}
        else:
            try:
                out = {"id": rid, "ok": encode(res)}
            except WireTooDeep:          # over the wire's limits, like an oversize reply
                out = {"id": rid, "err": TOO_LARGE}
            except BaseException as e:  # noqa: BLE001
                out = {"id": rid, "err": _plain_name(e)}
        try:
            data = (dumps(out) + "\n").encode()
        except BaseException as e:  # noqa: BLE001
            data = (dumps({"id": rid, "err": _plain_name(e)}) + "\n").encode()
        if len(data) > max_msg:
            data = (dumps({"id": rid, "err": TOO_LARGE}) + "\n").encode()
        _write_all(resp, data)


TOO_LARGE = "<message too large>"


def _plain_name(e):
    """The name of the first builtin class in the exception's ancestry (what the checker maps)."""
    import builtins

    for cls in type(e).__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return "Exception"


class CandidateCallError(Exception):
    """A call to the solution failed: it raised, its process ended, or its reply could not be
    decoded. The tests see every failure of the solution as this type (or, for the plain builtin
    exceptions of ``_PLAIN_ERRORS``, as a subclass of this type and of that exception, so that
    ``except ValueError`` in a test still works); never as the exception the solution chose."""


class MessageTooLarge(CandidateCallError):
    """A call's arguments or its reply exceed the message size limit."""


# Exceptions a solution may make the tests see (as ``Candidate<Name>``); anything else, control-flow
# exceptions included (StopIteration, GeneratorExit, SystemExit, KeyboardInterrupt, ...), crosses as
# a bare CandidateCallError.
_PLAIN_ERRORS = ("ValueError", "TypeError", "KeyError", "IndexError", "LookupError", "ZeroDivisionError",
                 "ArithmeticError", "OverflowError", "AttributeError", "NameError", "NotImplementedError",
                 "RuntimeError", "RecursionError", "AssertionError", "MemoryError", "UnicodeError")
_CANDIDATE_ERRORS = {}


def _candidate_error(name):
    import builtins

    if name not in _PLAIN_ERRORS:
        return CandidateCallError
    cls = _CANDIDATE_ERRORS.get(name)
    if cls is None:
        base = getattr(builtins, name)
        cls = type("Candidate" + name, (CandidateCallError, base), {"__module__": __name__})
        _CANDIDATE_ERRORS[name] = cls
    return cls


def _raise_for(name):
    if name == TOO_LARGE:
        raise MessageTooLarge("the solution's reply is over the message size or nesting limit")
    raise _candidate_error(name if isinstance(name, str) else "")(f"the solution raised {name!r}")


def _run_check(job, src, fds):
    import itertools

    req = fds["req"]
    resp = os.fdopen(fds["resp"], "rb", buffering=1 << 16)
    counter = itertools.count()
    max_msg = job["max_msg_bytes"]
    state = {"oversize": False}

    def make_proxy(name):
        def proxy(*args, **kwargs):
            rid = next(counter)
            try:
                data = (dumps({"id": rid, "fn": name, "args": encode(list(args)),
                               "kwargs": encode(dict(kwargs))}) + "\n").encode()
            except WireTooDeep as e:
                state["oversize"] = True
                raise MessageTooLarge(f"arguments of {name}() are {e}") from None
            except (WireError, ValueError, RecursionError) as e:
                raise CandidateCallError(f"arguments are not plain data: {e}") from None
            if len(data) > max_msg:
                state["oversize"] = True
                raise MessageTooLarge(f"arguments of {name}() are {len(data)} bytes, over the limit of {max_msg}")
            try:
                _write_all(req, data)
            except OSError:
                raise CandidateCallError("the solution process has ended") from None
            line = resp.readline(max_msg + 2)
            if len(line) > max_msg:
                state["oversize"] = True
                raise MessageTooLarge(f"the reply of {name}() is over the limit of {max_msg} bytes")
            if not line.endswith(b"\n"):
                raise CandidateCallError("no (complete) reply from the solution process")
            try:
                reply = loads(line)
                if type(reply) is not dict or reply.get("id") != rid or type(reply.get("id")) is not int:
                    raise CandidateCallError("reply out of sequence")
                if "ok" in reply:
                    return decode(reply["ok"])
            except (WireError, ValueError, RecursionError, MemoryError, TypeError) as e:
                raise CandidateCallError(f"undecodable reply: {type(e).__name__}") from None
            if reply.get("err") == TOO_LARGE:
                state["oversize"] = True
            _raise_for(reply.get("err"))

        proxy.__name__ = proxy.__qualname__ = name
        return proxy

    g = {"__name__": "__main__"}
    verdict = "pass"
    try:
        if job.get("prompt"):
            exec(compile(job["prompt"], "<prompt>", "exec"), g)
        for name in job["proxies"]:
            g[name] = make_proxy(name)
        exec(compile(src, "<tests>", "exec"), g)
    except BaseException:  # noqa: BLE001
        _print_exc()
        verdict = "fail"
    _write_all(fds["status"], (dumps({"verdict": verdict, "calls": next(counter),
                                      "oversize": state["oversize"]}) + "\n").encode())
    os._exit(0 if verdict == "pass" else 1)


CPU_LIMIT_EXIT = 124
SETUP_FAILED_EXIT = 125


def _read_job():
    chunks = []
    while True:
        b = os.read(0, 1 << 20)
        if not b:
            break
        chunks.append(b)
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    return json.loads(b"".join(chunks).decode("utf-8"))


def _child(job, src):
    """The sandboxed process (after the fork): confine, then run the job's mode."""
    try:
        os.setsid()
        _limits(job["limits"])
        _drop_privileges(job)
        _prctl_hardening()
        if job.get("landlock"):
            _landlock(job)
        if job.get("seccomp"):
            _seccomp()
        os.chdir(job["cwd"])
        os.environ["HOME"] = os.environ["TMPDIR"] = job["cwd"]
    except BaseException:  # noqa: BLE001
        _print_exc()
        os._exit(SETUP_FAILED_EXIT)
    mode, fds, guard = job["mode"], job["fds"], job.get("guard", True)
    _start_cpu_clock(job["limits"]["cpu"])
    if mode == "exec":
        _run_exec(job, src, fds, guard)
    elif mode == "serve":
        _run_serve(job, src, fds, guard)
    elif mode == "check":
        _run_check(job, src, fds)
    os._exit(SETUP_FAILED_EXIT)


def _supervise(job, pid, cwd):
    """Wait for the child; on SIGTERM kill it (and its uid's leftovers) first. Remove ``cwd``."""
    import signal

    def cleanup():
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if job.get("uid") is not None and not job.get("isolate"):
            _kill_uid(job["uid"])
        if cwd:
            import shutil

            shutil.rmtree(cwd, ignore_errors=True)

    def on_term(signum, frame):
        cleanup()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    for fd in job["fds"].values():  # only the child holds the pipes: EOF reaches the peer when it ends
        try:
            os.close(fd)
        except OSError:
            pass
    while True:
        try:
            _, status, ru = os.wait4(pid, 0)
            break
        except InterruptedError:  # pragma: no cover
            continue
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cleanup()
    cpu = ru.ru_utime + ru.ru_stime
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL) \
            and cpu >= job["limits"]["cpu"]:
        os._exit(CPU_LIMIT_EXIT)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _kill_uid(uid):
    """SIGKILL every process of ``uid`` (unisolated mode: descendants that left the process group).
    ``kill(-1)`` from a helper running as that uid reaches exactly those processes."""
    pid = os.fork()
    if pid == 0:
        try:
            import signal

            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def main():
    import signal

    job = _read_job()
    src = job.pop("program")
    ctypes, libc = _libc()
    libc.prctl(4, 0, 0, 0, 0)  # not dumpable: the job (tests, in check mode) cannot be read from outside
    cwd = None
    try:
        if job.get("isolate"):
            _build_root(job)
            job["cwd"] = "/tmp"
        else:
            # unisolated: the launcher does not hold a parent-death signal for us; our parent's death
            # gives SIGTERM, so that the working directory is removed
            signal.signal(signal.SIGTERM, lambda s, f: os._exit(128 + s))
            libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != job.get("parent_pid"):
                os._exit(SETUP_FAILED_EXIT)
            cwd = job["cwd"] = _private_dir(job)
    except BaseException:  # noqa: BLE001
        _print_exc()
        os._exit(SETUP_FAILED_EXIT)
    pid = os.fork()
    if pid == 0:
        _child(job, src)
    del src
    _supervise(job, pid, cwd)


if __name__ == "__main__":
    main()
