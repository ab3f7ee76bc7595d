"""Child side of the code sandbox. NOT imported by the package: executed as
``python -I -S sandbox_child/runner.py [tag]`` by :mod:`das_jax.rl.rewards.sandbox`, which writes the
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
  "err": exception name}`` on the response fd. Values cross as plain data only (see ``wire.encode``).
* ``check``: run TRUSTED test code (dataset prompt + tests) in which the solution's functions are
  proxies that send requests to a ``serve`` process and decode its plain-data replies; write the
  verdict (``pass`` / ``fail``, and whether a message was over the size limit) to the status fd.
  The verdict is computed by a process that runs no untrusted code and receives only plain data.

The supervisor's exit status is the child's, or ``CPU_LIMIT_EXIT`` when the child used up its CPU
time (``RLIMIT_CPU``, counted from the moment the program starts, not the interpreter), or
``SETUP_FAILED_EXIT`` when the sandbox could not be set up. When the supervisor gets SIGTERM (from
the launcher, or as its parent-death signal) it kills the child's process group (and, under a
fresh uid, every process of that uid), removes the working directory and exits.

Its siblings, imported as top-level modules: ``wire`` (the plain-data wire format) and ``confine``
(the confinement steps above).
"""

import builtins
import itertools
import json
import os
import signal
import sys

# -I leaves this script's own directory off sys.path: put it there for the sibling modules, then
# take it off again (the untrusted code sees the path it would without them). Their bytecode is
# not cached (-I ignores the launcher's PYTHONDONTWRITEBYTECODE): the sandbox writes nothing here.
_nocache = sys.dont_write_bytecode
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from confine import (build_root, drop_privileges, landlock, load_libc, prctl_hardening,  # noqa: E402
                     private_dir, reliability_guard, seccomp, set_limits, start_cpu_clock)
from wire import WireError, WireTooDeep, decode, dumps, encode, loads  # noqa: E402

del sys.path[0]
sys.dont_write_bytecode = _nocache


# ---------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------
def _write_all(fd, data):
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _print_exc():
    import traceback  # deferred import: only where a failure is printed (not every start-up)

    try:
        traceback.print_exc()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass


def _run_exec(job, src, fds, guard):
    status = fds["status"]
    _write, _exit = os.write, os._exit
    if guard:
        reliability_guard()
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
        reliability_guard()
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
        set_limits(job["limits"])
        drop_privileges(job)
        prctl_hardening()
        if job.get("landlock"):
            landlock(job)
        if job.get("seccomp"):
            seccomp()
        os.chdir(job["cwd"])
        os.environ["HOME"] = os.environ["TMPDIR"] = job["cwd"]
    except BaseException:  # noqa: BLE001
        _print_exc()
        os._exit(SETUP_FAILED_EXIT)
    mode, fds, guard = job["mode"], job["fds"], job.get("guard", True)
    start_cpu_clock(job["limits"]["cpu"])
    if mode == "exec":
        _run_exec(job, src, fds, guard)
    elif mode == "serve":
        _run_serve(job, src, fds, guard)
    elif mode == "check":
        _run_check(job, src, fds)
    os._exit(SETUP_FAILED_EXIT)


def _supervise(job, pid, cwd):
    """Wait for the child; on SIGTERM kill it (and its uid's leftovers) first. Remove ``cwd``."""
    def cleanup():
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if job.get("uid") is not None and not job.get("isolate"):
            _kill_uid(job["uid"])
        if cwd:
            import shutil  # deferred import: unisolated mode only (as confine's tempfile)

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
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def main():
    job = _read_job()
    src = job.pop("program")
    ctypes, libc = load_libc()
    libc.prctl(4, 0, 0, 0, 0)  # not dumpable: the job (tests, in check mode) cannot be read from outside
    cwd = None
    try:
        if job.get("isolate"):
            build_root(job)
            job["cwd"] = "/tmp"
        else:
            # unisolated: the launcher does not hold a parent-death signal for us; our parent's death
            # gives SIGTERM, so that the working directory is removed
            signal.signal(signal.SIGTERM, lambda s, f: os._exit(128 + s))
            libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != job.get("parent_pid"):
                os._exit(SETUP_FAILED_EXIT)
            cwd = job["cwd"] = private_dir(job)
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
