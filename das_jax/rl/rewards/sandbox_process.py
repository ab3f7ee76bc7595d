"""Host side of the code sandbox, one running sandbox: :class:`SandboxProcess` launches the child
side (``sandbox_child/runner.py``) with its job and ends it; :func:`run_exec` runs one program in
it (see :mod:`das_jax.rl.rewards.sandbox`)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import tempfile
import time

from das_jax.rl.rewards.sandbox_host import (CPU_LIMIT_EXIT, DIR_PREFIX, RUNNER, SETUP_FAILED_EXIT, SYSTEM_PATHS,
                                             SandboxCapabilities, SandboxLimits, SandboxResult, fresh_uid, is_root,
                                             python_paths, tmp_root)

logger = logging.getLogger(__name__)

_OUTPUT_TAIL = 4000


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
        uid = fresh_uid() if caps.mode != "user-namespaces" and is_root() else None
        self._uid = uid
        job = {
            **job,
            "isolate": caps.isolated,
            "landlock": caps.mode == "unisolated",
            "seccomp": True,
            "ro_paths": [*SYSTEM_PATHS, *python_paths(caps.python)],
            "disk_bytes": int(lim.max_file_mb) << 20,
            "tmp_root": tmp_root(uid is not None),
            "dir_prefix": f"{DIR_PREFIX}{os.getpid()}_",
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
        cmd = [*caps.prefix, caps.python, "-I", "-S", RUNNER, argv_tag]
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


def run_exec(program: str, caps: SandboxCapabilities, limits: SandboxLimits, *, guard: bool,
             argv_tag: str = "") -> SandboxResult:
    """Run ``program`` in one sandbox (the runner's ``exec`` mode); never raises."""
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
