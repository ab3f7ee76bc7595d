"""Which devices a training run trains on and which only generate (`mesh.rollout_devices`), and
the train mesh over the former."""
from __future__ import annotations

import jax

from das_jax.config import Config
from das_jax.parallel.sharding import MESH_AXES, MeshError, mesh_from_config, resolve_mesh_shape
from das_jax.rl.train_error import TrainError


def split_devices(c: Config):
    """(the devices that train, the devices that only generate or None): every device of every
    process trains with `mesh.rollout_devices: 0`; otherwise the last `rollout_devices` of a
    one-process run generate and the others train.

    Raises:
      TrainError: rollout_devices leaves no device to train on, or the run has several
        processes (one line each).
    """
    devices, r = jax.devices(), c.mesh.rollout_devices
    if r == 0:
        return devices, None
    if jax.process_count() > 1:
        raise TrainError(f"mesh.rollout_devices={r} splits the devices of one process, but this "
                         f"run has {jax.process_count()} processes; set mesh.rollout_devices: 0")
    if r >= len(devices):
        raise TrainError(f"mesh.rollout_devices={r} leaves no device to train on (jax sees "
                         f"{len(devices)}); set it below {len(devices)}, or 0 to share them")
    return devices[:len(devices) - r], devices[len(devices) - r:]


def train_mesh(c: Config, devices=None):
    """The `mesh:` over `devices` (default: every device of every process); None for one device
    in one process (the plain single-device path, on that device: the first).

    Raises:
      TrainError: the mesh sizes do not fit the devices (one line).
    """
    devices = list(devices if devices is not None else jax.devices())
    try:
        if len(devices) == 1:
            resolve_mesh_shape({a: getattr(c.mesh, a) for a in MESH_AXES}, 1)  # checks only
            return None
        return mesh_from_config(c.mesh, devices)
    except MeshError as e:
        split = (f" less mesh.rollout_devices={c.mesh.rollout_devices}"
                 if c.mesh.rollout_devices else "")
        raise TrainError(f"{e} (mesh: in the config; jax sees {jax.device_count()} devices in "
                         f"{jax.process_count()} process(es){split})") from None
