"""Child-side launcher of the code sandbox. NOT imported by the package: executed as
``python -I _sandbox_runner.py <program_path> <config_json>`` inside the isolated child.

Order matters: read the secret success token from stdin and the program from disk (possibly
root-only), set resource limits, drop privileges, enter the work dir, install the reliability
guard, run the untrusted program, and only if it finishes without an exception write the token
to a private dup of stdout and ``_exit(0)``. Exiting early (``sys.exit(0)``, ``os._exit(0)``)
therefore never counts as a pass.
"""

import json
import os
import sys


def _limits(cfg):
    import resource

    def setlim(name, value):
        lim = getattr(resource, name, None)
        if lim is None or value is None:
            return
        try:
            resource.setrlimit(lim, (value, value))
        except (ValueError, OSError):
            pass

    mem = cfg.get("memory_bytes")
    setlim("RLIMIT_AS", mem)
    setlim("RLIMIT_DATA", mem)
    setlim("RLIMIT_FSIZE", cfg.get("max_file_bytes"))
    setlim("RLIMIT_CORE", 0)
    setlim("RLIMIT_NOFILE", cfg.get("max_open_files"))
    setlim("RLIMIT_CPU", cfg.get("cpu_seconds"))
    # Per real user; not enforced for root, hence the privilege drop below.
    setlim("RLIMIT_NPROC", cfg.get("max_procs"))


def _drop_privileges(cfg):
    uid, gid = cfg.get("drop_uid"), cfg.get("drop_gid")
    if uid is None or os.getuid() != 0:
        return
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:  # pragma: no cover - paranoia
        raise SystemExit("sandbox: privilege drop failed")


def _blocked(name):
    def f(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the sandbox")

    return f


def _reliability_guard():
    """Disable destructive / escaping functions (after OpenAI human-eval's reliability_guard).
    Not a security boundary by itself; the process isolation is."""
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


def main():
    prog_path, cfg = sys.argv[1], json.loads(sys.argv[2])
    token = sys.stdin.readline().strip()
    with open(prog_path, encoding="utf-8") as f:
        src = f.read()
    _limits(cfg)
    _drop_privileges(cfg)
    os.chdir(cfg["cwd"])
    res_fd = os.dup(1)
    _write, _exit = os.write, os._exit
    if cfg.get("guard", True):
        _reliability_guard()
    del prog_path, cfg
    try:
        code = compile(src, "<program>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except BaseException:  # noqa: BLE001 - includes SystemExit: early exit is a failure
        import traceback

        try:
            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        _exit(1)
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001
        pass
    _write(res_fd, ("\n" + token + "\n").encode())
    _exit(0)


if __name__ == "__main__":
    main()
