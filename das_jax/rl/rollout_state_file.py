"""The rollout state (drafter + DAS policy) in a checkpoint, as data, never code: a tree of dicts,
lists, tuples, str / int / float / bool / None and numpy arrays (what the drafters' and
policies' `state_dict()` return) mapped exactly to JSON + arrays (`encode_state` /
`decode_state`), and the orbax handler that writes it as `drafter_state.json` +
`drafter_state.npz` (arrays read with allow_pickle=False; `drafter_state.p<i>.*` from process
i > 0). An older version's pickle (`drafter_state.pkl`) is refused, never unpickled. See
`das_jax.rl.checkpoint` for the checkpoint layout."""
from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from das_jax.rl.checkpoint_errors import CheckpointError, CheckpointFormatError

DRAFTER_FILE = "drafter_state.json"        # process 0's; process i > 0: drafter_state.p<i>.json
LEGACY_PICKLE_FILE = "drafter_state.pkl"   # older das-jax versions (refused, never read)
STATE_FORMAT = "das-jax rollout state"
STATE_VERSION = 1


_TAGS = ("__array__", "__tuple__", "__dict__", "__float__")


def encode_state(state: Any) -> tuple[Any, list[np.ndarray]]:
    """Maps a state tree to (a JSON-able tree, its arrays).

    Dicts with str keys (none starting with "__") stay JSON objects; other dicts become
    `{"__dict__": [[key, value], ...]}`, tuples `{"__tuple__": [...]}`, arrays (numpy / jax)
    `{"__array__": i}` (index into the returned list), non-finite floats `{"__float__": "nan"}`;
    numpy scalars become Python scalars.

    Raises:
      CheckpointError: a value of another type (named with its path in the tree), or an array of
        object dtype.
    """
    arrays: list[np.ndarray] = []

    def enc(x, path):
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, (int, np.integer)) and not isinstance(x, np.bool_):
            return int(x)
        if isinstance(x, np.bool_):
            return bool(x)
        if isinstance(x, (float, np.floating)):
            x = float(x)
            return x if math.isfinite(x) else {"__float__": repr(x)}
        if isinstance(x, (np.ndarray, jax.Array)):
            a = np.asarray(x)
            if a.dtype.hasobject:
                raise CheckpointError(f"rollout state at {path} is an object array; state_dict() "
                                      "must return numeric arrays")
            arrays.append(a)
            return {"__array__": len(arrays) - 1}
        if isinstance(x, list):
            return [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: enc(v, f"{path}.{k}") for k, v in x.items()}
            return {"__dict__": [[enc(k, f"{path} key"), enc(v, f"{path}[{k!r}]")]
                                 for k, v in x.items()]}
        raise CheckpointError(f"rollout state at {path} is a {type(x).__name__}; state_dict() "
                              "must return dicts, lists, tuples, str, int, float, bool, None and "
                              "numpy arrays")

    return enc(state, "state"), arrays


def decode_state(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    """Inverse of `encode_state` (`arrays`: "a<i>" -> array i).

    Raises:
      ValueError: an unknown tag, a missing array, or an unhashable dict key.
    """
    def dec(x):
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        tags = [k for k in x if k.startswith("__")]
        if not tags:
            return {k: dec(v) for k, v in x.items()}
        if len(x) != 1 or tags[0] not in _TAGS:
            raise ValueError(f"unknown entry {sorted(x)[:3]}")
        tag, v = tags[0], x[tags[0]]
        if tag == "__array__":
            if not isinstance(v, int) or f"a{v}" not in arrays:
                raise ValueError(f"array {v!r} is missing")
            return arrays[f"a{v}"]
        if tag == "__tuple__":
            return tuple(dec(e) for e in v)
        if tag == "__float__":
            if v not in ("nan", "inf", "-inf"):
                raise ValueError(f"bad float {v!r}")
            return float(v)
        out = {}
        for k, val in v:
            k = dec(k)
            if not isinstance(k, (str, int, float, bool, tuple, type(None))):
                raise ValueError(f"unhashable key {k!r}")
            out[k] = dec(val)
        return out

    return dec(tree)


def _process_file(process_index: int, suffix: str = ".json") -> str:
    base = DRAFTER_FILE.removesuffix(".json")
    return f"{base}{suffix}" if process_index == 0 else f"{base}.p{process_index}{suffix}"


class StateCheckpointHandler(ocp.CheckpointHandler):
    """Saves the rollout state (drafter + policy) as JSON + npz, one pair of files per process in
    the item directory (synchronous): each process of a multi-process run keeps its own (e.g. its
    drafter history). Restores them without ever unpickling (`np.load(allow_pickle=False)`)."""

    def save(self, directory: epath.Path, args: "StateSave"):
        tree, arrays = encode_state(args.item)
        buf = io.BytesIO()
        np.savez(buf, **{f"a{i}": a for i, a in enumerate(arrays)})
        i = jax.process_index()
        (directory / _process_file(i, ".npz")).write_bytes(buf.getvalue())
        (directory / _process_file(i)).write_text(json.dumps(
            {"format": STATE_FORMAT, "version": STATE_VERSION, "num_arrays": len(arrays),
             "state": tree}, allow_nan=False))

    def restore(self, directory: epath.Path, args: "StateRestore | None" = None):
        i = jax.process_index()
        path = directory / _process_file(i)
        if not path.exists():
            i, path = 0, directory / _process_file(0)  # saved by fewer processes: process 0's
        if not path.exists():
            legacy = [p.name for p in directory.iterdir() if p.name.endswith(".pkl")]
            if legacy:
                raise CheckpointFormatError(
                    f"checkpoint {Path(str(directory)).parent} keeps its drafter state as a "
                    f"pickle ({legacy[0]}), the format of older das-jax versions; a pickle can "
                    "run arbitrary code when loaded, so das-jax does not read it: start a new "
                    "run (--overwrite or another output_dir)")
            raise FileNotFoundError(f"{path} not found")
        try:
            head = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(head, dict) or head.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path} is not a das-jax rollout state file")
        version = head.get("version")
        if not isinstance(version, int) or not 1 <= version <= STATE_VERSION:
            raise CheckpointFormatError(
                f"{path} has rollout-state schema version {version!r}; this das-jax reads "
                f"versions 1-{STATE_VERSION} (upgrade das-jax to resume this run)")
        npz = directory / _process_file(i, ".npz")
        try:
            with np.load(io.BytesIO(npz.read_bytes()), allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files}
            if len(arrays) != head.get("num_arrays"):
                raise ValueError(f"{len(arrays)} arrays, the JSON names {head.get('num_arrays')}")
            return decode_state(head.get("state"), arrays)
        except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
            raise CheckpointError(f"{npz} does not match {path.name} or is unreadable: "
                                  f"{type(e).__name__}: {e}") from None

    def metadata(self, directory: epath.Path):
        return None


@ocp.args.register_with_handler(StateCheckpointHandler, for_save=True)
@dataclasses.dataclass
class StateSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(StateCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class StateRestore(ocp.args.CheckpointArgs):
    pass
