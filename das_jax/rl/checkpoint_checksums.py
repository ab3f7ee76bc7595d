"""Checksums of a checkpoint's files: bytes that changed on disk after a save are found before
a restore reads them.

Orbax and Tensorstore keep no checksum of the array data (a flipped byte inside an OCDBT data
file restores silently as a wrong weight), so after a step directory is committed, process 0
writes `checksums.json` into it: for every file under the directory, its size and CRC-32
(`zlib.crc32`, ~2.5 GB/s per core here; files hashed on up to 8 threads, which `zlib` releases
the GIL for). `verify` recomputes them before a restore: a file whose size or CRC differs, or
that is missing, raises `CheckpointError` naming it. A step directory without the file (written
by an older das-jax, or a save interrupted between orbax's commit and this file) is not
verified.

    write(step_dir)     # after the save is committed (process 0)
    verify(step_dir)    # before a restore (CheckpointError on a mismatch)

This module imports no jax.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import zlib
from pathlib import Path

from das_jax.rl.checkpoint_errors import CheckpointError

CHECKSUM_FILE = "checksums.json"
FORMAT = "das-jax checkpoint checksums"
_BLOCK = 16 << 20      # bytes read at a time


def _files(step_dir: Path) -> list[str]:
    """Paths (relative, '/'-separated, sorted) of the regular files under `step_dir` but the
    checksum file."""
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir).replace(os.sep, "/")
            if rel != CHECKSUM_FILE:
                out.append(rel)
    return sorted(out)


def _crc(path: Path) -> tuple[int, int]:
    """(size in bytes, CRC-32) of the file at `path`."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc


def _crcs(step_dir: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    workers = max(1, min(8, os.cpu_count() or 1, len(names)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda n: _crc(step_dir / n), names)))


def write(step_dir: str | os.PathLike) -> Path:
    """Writes `<step_dir>/checksums.json` (atomically: a temporary file renamed into place);
    returns its path. Raises OSError when the directory cannot be read or written."""
    step_dir = Path(step_dir)
    sums = _crcs(step_dir, _files(step_dir))
    path = step_dir / CHECKSUM_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "version": 1, "algorithm": "crc32",
                               "files": {n: {"size": s, "crc32": c}
                                         for n, (s, c) in sums.items()}}, indent=0) + "\n")
    os.replace(tmp, path)
    return path


def verify(step_dir: str | os.PathLike) -> bool:
    """Checks the files of `step_dir` against its `checksums.json`; returns False when there is
    none (not verified), True when every file matches.

    Raises:
      CheckpointError: a file listed there is missing, or its size or CRC-32 differs (the
        message names the file and the fix), or the checksum file itself is unreadable.
    """
    step_dir = Path(step_dir)
    path = step_dir / CHECKSUM_FILE
    if not path.is_file():
        return False
    fix = ("its bytes changed on disk after the save: restore the checkpoint from a copy, or "
           "remove that step's directory to use an earlier checkpoint")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        listed = {str(n): (int(v["size"]), int(v["crc32"])) for n, v in doc["files"].items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        err = CheckpointError(f"checkpoint {step_dir} is corrupt: its {CHECKSUM_FILE} is "
                              f"unreadable ({type(e).__name__}); {fix}")
        err.reason = f"corrupt ({CHECKSUM_FILE} unreadable)"
        raise err from None
    missing = [n for n in listed if not (step_dir / n).is_file()]
    if missing:
        err = CheckpointError(f"checkpoint {step_dir} is corrupt: {missing[0]} is missing "
                              f"({len(missing)} of its {len(listed)} files); {fix}")
        err.reason = f"corrupt ({missing[0]} is missing)"
        raise err
    found = _crcs(step_dir, sorted(listed))
    bad = [n for n in sorted(listed) if found[n] != listed[n]]
    if bad:
        size, crc = found[bad[0]]
        what = ("its size differs" if size != listed[bad[0]][0] else "its CRC-32 differs")
        err = CheckpointError(f"checkpoint {step_dir} is corrupt: {bad[0]} does not match the "
                              f"checksum written at save ({what}; {len(bad)} file(s) differ); "
                              f"{fix}")
        err.reason = f"corrupt ({bad[0]} does not match its checksum)"
        raise err
    return True
