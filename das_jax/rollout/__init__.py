"""das_jax.rollout: the one interface to speculative rollouts.

Public surface:
  Rollout                                     an engine + its speculation (rollout.py)
  rollout_from_config                         the `Rollout` a config asks for; a
                                              `ShardedRollout` over several devices (factory.py)
  register_speculation, unregister_speculation, speculation_names, get_speculation,
  build_speculation,
  SpeculationSpec, SpeculationError           the registry of speculation names
                                              (`das_jax.speculation`, re-exported here)
  ShardedRollout, replica_meshes,
  reshard_for_rollout, gather_to_local       data-parallel replicas on device meshes, each
                                              tensor-parallel over KV heads (sharded.py)
  LockedDrafter, DataParallelStats, assign_lpt, assign_contiguous, assign_groups,
  group_indices, assignment_loads             placement of whole groups over replicas
                                              (multi_device.py)

Dependencies: `rl` and `bench` -> `rollout` -> `speculation`, `config` -> `engine`, `drafter`
-> `models`. Names are imported lazily (PEP 562); the registry imports no jax.
"""
from __future__ import annotations

from das_jax._lazy import lazy_exports

_NAMES = "das_jax.speculation.names"
_EXPORTS = {
    "Rollout": "rollout", "rollout_from_config": "factory",
    "register_speculation": _NAMES, "unregister_speculation": _NAMES,
    "speculation_names": _NAMES, "get_speculation": _NAMES, "build_speculation": _NAMES,
    "SpeculationSpec": _NAMES, "SpeculationError": _NAMES,
    "ShardedRollout": "sharded", "replica_meshes": "sharded", "reshard_for_rollout": "sharded",
    "gather_to_local": "sharded",
    "exercise_kernels": "warmup",
    "LockedDrafter": "multi_device",
    "DataParallelStats": "multi_device", "assign_lpt": "multi_device",
    "assign_contiguous": "multi_device", "assignment_loads": "multi_device",
    "assign_groups": "multi_device", "group_indices": "multi_device",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
