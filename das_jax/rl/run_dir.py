"""One run per run directory: an exclusive lock held for the run's life, and no silent overwrite.

    with lock_run_dir("runs/x"):          # RunDirError if another live process holds it
        check_new_run("runs/x")            # RunDirError if a previous run left its files there
        write_manifest("runs/x")           # marks the directory as a das-jax run
        ...

A directory is a previous run only if it holds das-jax's run manifest (`das-jax-run.json`,
written when a run starts); `clear_run` (--overwrite) removes only the files das-jax writes
there, and a directory without a manifest whose files a run would write over (a user's own
config.yaml) is refused, --overwrite or not.

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
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterator

from das_jax.errors import UserError

LOCK_FILE = ".lock"
# The run manifest `das-jax train` writes when a run starts: a directory is a previous run only
# if it holds one (a user's own config.yaml or plots/ do not make a run).
MANIFEST_FILE = "das-jax-run.json"
# What `das-jax train` writes into a run directory (the only entries `--overwrite` removes).
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl",
             "draft_head.safetensors")   # the head trained online (train.draft_loss_weight)
RUN_DIRS = ("checkpoints", "checkpoints.unreadable", "tb", "plots")
PLOT_FILES = ("reward.png", "loss_kl.png", "response_length.png", "speculation.png",
              "rollout_time.png")   # das_jax.rl.plots.plot_run's files

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
    When the block leaves no run there (no manifest: a run refused by a check before it
    started, `--resume` of a directory that holds no run), the lock file this call created is
    removed, and so is the directory this call created if nothing else is in it.

    Raises:
      RunDirError: another live process holds the lock (the message gives its pid), or the
        directory is not usable (see `check_run_dir_path`).
    """
    created = not os.path.lexists(run_dir)
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
    new_lock = not os.path.lexists(lock_path)
    for attempt in range(3):
        fd = _open_lock(path, lock_path)
        # A process that removed its new, empty directory (below) unlinked the file this one
        # may have opened first: a lock on it locks nothing, so take the lock file again.
        if os.fstat(fd).st_nlink or attempt == 2:
            break
        os.close(fd)
        path = check_run_dir_path(run_dir)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass  # the lock is what matters; the note is for messages only
    _held[key] = [fd, 1]
    try:
        yield path
    finally:
        _held[key][1] -= 1
        if _held[key][1] == 0:
            del _held[key]
            if new_lock and not is_run(path):   # refused before it started: leave no trace
                with contextlib.suppress(OSError):
                    os.unlink(lock_path)
                    if created:
                        path.rmdir()     # when empty
            os.close(fd)   # releases the flock


def _open_lock(path: Path, lock_path: Path) -> int:
    """Opens (creating) the lock file and takes its flock; the fd. Raises RunDirError."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:   # the directory was just removed by a refused run: recreate
        check_run_dir_path(path)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirError(f"cannot create the lock file {str(lock_path)!r}: {e.strerror}; "
                          "choose a writable output_dir") from None
    note = _read_holder(fd, default="")
    if note and not _HOLDER_RE.match(note):   # a file of the user's that is named .lock
        os.close(fd)
        raise RunDirError(f"output_dir {str(path)!r} holds a {LOCK_FILE} that das-jax did not "
                          f"write; das-jax keeps its lock there, so move that file or choose "
                          "another output_dir (--set output_dir=DIR)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirError(f"output_dir {str(path)!r} is in use by another run ({holder}); wait "
                          "for it to finish or choose another output_dir (--set output_dir=DIR)"
                          ) from None
    return fd


# What a lock file holds: the note `lock_run_dir` writes, "pid 123 on host".
_HOLDER_RE = re.compile(r"pid \d+ on \S*$")


def _read_holder(fd: int, default: str = "pid unknown") -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 200).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or default


def is_run(run_dir: str | os.PathLike) -> bool:
    """Whether `run_dir` holds a das-jax run (its manifest, `MANIFEST_FILE`)."""
    return (Path(run_dir) / MANIFEST_FILE).is_file()


def write_manifest(run_dir: str | os.PathLike) -> Path:
    """Marks `run_dir` as a das-jax run (kept if present); returns the manifest's path."""
    path = Path(run_dir) / MANIFEST_FILE
    if not path.is_file():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({
            "format": "das-jax run", "version": 1,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "written_by_das_jax": list(RUN_FILES) + [f"{d}/" for d in RUN_DIRS]}) + "\n")
        os.replace(tmp, path)
    return path


def _own_entries(path: Path) -> list[Path]:
    """The entries of `path` that das-jax writes: RUN_FILES, step directories (and orbax's
    temporary ones) under checkpoints*/, TensorBoard event files under tb/, PLOT_FILES under
    plots/ (anything else there is the user's)."""
    out = [path / n for n in RUN_FILES if (path / n).exists() or (path / n).is_symlink()]
    sub = {
        "checkpoints": lambda n: n.isdigit() or ".orbax-checkpoint-tmp" in n,
        "checkpoints.unreadable": lambda n: re.fullmatch(r"\d+(\.\d+)?", n) is not None,
        "tb": lambda n: n.startswith("events.out.tfevents."),
        "plots": lambda n: n in PLOT_FILES,
    }
    for d, own in sub.items():
        if (path / d).is_dir() and not (path / d).is_symlink():
            out += [e for e in sorted((path / d).iterdir()) if own(e.name)]
    return out


def run_files(run_dir: str | os.PathLike) -> list[str]:
    """The top-level names of a previous das-jax run's files in `run_dir` (sorted; [] when it
    holds no run manifest)."""
    path = Path(run_dir)
    if not is_run(path):
        return []
    return sorted({e.relative_to(path).parts[0] for e in _own_entries(path)})


def _clashes(path: Path) -> list[str]:
    """Entries of a directory that is not a das-jax run which a new run would write over."""
    return [str(e.relative_to(path)) for e in _own_entries(path)
            if e.relative_to(path).parts[0] != "tb"]   # event files get new, unique names


def check_new_run(run_dir: str | os.PathLike, *, has_checkpoint: bool,
                  overwrite: bool = False) -> None:
    """Refuses to start a new run where a previous one left its files, or where the run would
    write over files das-jax did not write.

    Args:
      run_dir: the output directory.
      has_checkpoint: whether the directory holds a committed checkpoint (then `--resume` is the
        way to continue it).
      overwrite: a previous das-jax run's files will be removed (`clear_run`): only files that
        are not from a das-jax run are refused.

    Raises:
      RunDirError: naming the files found and the ways out (--resume, another output_dir, or
        --overwrite; only another output_dir for files das-jax did not write).
    """
    path = Path(run_dir)
    if not is_run(path):
        clash = _clashes(path)
        if clash:
            raise RunDirError(
                f"output_dir {str(run_dir)!r} holds {', '.join(clash)}, which no das-jax run "
                f"wrote there (it has no {MANIFEST_FILE}); a new run would write over them, so "
                "choose another output_dir (--set output_dir=DIR)")
        return
    found = run_files(path)
    if not found or overwrite:
        return
    if has_checkpoint:
        how = f"pass --resume {run_dir} to continue it, choose"
    else:
        how = "it has no checkpoint, so it cannot be resumed; choose"
    raise RunDirError(f"output_dir {str(run_dir)!r} already holds a run ({', '.join(found)}); "
                      f"{how} another output_dir (--set output_dir=DIR), or pass --overwrite to "
                      "replace it")


def clear_run(run_dir: str | os.PathLike) -> list[str]:
    """Removes a previous das-jax run's files from `run_dir`: only what das-jax writes there
    (see `_own_entries`; its directories too once empty) and only when `run_dir` holds a run
    manifest; the user's own files stay. Returns the removed paths relative to `run_dir`."""
    path = Path(run_dir)
    if not is_run(path):
        return []
    removed = []
    for p in _own_entries(path):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        removed.append(str(p.relative_to(path)))
    for d in RUN_DIRS:
        with contextlib.suppress(OSError):   # kept when it holds the user's files
            (path / d).rmdir()
    (path / MANIFEST_FILE).unlink()          # the new run writes its own
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
