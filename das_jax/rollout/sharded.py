"""Rollouts on a device mesh: data-parallel replicas, each tensor-parallel over KV heads.

The local devices are split into R replicas of T = devices / R devices each
(`replica_meshes`; config `rollout.replicas`, default one replica per local device). Each replica
is a `Rollout` fork whose engine lives on its replica mesh (`Engine(mesh=...)`: params and KV
cache sharded over the T devices on the heads axis, `das_jax.engine.placement`). A
`ShardedRollout` is the `Rollout` interface over them:

* placement: whole GRPO groups (every request of one problem) on one replica, groups balanced by
  longest-processing-time-first on their predicted work (`multi_device.assign_groups`);
* one drafter shared by all replicas behind a lock, one speculation policy per replica
  (`multi_device`, "Drafter", says why);
* params: whatever sharding the caller holds them in (the trainer's FSDP sharding, one device,
  host numpy) are resharded on device to each replica's shardings (`reshard_for_rollout`:
  `jax.device_put` to NamedShardings, device-to-device, no host round trip);
* one host thread per replica dispatches its async jitted steps (JAX releases the GIL while XLA
  runs, so replicas overlap); outputs come back in request order, token-identical to one device
  (position-keyed sampling; tensor parallelism changes logits only by float rounding).

    rollout = rollout_from_config(config, model_config, None, eos_ids)  # a ShardedRollout when
    outputs, stats = rollout.generate(requests, params)                 # > 1 local device
    stats.assignment, stats.makespan_s, stats.device_forward_passes

Multi-host: each process builds replicas over its own local devices (`jax.local_devices()`) and
generates the requests it is given; params sharded over devices of several processes are first
all-gathered on device (`gather_to_local`, one collective that every process runs in the same
`generate` call), then resharded to the local replicas.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from das_jax.engine import GenerateError
from das_jax.engine.placement import MeshPlacement
from das_jax.parallel.sharding import make_mesh
from das_jax.rollout.multi_device import (DataParallelStats, assign_groups, assignment_loads,
                                          check_partition)
from das_jax.rollout.rollout import Rollout

__all__ = ["replica_meshes", "reshard_for_rollout", "gather_to_local", "ShardedRollout"]


def replica_meshes(devices: Sequence[jax.Device] | None = None,
                   replicas: int | None = None) -> list[Mesh]:
    """`replicas` meshes over `devices` (default `jax.local_devices()`): replica r gets the
    contiguous devices [r*T, (r+1)*T), T = len(devices) / replicas, as a ("data", "fsdp",
    "tensor") = (1, 1, T) mesh of Auto axes. `replicas` None: one replica per device (T = 1).

    Raises:
      GenerateError: replicas < 1, or it does not divide the device count (names
        `rollout.replicas`).
    """

    devices = list(devices if devices is not None else jax.local_devices())
    R = len(devices) if replicas is None else int(replicas)
    if R < 1 or len(devices) % R:
        raise GenerateError(f"rollout.replicas={replicas} must be >= 1 and divide the "
                            f"{len(devices)} local devices; set it to a divisor of "
                            f"{len(devices)} (or leave it unset: one replica per device)")
    T = len(devices) // R
    return [make_mesh(tensor=T, devices=devices[r * T:(r + 1) * T]) for r in range(R)]


def reshard_for_rollout(params, target):
    """`params` moved to the rollout's sharding, on device.

    Args:
      params: the params pytree on any sharding (e.g. the trainer's FSDP NamedShardings over the
        training mesh, one device, or host arrays).
      target: a replica `Mesh` (the rollout's param shardings on it: heads / KV heads / MLP over
        `tensor`, the rest replicated; `das_jax.engine.placement.ROLLOUT_RULES`), a
        `MeshPlacement`, an `Engine` on a mesh, or a pytree of shardings matching `params`.

    Returns:
      The params as `jax.Array`s with the target shardings. `jax.device_put` copies device to
      device for arrays already on devices (a leaf already placed is not copied), so the
      weights never go through the host; host (numpy) leaves are uploaded once.
    """

    if isinstance(target, Mesh):
        target = MeshPlacement(target)
    placement = getattr(target, "placement", None)
    if placement is not None:                  # an Engine on a mesh
        target = placement
    if isinstance(target, MeshPlacement):
        return target.put_params(params)
    return jax.device_put(params, target)


def gather_to_local(params, force: bool = False):
    """`params` with every leaf readable from this process: leaves that are fully addressable
    are returned as they are; if any is not (sharded over devices of other processes), the
    whole tree is all-gathered on device by one jitted identity with replicated out-shardings
    over each leaf's devices, and each leaf becomes its copy on this process's first device.
    A collective: under `jax.distributed`, every process must call it with the same tree.
    `force`: gather even when every leaf is addressable (tests exercise the gather this way in
    one process)."""

    leaves = jax.tree_util.tree_leaves(params)
    if not force and all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return params

    def replicated(x):
        devs = sorted(x.sharding.device_set, key=lambda d: (d.process_index, d.id))
        return NamedSharding(Mesh(np.asarray(devs), ("all",)), PartitionSpec())

    full = jax.jit(lambda t: t, out_shardings=jax.tree_util.tree_map(replicated, params))(params)
    return jax.tree_util.tree_map(lambda x: x.addressable_shards[0].data, full)


class ShardedRollout(Rollout):
    """The `Rollout` interface over data-parallel replicas on device meshes (module docstring).

    Args:
      template: a `Rollout` whose engine settings, speculation, das settings and sampling the
        replicas copy (`Rollout.fork` per mesh: its drafter becomes the shared locked drafter).
      meshes: one mesh per replica (`replica_meshes`).

    Attributes:
      replicas: the per-replica `Rollout`s; meshes: their meshes; drafter: the shared drafter;
      policy: the template's policy (history-based length predictions for placement).
    """

    def __init__(self, template: Rollout, meshes: Sequence[Mesh]):
        meshes = list(meshes)
        if not meshes:
            raise GenerateError("a ShardedRollout needs at least one replica mesh")
        self.template = template
        self.meshes = meshes
        self.replicas = [template.fork(m) for m in meshes]
        self.spec, self.das, self.sampling = template.spec, template.das, template.sampling
        self.drafter, self.policy = template.drafter, template.policy
        self.cost_model = template.cost_model
        self.engine = self.replicas[0].engine

    @classmethod
    def from_rollout(cls, template: Rollout, devices: Sequence[jax.Device] | None = None,
                     replicas: int | None = None) -> "ShardedRollout":
        """Replicas of `template` over `devices` (`replica_meshes(devices, replicas)`)."""
        return cls(template, replica_meshes(devices, replicas))

    # ------------------------------------------------------------------ properties
    @property
    def calibrated(self) -> bool:       # type: ignore[override]
        return all(r.calibrated for r in self.replicas)

    @calibrated.setter
    def calibrated(self, value: bool) -> None:
        for r in self.replicas:
            r.calibrated = value

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def tensor_parallel(self) -> int:
        """Devices per replica (the tensor-parallel group size)."""
        return int(self.meshes[0].shape["tensor"])

    # ------------------------------------------------------------------ generation
    def generate(self, requests, params=None, sampling=None,
                 progress: Callable[[int, int], None] | None = None,
                 request_ids: Sequence[int] | None = None,
                 assignment: str | Sequence[Sequence[int]] = "lpt",
                 predicted_lengths: Sequence[float] | None = None):
        """Generates `requests` over the replicas, one host thread per replica.

        Args:
          requests: `Request`s; outputs come back in the same order.
          params: params on any sharding (default: each replica engine's own), resharded on
            device to each replica (`reshard_for_rollout`).
          sampling: `SamplingParams` (default: this rollout's).
          progress: optional callback(finished_requests, total), over all replicas.
          request_ids: the ids the drafter sees (default 0..n-1).
          assignment: "lpt" (whole groups, on predicted work), "contiguous" (whole groups in
            order), or explicit per-replica lists of request indices.
          predicted_lengths: per request (-1 = unknown); default `predicted_lengths(requests)`
            (the problems' history).

        Before a speculation that plans with the cost model first runs on a replica, that
        replica's cost model is calibrated on its own devices (one replica at a time, so the
        timings are not disturbed by the others).

        Returns:
          (outputs in request order, `DataParallelStats`: combined counters + per replica).

        Raises:
          GenerateError / SamplingError: bad input, before any thread starts; an exception
          raised on a replica is re-raised here once every replica has stopped.
        """
        t0 = time.perf_counter()
        sampling = sampling if sampling is not None else self.sampling
        self.engine.validate(requests, sampling)
        n, R = len(requests), len(self.replicas)
        if predicted_lengths is None:
            predicted_lengths = self.predicted_lengths(requests)
        predicted = np.asarray(predicted_lengths, np.float64)
        if predicted.shape != (n,):
            raise GenerateError(f"predicted_lengths needs one entry per request ({n}), got "
                                f"shape {predicted.shape}")
        if isinstance(assignment, str):
            if assignment not in ("lpt", "contiguous"):
                raise GenerateError(f"unknown assignment {assignment!r}; valid: lpt, contiguous")
            assign = assign_groups([r.problem_id for r in requests], predicted, R, assignment)
        else:
            assign = [[int(i) for i in rep] for rep in assignment]
        check_partition(assign, n, R)
        ids = list(range(n)) if request_ids is None else [int(i) for i in request_ids]
        if len(ids) != n:
            raise GenerateError(f"request_ids needs one id per request ({n}), got {len(ids)}")

        # On-device resharding to every replica (async dispatch), before any thread starts.
        if params is not None:
            params = gather_to_local(params)
        placed = [None if params is None else r.engine.place_params(params)
                  for r in self.replicas]
        for r, rep, p in zip(self.replicas, assign, placed):
            if (rep and r.spec.uses_cost_model and r.das.cost_model.calibrate
                    and not r.calibrated):
                r.calibrate([requests[i] for i in rep], sampling, params=p)

        lock, done = threading.Lock(), [0]

        def tick(_finished: int, _total: int) -> None:
            with lock:
                done[0] += 1
                finished = done[0]
            progress(finished, n)

        def run(k: int):
            if not assign[k]:
                return None, None
            return self.replicas[k].generate(
                [requests[i] for i in assign[k]], placed[k], sampling,
                progress=tick if progress else None, request_ids=[ids[i] for i in assign[k]])

        with concurrent.futures.ThreadPoolExecutor(max_workers=R,
                                                   thread_name_prefix="das-replica") as pool:
            futures = [pool.submit(run, k) for k in range(R)]
            concurrent.futures.wait(futures)
        results = [f.result() for f in futures]     # re-raises a replica's exception

        outputs: list[Any] = [None] * n
        for k, (outs, _) in enumerate(results):
            for i, o in zip(assign[k], outs or ()):
                outputs[i] = o
        stats = DataParallelStats.combine(
            [st for _, st in results],
            devices=[[str(d) for d in m.devices.flat] for m in self.meshes], assignment=assign,
            predicted_work=assignment_loads(assign, predicted),
            call_wall_s=time.perf_counter() - t0)
        return outputs, stats

    def calibrate(self, requests, sampling=None, params=None):
        """Calibrates every replica's cost model on its own devices, one replica at a time.
        Returns the first replica's `CostModel`."""
        for r in self.replicas:
            r.calibrate(requests, sampling, params=params)
        return self.replicas[0].cost_model

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """{"drafter": the shared drafter's state or None, "policy": {"replicas": [each
        replica policy's state]} or None}: plain data (saved as JSON + npz)."""
        policies = [r.policy for r in self.replicas]
        return {"drafter": self.drafter.state_dict() if self.drafter is not None else None,
                "policy": ({"replicas": [p.state_dict() for p in policies]}
                           if all(hasattr(p, "state_dict") for p in policies) else None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`'s output. A policy state from another replica count is spread
        round-robin; a single rollout's policy state goes to every replica."""
        if self.drafter is not None and state.get("drafter") is not None:
            self.drafter.load_state_dict(state["drafter"])
        pol = state.get("policy")
        if not pol:
            return
        states = pol["replicas"] if isinstance(pol, dict) and "replicas" in pol else [pol]
        for k, r in enumerate(self.replicas):
            if hasattr(r.policy, "load_state_dict") and states:
                r.policy.load_state_dict(states[k % len(states)])

    # ------------------------------------------------------------------ devices
    def fork(self, device) -> Rollout:
        raise GenerateError("a ShardedRollout is already placed on its replica meshes; fork "
                            "its template (rollout.template) instead")

    def forks(self, devices=None) -> list[Rollout]:
        """The replica rollouts."""
        return list(self.replicas)

    def with_speculation(self, speculation: str, das=None, cost_model=None) -> "ShardedRollout":
        """Replicas on the same meshes with another speculation (fresh drafter and policies)."""
        t = self.template
        template = Rollout(t.engine, speculation, das if das is not None else self.das,
                           self.sampling, cost_model)
        return ShardedRollout(template, self.meshes)

    def __repr__(self) -> str:
        return (f"ShardedRollout({self.name!r}, replicas={self.num_replicas}, "
                f"tensor_parallel={self.tensor_parallel}, engine_config={self.engine_config})")
