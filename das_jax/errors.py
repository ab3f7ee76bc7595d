"""User errors: what the CLI reports as one line (exit code 2) instead of a traceback.

A *user error* is a fault of the input or the environment that the user can fix (a bad config
value, a missing or corrupt file, a full disk, a busy run directory), as opposed to a bug. The
project's user-error types are:

  UserError (here)                 base for new user-facing errors (e.g. `RunDirError`)
  das_jax.config.ConfigError       invalid config / --set override
  das_jax.models.ModelLoadError    unknown model source, unreadable / corrupt model files
  das_jax.models.ModelConfigError  unsupported architecture / inconsistent config.json
  das_jax.data.DatasetError        missing / unreadable / malformed dataset files
  das_jax.rl.TrainError            a run that cannot start or resume
  das_jax.rl.CheckpointError       missing / corrupt / mismatching checkpoints
  OSError                          a full disk (ENOSPC, EDQUOT), permissions, missing paths

`user_error_message(exc)` returns the one-line message for those (None for anything else, which
is a bug and keeps its traceback). Messages name the input and the fix; this module only
flattens them to one line and says "disk full" for ENOSPC. It imports nothing heavy: an error
type whose module was never imported cannot have been raised, so it is looked up in
`sys.modules` only.
"""
from __future__ import annotations

import errno
import sys


class UserError(ValueError):
    """An error caused by the user's input or environment; its message names the input and the
    fix (the CLI prints it as one line and exits with code 2)."""


_USER_ERROR_TYPES = (
    ("das_jax.config", "ConfigError"),
    ("das_jax.models.errors", "ModelLoadError"),
    ("das_jax.models.config", "ModelConfigError"),
    ("das_jax.data.problems", "DatasetError"),
    ("das_jax.rl.train_error", "TrainError"),
    ("das_jax.rl.checkpoint_errors", "CheckpointError"),
)

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def user_error_types() -> tuple[type, ...]:
    """The user-error exception types of the modules imported so far (plus UserError)."""
    out: list[type] = [UserError]
    for module, name in _USER_ERROR_TYPES:
        mod = sys.modules.get(module)
        if mod is not None and isinstance(getattr(mod, name, None), type):
            out.append(getattr(mod, name))
    return tuple(out)


def _chain(exc: BaseException | None):
    """`exc` and the exceptions it was raised from or while handling (as a traceback shows)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ if exc.__cause__ is not None else (
            None if exc.__suppress_context__ else exc.__context__)


def disk_full_error(exc: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT OSError in `exc`'s cause/context chain (or `exc` itself), if any."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e
    return None


_DISK_FULL_TEXT = ("no space left on device", "disk quota exceeded", "enospc")


def is_disk_full(exc: BaseException) -> bool:
    """True when `exc` (or its cause/context chain) says the disk is full: an ENOSPC / EDQUOT
    OSError, or a wrapped error whose message says so (orbax / tensorstore re-raise I/O failures
    as other types, keeping only the text)."""
    return disk_full_error(exc) is not None or any(
        t in str(e).lower() for e in _chain(exc) for t in _DISK_FULL_TEXT)


def disk_full_message(err: OSError, what: str = "writing") -> str:
    """"disk full while <what> <path>: free space ... or choose another output_dir"."""
    where = err.filename or "the output directory"
    return (f"disk full ({err.strerror or 'no space left on device'}) while {what} {where}; free "
            "space on that disk or choose an output_dir on another one")


def one_line(text: str) -> str:
    """`text` with its lines joined by "; " (indentation dropped)."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    return "; ".join(parts)


def user_error_message(exc: BaseException) -> str | None:
    """The one-line message for a user error, or None when `exc` is not one (a bug). The
    project's own error types keep their message; other errors raised from a full disk say so."""
    if isinstance(exc, user_error_types()):
        return one_line(str(exc)) or type(exc).__name__
    full = disk_full_error(exc)
    if full is not None:
        return disk_full_message(full)
    if isinstance(exc, OSError):
        if exc.filename is not None:
            return f"{exc.filename}: {exc.strerror or exc}"
        return one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, SystemExit) and isinstance(exc.code, str):
        return one_line(exc.code)
    return None
