"""Child side of the code sandbox. NOT imported by the package: executed as
``python -I -S _sandbox_runner.py <job.json>``, usually as PID 1 of fresh mount/PID/network/IPC
namespaces (``unshare ... --fork``), by :mod:`das_jax.rl.rewards.sandbox`.

Order: read the job (program, limits, file descriptors) while still privileged; build a private
filesystem view (read-only system directories and the Python prefix, private tmpfs ``/tmp`` and
``/dev/shm``, a ``/proc`` of the new PID namespace, nothing else) and switch root into it; set
resource limits; drop privileges to an otherwise unused uid; then run one of three modes:

* ``exec``: run an untrusted program; on completion write ``done`` to the status fd. The program
  can forge this (it shares the process), so it is a convenience, never a reward verdict.
* ``serve``: run untrusted solution code, then answer call requests ``{"id", "fn", "args",
  "kwargs"}`` (one JSON line each on the request fd) with ``{"id", "ok": value}`` or ``{"id",
  "err": exception name}`` on the response fd. Values cross as plain data only (see ``encode``).
* ``check``: run TRUSTED test code (dataset prompt + tests) in which the solution's functions are
  proxies that send requests to a ``serve`` process and decode its plain-data replies; if the
  tests finish without an exception, write the verdict ``pass`` to the status fd. The verdict is
  therefore computed by a process that runs no untrusted code and receives only plain data.
"""

import json
import os
import sys

# ---------------------------------------------------------------------------------------------
# Plain-data wire format (shared by both sides). JSON with tagged objects for the types JSON lacks.
#   None, bool, int, str: themselves; float: itself if finite, else {"f": "nan" | "inf" | "-inf"};
#   list: a JSON array; tuple {"t": [...]}; dict {"d": [[k, v], ...]}; set {"s": [...]};
#   frozenset {"fs": [...]}; complex {"c": [re, im]}; bytes {"b": "<hex>"}.
# Subclasses of these types are sent as their base type (their methods never reach the other
# side); anything else cannot be encoded and fails the call.
# ---------------------------------------------------------------------------------------------
MAX_DEPTH = 64


class WireError(Exception):
    """A value that is not plain data, or a malformed message."""


def encode(x, depth=0):
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    if x is None or x is True or x is False:
        return x
    d = depth + 1
    if isinstance(x, bool):  # pragma: no cover - bool cannot be subclassed
        return bool(x)
    if isinstance(x, int):
        return int.__index__(x)
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
        raise WireError("value nested too deeply")
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


def _build_root(job):
    """Private filesystem view; switch root into it. Nothing of the host but ``ro_paths`` stays."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = job["root_dir"]
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


def _limits(lim):
    import resource

    for name, value in (("RLIMIT_AS", lim["as"]), ("RLIMIT_DATA", lim["as"]), ("RLIMIT_FSIZE", lim["fsize"]),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", lim["nofile"]), ("RLIMIT_CPU", lim["cpu"]),
                        ("RLIMIT_NPROC", lim["nproc"]), ("RLIMIT_MEMLOCK", 0), ("RLIMIT_MSGQUEUE", 0)):
        res = getattr(resource, name, None)
        if res is not None and value is not None:
            resource.setrlimit(res, (value, value))


def _drop_privileges(job):
    """Switch to the job's unused uid (started as real root), or, inside a user namespace, into a
    nested one where we are an unprivileged uid. Either way no capabilities remain."""
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
    else:
        return
    if 0 in os.getresuid():  # pragma: no cover - paranoia
        raise SystemExit("sandbox: privilege drop failed")


def _prctl_hardening():
    import signal

    ctypes, libc = _libc()
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG (a uid change clears it)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0: no ptrace / /proc/<pid>/mem by same uid


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
    if guard:
        _reliability_guard()
    g = {"__name__": "__main__"}
    try:
        exec(compile(src, "<solution>", "exec"), g)
    except BaseException:  # noqa: BLE001
        _print_exc()
        os._exit(1)
    while True:
        line = req.readline(job["max_msg_bytes"])
        if not line:
            os._exit(0)
        msg = loads(line)
        rid, name = msg["id"], msg["fn"]
        try:
            fn = g[name] if name in allowed else None
            if fn is None or not callable(fn):
                raise NameError(f"{name!r} is not defined by the solution")
            out = {"id": rid, "ok": encode(fn(*decode(msg["args"]), **decode(msg["kwargs"])))}
        except BaseException as e:  # noqa: BLE001 - reported to the checker as a failed call
            out = {"id": rid, "err": type(e).__name__}
        try:
            data = (dumps(out) + "\n").encode()
        except BaseException as e:  # noqa: BLE001
            data = (dumps({"id": rid, "err": type(e).__name__}) + "\n").encode()
        _write_all(resp, data)


class CandidateCallError(Exception):
    """The solution's function raised, or its reply could not be decoded."""


def _raise_for(name):
    import builtins

    exc = getattr(builtins, name, None) if isinstance(name, str) else None
    if isinstance(exc, type) and issubclass(exc, Exception):
        raise exc("(raised by the solution in the sandbox)")
    raise CandidateCallError(f"the solution raised {name!r}")


def _run_check(job, src, fds):
    import itertools

    req = fds["req"]
    resp = os.fdopen(fds["resp"], "rb", buffering=1 << 16)
    counter = itertools.count()
    max_msg = job["max_msg_bytes"]

    def make_proxy(name):
        def proxy(*args, **kwargs):
            rid = next(counter)
            _write_all(req, (dumps({"id": rid, "fn": name, "args": encode(list(args)),
                                    "kwargs": encode(dict(kwargs))}) + "\n").encode())
            line = resp.readline(max_msg)
            if not line.endswith(b"\n"):
                raise CandidateCallError("no (complete) reply from the solution process")
            try:
                reply = loads(line)
            except ValueError as e:
                raise CandidateCallError(f"undecodable reply: {e}") from None
            if type(reply) is not dict or reply.get("id") != rid or type(reply.get("id")) is not int:
                raise CandidateCallError("reply out of sequence")
            if "ok" in reply:
                return decode(reply["ok"])
            _raise_for(reply.get("err"))

        proxy.__name__ = proxy.__qualname__ = name
        return proxy

    g = {"__name__": "__main__"}
    try:
        if job.get("prompt"):
            exec(compile(job["prompt"], "<prompt>", "exec"), g)
        for name in job["proxies"]:
            g[name] = make_proxy(name)
        exec(compile(src, "<tests>", "exec"), g)
    except BaseException:  # noqa: BLE001
        _print_exc()
        os._exit(1)
    _write_all(fds["status"], (dumps({"verdict": "pass", "calls": next(counter)}) + "\n").encode())
    os._exit(0)


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        job = json.load(f)
    src = job["program"]
    if job.get("isolate"):
        _build_root(job)
    _limits(job["limits"])
    _drop_privileges(job)
    _prctl_hardening()
    os.chdir(job["cwd"])
    mode, fds, guard = job["mode"], job["fds"], job.get("guard", True)
    del job["program"]
    if mode == "exec":
        _run_exec(job, src, fds, guard)
    elif mode == "serve":
        _run_serve(job, src, fds, guard)
    elif mode == "check":
        _run_check(job, src, fds)
    raise SystemExit(f"sandbox: unknown mode {mode!r}")


if __name__ == "__main__":
    main()
