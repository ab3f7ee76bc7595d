"""A deterministic co-tenant for benchmarks: N processes, each spinning one core, for as long as
a `with` block runs, so that "under load" is a reproducible measurement (`das-jax bench rollout
--load-cores N`) rather than whatever else the machine happens to run.

Each worker is a daemon process running a busy arithmetic loop that checks a shared stop flag
every ~1 ms of work and ends by itself after `max_seconds` (a bound should the parent die
without leaving the block). Leaving the block stops and joins the workers.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time


def _spin(stop, max_seconds: float) -> None:
    """Busy work on one core until `stop` is set or `max_seconds` pass."""
    end = time.monotonic() + max_seconds
    x = 0
    while not stop.is_set() and time.monotonic() < end:
        for i in range(20_000):      # ~1 ms of pure-Python work between checks
            x = (x * 31 + i) & 0xFFFF


class CoTenant:
    """`with CoTenant(n):` runs n spinning processes for the block's duration.

    Args:
      cores: processes to start (0: none; the block runs alone).
      max_seconds: each worker's own bound (a safety net; the block's end stops them first).

    Attributes:
      pids: the workers' process ids while the block runs.

    Raises:
      ValueError: cores < 0 or max_seconds <= 0.
    """

    def __init__(self, cores: int, max_seconds: float = 6 * 3600.0):
        if cores < 0:
            raise ValueError(f"--load-cores must be >= 0, got {cores}")
        if max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {max_seconds}")
        self.cores, self.max_seconds = int(cores), float(max_seconds)
        self._ctx = mp.get_context("spawn")     # no copy of the parent (jax, threads)
        self._stop = None
        self._procs: list = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> "CoTenant":
        if self.cores:
            self._stop = self._ctx.Event()
            self._procs = [self._ctx.Process(target=_spin, args=(self._stop, self.max_seconds),
                                             daemon=True, name=f"co-tenant-{i}")
                           for i in range(self.cores)]
            for p in self._procs:
                p.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._stop is not None:
            self._stop.set()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._procs = []

    def describe(self) -> dict:
        """What the run records: cores spun and the machine's core count."""
        return {"load_cores": self.cores, "cpu_count": os.cpu_count()}
