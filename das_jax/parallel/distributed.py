"""Multi-process (multi-host) runs: `jax.distributed` set-up from the config or the environment,
and the few cross-process agreements the trainer needs.

Every process runs the same program on the same data: the same config (checked:
`check_same_config`), the same seeds and data order; each process generates its share of a
step's GRPO groups on its local devices from a replicated copy of the params, and the shares are
gathered into the same whole batch on every process (`das_jax.parallel.rollout_split`); then one
SPMD train step over the global mesh. Process 0 writes the run directory's
logs; every process writes its own shards of the orbax checkpoint and its own drafter / DAS state.

A process that dies stops sending heartbeats; after `distributed.heartbeat_timeout` seconds the
coordination service reports it and jax terminates every other process with "Terminating process
because the JAX distributed service detected fatal errors ... another task died" (exit code 134,
SIGABRT), instead of hanging in a collective.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
from typing import Any, Mapping

import numpy as np

from das_jax.errors import UserError

log = logging.getLogger("das_jax.distributed")

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class DistributedError(UserError):
    """A multi-process run that cannot start or whose processes disagree (one line, the fix)."""


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    coordinator_address: str
    num_processes: int
    process_id: int
    initialization_timeout: int
    heartbeat_timeout: int


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not an integer; set it to a number "
                               "(or unset it)") from None


def resolve(section, environ: Mapping[str, str] | None = None) -> DistributedSpec | None:
    """The `jax.distributed` arguments of a `config.DistributedSection`, each key left null taken
    from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID). None for a
    single-process run (nothing set, or num_processes 1).

    Raises:
      DistributedError: a partial set-up (e.g. num_processes without a coordinator address or a
        process id), or a process id out of range.
    """
    environ = os.environ if environ is None else environ
    addr = section.coordinator_address or environ.get(ENV_COORDINATOR) or None
    n = section.num_processes if section.num_processes is not None else _env_int(
        environ, ENV_NUM_PROCESSES)
    pid = section.process_id if section.process_id is not None else _env_int(
        environ, ENV_PROCESS_ID)
    if addr is None and n in (None, 1) and pid in (None, 0):
        return None
    if n == 1:
        return None
    missing = [name for name, v in (("coordinator_address (or JAX_COORDINATOR_ADDRESS)", addr),
                                    ("num_processes (or JAX_NUM_PROCESSES)", n),
                                    ("process_id (or JAX_PROCESS_ID)", pid)) if v is None]
    if missing:
        keys = ", distributed.".join(missing)
        raise DistributedError(f"a multi-process run needs distributed.{keys}; set them in the "
                               "config (--set distributed.KEY=VALUE) or the environment on "
                               "every process")
    if not 0 <= pid < n:
        raise DistributedError(f"distributed.process_id={pid} must be in 0..{n - 1} "
                               f"(num_processes={n})")
    return DistributedSpec(str(addr), int(n), int(pid), int(section.initialization_timeout),
                           int(section.heartbeat_timeout))


def initialize_from_config(section) -> DistributedSpec | None:
    """Calls `jax.distributed.initialize` for a multi-process run (no-op for one process, or
    when already initialised). Must run before anything touches a JAX device.

    Raises:
      DistributedError: see `resolve`; JAX already initialised its devices; the other processes
        did not connect within `initialization_timeout`.
    """
    spec = resolve(section)
    if spec is None and getattr(section, "cluster_detection", False):
        return _initialize_detected(section)
    if spec is None:
        return None
    # deferred import: jax (not loaded by importing this module)
    import jax
    if jax.distributed.is_initialized():
        return spec
    try:
        jax.distributed.initialize(
            spec.coordinator_address, spec.num_processes, spec.process_id,
            initialization_timeout=spec.initialization_timeout,
            heartbeat_timeout_seconds=spec.heartbeat_timeout)
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DistributedError(
            f"jax.distributed.initialize (process {spec.process_id} of {spec.num_processes}, "
            f"coordinator {spec.coordinator_address}) failed: {first}; start every process "
            "within distributed.initialization_timeout seconds with the same coordinator "
            "address, and before anything else uses JAX") from None
    log.info("process %d of %d (coordinator %s)", spec.process_id, spec.num_processes,
             spec.coordinator_address)
    return spec


def _initialize_detected(section) -> DistributedSpec | None:
    """`jax.distributed.initialize()` without arguments: JAX's cluster detection (SLURM, Open
    MPI, Kubernetes, ...) sets the coordinator, the process count and id, and the local device
    of each process. None when it finds a single process."""
    # deferred import: jax (not loaded by importing this module)
    import jax
    if not jax.distributed.is_initialized():
        try:
            jax.distributed.initialize(initialization_timeout=int(section.initialization_timeout),
                                       heartbeat_timeout_seconds=int(section.heartbeat_timeout))
        except (RuntimeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DistributedError(
                f"distributed.cluster_detection: jax.distributed.initialize() found no cluster "
                f"to join ({first}); run under SLURM / Open MPI / Kubernetes, or set "
                "distributed.coordinator_address, num_processes and process_id (or turn "
                "cluster_detection off)") from None
    n, pid = jax.process_count(), jax.process_index()
    if n <= 1:
        return None
    log.info("process %d of %d (cluster detected by jax)", pid, n)
    return DistributedSpec("detected", n, pid, int(section.initialization_timeout),
                           int(section.heartbeat_timeout))


def process_count() -> int:
    # deferred import: jax (not loaded by importing this module)
    import jax
    return jax.process_count()


def is_primary() -> bool:
    """True on process 0 (the one that writes logs); True without jax.distributed."""
    if "jax" not in sys.modules:
        return True
    # deferred import: jax (not loaded by importing this module)
    import jax
    return jax.process_index() == 0


def config_fingerprint(config) -> str:
    """sha256 of the resolved config (a `das_jax.config.Config`, as JSON), without the
    per-process `distributed.process_id`."""
    d = dataclasses.asdict(config)
    d.get("distributed", {}).pop("process_id", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def check_same_config(config) -> None:
    """Compares every process's config fingerprint (a collective: every process must call it).

    Raises:
      DistributedError (on every process): the processes' resolved configs differ.
    """
    if process_count() <= 1:
        return
    # deferred import: jax (not loaded by importing this module)
    from jax.experimental import multihost_utils
    digest = np.frombuffer(bytes.fromhex(config_fingerprint(config)), np.uint32)
    every = np.asarray(multihost_utils.process_allgather(digest))  # [P, 8]
    differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
    if differ:
        raise DistributedError(
            f"the processes' configs differ (process {', '.join(map(str, differ))} vs process "
            "0): every process must get the same config file, --set overrides and code version; "
            "only distributed.process_id may differ")


def sync(name: str) -> None:
    """A barrier across processes (no-op for one process)."""
    if process_count() > 1:
        # deferred import: jax (not loaded by importing this module)
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def broadcast_from_primary(tree: Any) -> Any:
    """Process 0's value of a pytree of numpy arrays on every process (same shapes required);
    the tree itself for one process."""
    if process_count() <= 1:
        return tree
    # deferred import: jax (not loaded by importing this module)
    import jax
    from jax.experimental import multihost_utils
    out = multihost_utils.broadcast_one_to_all(tree)
    return jax.tree_util.tree_map(np.asarray, out)


def max_over_processes(value: int) -> int:
    """The largest `value` over all processes (a collective)."""
    if process_count() <= 1:
        return int(value)
    # deferred import: jax (not loaded by importing this module)
    from jax.experimental import multihost_utils
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int32))))
