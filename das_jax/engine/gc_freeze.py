"""Python's cyclic garbage collector kept off the objects that exist before a rollout starts.

A full (oldest-generation) collection traverses every container object the process holds: with
JAX, numba and a model loaded that is ~110 ms on the 2-core development machine, and it lands
inside whichever step of the scheduler's loop happens to allocate the object that triggers it:
on a GPU, a stall of several device steps. `frozen_gc` moves everything that exists when a
rollout starts into the permanent generation (`gc.freeze`), so that collections during the
rollout traverse only the objects the rollout itself made, and puts them back into the oldest
generation when it ends (`gc.unfreeze`), so that cyclic garbage among them is still collected
later (between rollouts, in a normal full collection). Measured in docs/results/host-loop.md.

Nested or concurrent rollouts (in-process replicas on threads) share one freeze: the first to
enter freezes, the last to leave unfreezes.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def frozen_gc():
    """Context manager: `gc.freeze()` on the first entry, `gc.unfreeze()` on the last exit
    (also on an exception). Collections keep running inside; they skip the frozen objects."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
