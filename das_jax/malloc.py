"""Hands memory that the C allocator holds on free lists back to the operating system.

XLA:CPU, tensorstore (orbax checkpoints) and the GGUF dequantisation allocate and free large host
buffers from several threads; glibc keeps freed memory in per-thread arenas and returns it to the
system only from the top of each heap, so a process's RSS stays at its high-water mark long after
the buffers are gone (the main job's figures are in docs/results/memory.md).
`release_free_memory()` calls glibc's `malloc_trim(0)` (man 3 malloc_trim), which releases the free
pages of every arena; the trainer calls it between phases, so the next phase (e.g. the update after
a rollout) starts from live memory only. Elsewhere (another libc, or no libc found) it does
nothing.

Trimming between phases does not help within one: during the update XLA allocates and frees its
buffers from a dozen threads, and glibc's *dynamic* mmap threshold (it rises to the size of any
mmapped block freed, up to 32 MB; mallopt(3), "M_MMAP_THRESHOLD") sends every buffer under 32 MB to
a per-thread arena, where the freed ones stay resident until the next trim. `configure_allocator()`
fixes the threshold at 256 KiB (larger blocks are mmapped and go back to the OS when freed), the
trim threshold at 1 MiB and the number of arenas at 2 -- what the environment variables
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / MALLOC_ARENA_MAX do (a variable the user set
wins). `das-jax train` calls it at start-up (its effect on the main job's peak RSS:
docs/results/memory.md).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import threading

__all__ = ["configure_allocator", "release_free_memory", "release_trace_caches"]

# mallopt(3) parameter numbers (glibc <malloc.h>)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
ALLOCATOR_SETTINGS = (  # (mallopt parameter, value, the environment variable that overrides it)
    (_M_MMAP_THRESHOLD, 256 * 1024, "MALLOC_MMAP_THRESHOLD_"),
    (_M_TRIM_THRESHOLD, 1024 * 1024, "MALLOC_TRIM_THRESHOLD_"),
    (_M_ARENA_MAX, 2, "MALLOC_ARENA_MAX"),
)


@functools.lru_cache(maxsize=1)
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is None:  # not glibc: nothing to call
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Returns free heap pages to the OS (glibc `malloc_trim(0)`); True when memory was
    released, False when nothing was or the C library has no `malloc_trim`. Takes a few ms."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


def configure_allocator() -> list[str]:
    """Sets glibc's allocator for a long-running process with large, short-lived buffers: a fixed
    256 KiB mmap threshold, a 1 MiB trim threshold, 2 arenas (module docstring). Call it early,
    before threads start. A setting whose environment variable is set is left to glibc (which
    read it at start-up). Returns the names of the settings applied ([] without glibc's
    `mallopt`). Process-wide and idempotent."""
    fn = getattr(_libc(), "mallopt", None)
    if fn is None:
        return []
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    applied = []
    for param, value, env in ALLOCATOR_SETTINGS:
        if env not in os.environ and fn(param, value) == 1:
            applied.append(env)
    return applied


# ------------------------------------------------------------------ jax's tracing caches
# Every shape a jitted function is compiled for also leaves its jaxpr, lowering and dispatch
# bookkeeping in jax's Python-level caches (`lu.cache`, `util.cache`, `weakref_lru_cache`):
# ~3-13 MB of Python objects per program, measured (the compiled executables themselves are
# held by jax's C++ jit caches and by the engine's own table). Over the main job's ~130
# programs that is most of the growth of its RSS from step to step.
_SLOW_COMPILE_S = 0.1  # a backend compile this long is a new program (eager ops take ~20-40 ms)
_EAGER_OP_CACHE = "xla_primitive_callable"  # jax's cache of the programs of eager ops
_new_programs = [0]
_watch_lock = threading.Lock()


def _on_compile(event: str, duration: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration" and duration >= _SLOW_COMPILE_S:
        _new_programs[0] += 1


@functools.lru_cache(maxsize=1)
def _watch_compiles() -> None:
    # deferred import: jax (not loaded by importing this module)
    import jax
    jax.monitoring.register_event_duration_secs_listener(_on_compile)


def release_trace_caches(force: bool = False) -> bool:
    """Drops jax's Python-level tracing and lowering caches when a new program was compiled
    since the last call (or with `force`), then collects garbage and trims the heap; returns
    whether it did. Compiled executables stay: the next call of a jitted function with a shape
    it has seen takes jax's C++ fast path, no retrace and no recompile (an eager op on a new
    array re-lowers). The first call only starts watching compiles (and clears
    when `force`).

    This is `jax._src.util.clear_all_caches` (the first half of `jax.clear_caches()`, whose
    second half drops the executables too) except the cache of eager ops' programs (small,
    and they would all recompile); a jax without those internals makes this a no-op (False).
    """
    _watch_compiles()
    with _watch_lock:
        if not force and _new_programs[0] == 0:
            return False
        _new_programs[0] = 0
    try:
        # deferred import: jax (not loaded by importing this module)
        from jax._src import util
        caches = list(util._caches)
    except (ImportError, AttributeError):  # pragma: no cover - another jax
        return False
    for cache in caches:
        # eager ops keep theirs: each is a small program, and dropping it would recompile every
        # eager op of the next step (~25 programs of the main job, each counted as "new")
        if getattr(getattr(cache, "__wrapped__", None), "__name__", "") != _EAGER_OP_CACHE:
            cache.cache_clear()
    gc.collect()
    release_free_memory()
    return True
