"""Console lines of a run: the "HH:MM:SS message" handler of the "das_jax" logger
(`setup_console_logging`, which the CLI installs), `fmt_seconds`, and `phase` blocks that log
what they did and how long it took."""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from typing import Iterator

log = logging.getLogger("das_jax.train")


class _ConsoleHandler(logging.Handler):
    """Writes records to the *current* `sys.stderr` through `tqdm.write`, so lines never tear
    an active progress bar (and a test's captured stderr sees them)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm  # deferred import: tqdm (slow to import)
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


_console_handler: logging.Handler | None = None


def setup_console_logging(level: int = logging.INFO) -> logging.Handler:
    """Sends das_jax's log records at `level` and above to stderr as "HH:MM:SS message" lines.
    Idempotent: a second call replaces the handler the first one installed."""
    global _console_handler
    root = logging.getLogger("das_jax")
    if _console_handler is not None:
        root.removeHandler(_console_handler)
    handler = _ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False   # a library's logging.basicConfig() would print every line twice
    _console_handler = handler
    return handler


def fmt_seconds(s: float | None) -> str:
    """`12.3 s`, `4 min 05 s`, `1 h 02 min`."""
    if s is None or not math.isfinite(s):
        return "?"
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


class Phase:
    """What a `phase` block may add to its closing line (`detail`)."""

    detail: str = ""


@contextlib.contextmanager
def phase(what: str, logger: logging.Logger = log) -> Iterator[Phase]:
    """Logs `what ...` on entry and `what: <detail>, <seconds>` on exit (not on an exception,
    which speaks for itself)."""
    p = Phase()
    logger.info("%s ...", what)
    t0 = time.perf_counter()
    yield p
    dt = time.perf_counter() - t0
    logger.info("%s: %s%s", what, f"{p.detail}, " if p.detail else "", f"done in {fmt_seconds(dt)}")
