"""One run per run directory: an exclusive lock held for the run's life, and no silent overwrite.

    with lock_run_dir("runs/x"):          # RunDirError if another live process holds it
        check_new_run("runs/x")            # RunDirError if a previous run left its files there
        ...

The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on `<run_dir>/.lock`. The kernel drops a flock when
its process dies (killed, crashed, OOM), so a lock file left by a dead run never blocks a new
one: there is no stale state to clean up. The lock is re-entrant within one process (the CLI
takes it before loading the model; `GRPOTrainer.train` takes it again). The file records the
holder's pid and host, for the error message only.

`flock` is advisory and local: two hosts sharing a run directory over NFS are not excluded on
every NFS setup. A run directory is meant for one machine at a time.

This module imports no jax.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
from pathlib import Path
from typing import Iterator

from das_jax.errors import UserError

LOCK_FILE = ".lock"
# What `das-jax train` writes into a run directory (the only names `--overwrite` removes).
RUN_FILES = ("config.yaml", "metrics.jsonl")
RUN_DIRS = ("checkpoints", "checkpoints.unreadable", "tb", "plots")

_held: dict[str, list] = {}   # realpath -> [fd, count]


class RunDirError(UserError):
    """The run directory cannot be used: another run holds it, a previous run left its files
    there, or it is not a writable directory (the message names the directory and the fix)."""


def check_run_dir_path(run_dir: str | os.PathLike) -> Path:
    """Checks that `run_dir` is (or can be created as) a directory; creates it.

    Raises:
      RunDirError: it is an existing file, or a parent is a file, or it cannot be created.
    """
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"output_dir {str(path)!r} is an existing file, not a directory; "
                          "choose another output_dir (--set output_dir=DIR)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise RunDirError(f"cannot create output_dir {str(path)!r}: {e.strerror}; choose another "
                          "output_dir (--set output_dir=DIR)") from None
    return path


@contextlib.contextmanager
def lock_run_dir(run_dir: str | os.PathLike) -> Iterator[Path]:
    """Holds an exclusive lock on `run_dir` (created if needed) for the duration of the block.

    Raises:
      RunDirError: another live process holds the lock (the message gives its pid), or the
        directory is not usable (see `check_run_dir_path`).
    """
    path = check_run_dir_path(run_dir)
    key = os.path.realpath(path)
    if key in _held:
        _held[key][1] += 1
        try:
            yield path
        finally:
            _held[key][1] -= 1
        return
    lock_path = path / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirError(f"cannot create the lock file {str(lock_path)!r}: {e.strerror}; "
                          "choose a writable output_dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirError(f"output_dir {str(path)!r} is in use by another run ({holder}); wait "
                          "for it to finish or choose another output_dir (--set output_dir=DIR)"
                          ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    except OSError:
        pass  # the lock is what matters; the note is for messages only
    _held[key] = [fd, 1]
    try:
        yield path
    finally:
        _held[key][1] -= 1
        if _held[key][1] == 0:
            del _held[key]
            os.close(fd)   # releases the flock


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 200).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "pid unknown"


def run_files(run_dir: str | os.PathLike) -> list[str]:
    """The names of a previous run's files present in `run_dir` (sorted)."""
    path = Path(run_dir)
    return sorted(n for n in RUN_FILES + RUN_DIRS if (path / n).exists())


def check_new_run(run_dir: str | os.PathLike, *, has_checkpoint: bool) -> None:
    """Refuses to start a new run where a previous one left its files.

    Args:
      run_dir: the output directory.
      has_checkpoint: whether the directory holds a committed checkpoint (then `--resume` is the
        way to continue it).

    Raises:
      RunDirError: naming the files found and the ways out (--resume, another output_dir, or
        --overwrite).
    """
    found = run_files(run_dir)
    if not found:
        return
    if has_checkpoint:
        how = f"pass --resume {run_dir} to continue it, choose"
    else:
        how = "it has no checkpoint, so it cannot be resumed; choose"
    raise RunDirError(f"output_dir {str(run_dir)!r} already holds a run ({', '.join(found)}); "
                      f"{how} another output_dir (--set output_dir=DIR), or pass --overwrite to "
                      "replace it")


def clear_run(run_dir: str | os.PathLike) -> list[str]:
    """Removes a previous run's files (only the names in RUN_FILES / RUN_DIRS); returns them."""
    path = Path(run_dir)
    removed = run_files(path)
    for name in removed:
        p = path / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    return removed


def checkpoint_steps(run_dir: str | os.PathLike, subdir: str = "checkpoints") -> list[int]:
    """Steps of the committed checkpoint directories under `<run_dir>/checkpoints` (ascending),
    from the directory names alone (orbax publishes a step by renaming its temporary directory
    to the bare step number). No jax / orbax import; readability is checked on restore."""
    path = Path(run_dir) / subdir
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and p.is_dir())


def complete_message(run_dir: str | os.PathLike, step: int, steps: int) -> str:
    """The one line that says a run is complete and how to extend it."""
    return (f"run {str(run_dir)!r} is complete: its latest checkpoint is step {step} and "
            f"train.steps is {steps}; to train further, pass --resume {run_dir} --set "
            f"train.steps=N with N > {step}")


def set_aside_checkpoints(run_dir: str | os.PathLike, steps, subdir: str = "checkpoints") -> Path:
    """Moves the step directories `steps` from `<run_dir>/checkpoints` to
    `<run_dir>/checkpoints.unreadable/<step>[.N]` (kept for inspection, out of the way of new
    saves of the same steps); returns that folder."""
    src = Path(run_dir) / subdir
    dst = Path(run_dir) / f"{subdir}.unreadable"
    dst.mkdir(exist_ok=True)
    for step in steps:
        target, n = dst / str(step), 1
        while target.exists():
            target, n = dst / f"{step}.{n}", n + 1
        os.replace(src / str(step), target)
    return dst
