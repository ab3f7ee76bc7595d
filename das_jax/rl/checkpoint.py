"""Training checkpoints with orbax: params, optimizer state, step, RNG, data position, drafter state.

Layout (one orbax step directory per saved step, under `<run_dir>/checkpoints/`):

    <step>/state/     params + optimizer state (orbax `StandardSave`, OCDBT/Tensorstore arrays)
    <step>/meta/      JSON: the caller's meta dict (data position, seeds, ...) + step + RNG key
    <step>/drafter/   the rollout state (drafter + DAS policy) as data, never code:
                      `drafter_state.json` (schema name and version, the state tree) and
                      `drafter_state.npz` (its arrays, read with allow_pickle=False) from
                      process 0, `drafter_state.p<i>.json/.npz` from process i > 0 of a
                      multi-process run (each restores its own, else process 0's)

The rollout state is a tree of dicts, lists, tuples, str / int / float / bool / None and numpy
arrays (what the drafters' and policies' `state_dict()` return); `encode_state` /
`decode_state` (`das_jax.rl.rollout_state_file`, re-exported here) map it to JSON + arrays and
back exactly. Checkpoints of older das-jax versions
kept it as a pickle (`drafter_state.pkl`), which runs code when loaded: those are refused with
`CheckpointFormatError`, never unpickled.

Multi-process runs (`jax.distributed`): every process calls save / restore with the same step;
orbax writes each process's shards of the sharded params and optimizer state and process 0 the
metadata and meta JSON (the checkpoint directory must be on a filesystem every process sees).

Atomicity: orbax writes every item of a step into a temporary directory and renames it to
`<step>` only after all items are committed (`commit_success.txt`), so a run killed mid-save
leaves no half-written `<step>`; the previous checkpoint stays the latest, and leftover
temporary directories are removed when the next `CheckpointManager` opens the run.
`max_to_keep` old steps are kept (older ones deleted after a successful save).

Integrity: after a save is committed, process 0 writes `<step>/checksums.json` (every file's
size and CRC-32, `das_jax.rl.checkpoint_checksums`), and every restore checks the files against
it first: bytes changed on disk raise `CheckpointError` naming the file, instead of restoring
wrong weights (orbax keeps no checksum of the array data).

Restoring into `params_like` / `opt_state_like` checks the saved tree against them first and
raises `CheckpointError` naming the checkpoint directory and the first mismatching keys (missing,
unexpected, or a different shape), instead of orbax's lower-level errors.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from das_jax.rl import checkpoint_checksums as checksums
from das_jax.rl.checkpoint_errors import (CheckpointError,  # noqa: F401 - re-exported
                                          CheckpointFormatError, CheckpointMismatchError)
from das_jax.rl.rollout_state_file import (DRAFTER_FILE,  # noqa: F401 - re-exported
                                           LEGACY_PICKLE_FILE, STATE_FORMAT, STATE_VERSION,
                                           StateCheckpointHandler, StateRestore, StateSave,
                                           decode_state, encode_state)

_RNG_META_KEY = "_rng_key"


# ----- tree comparison ------------------------------------------------------------------------------

def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _flat_shapes(tree, is_leaf=None) -> dict[str, tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {"/".join(_key_str(k) for k in path): tuple(np.shape(leaf)) if not hasattr(leaf, "shape")
            else tuple(leaf.shape) for path, leaf in flat}


def _is_array_metadata(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (jax.Array, np.ndarray))


def _compare_trees(saved_meta_tree, target, ckpt_dir: Path) -> None:
    saved = _flat_shapes(saved_meta_tree, is_leaf=_is_array_metadata)
    want = _flat_shapes(target)
    order = lambda k: (not k.startswith("params/"), k)  # noqa: E731 - params first
    missing = sorted(set(want) - set(saved), key=order)
    extra = sorted(set(saved) - set(want), key=order)
    shape = sorted((k for k in set(want) & set(saved) if want[k] != saved[k]), key=order)
    if not (missing or extra or shape):
        return
    parts = []
    if shape:
        parts += [f"shape mismatch at {k!r}: checkpoint {saved[k]}, expected {want[k]}"
                  for k in shape[:3]]
    if missing:
        parts.append(f"missing in checkpoint: {', '.join(repr(k) for k in missing[:3])}"
                     + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""))
    if extra:
        parts.append(f"unexpected in checkpoint: {', '.join(repr(k) for k in extra[:3])}"
                     + (f" (+{len(extra) - 3} more)" if len(extra) > 3 else ""))
    raise CheckpointMismatchError(
        f"checkpoint {ckpt_dir} does not match the model/optimizer being restored: it was "
        f"written for a different model config, optimizer or dtype layout ({'; '.join(parts)})")


def _rng_to_json(key) -> dict:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return {"typed": True, "impl": str(jax.random.key_impl(key)),
                "data": np.asarray(jax.random.key_data(key)).tolist()}
    return {"typed": False, "dtype": str(key.dtype), "data": np.asarray(key).tolist()}


def _rng_from_json(d: dict):
    if d["typed"]:
        return jax.random.wrap_key_data(jnp.asarray(d["data"], jnp.uint32), impl=d["impl"])
    return jnp.asarray(d["data"], d["dtype"])


# ----- manager ------------------------------------------------------------------------------------

def largest_array_bytes(*trees) -> int:
    """Bytes of the largest array leaf of `trees` (0 when there is none)."""
    return max((int(x.nbytes) for x in jax.tree_util.tree_leaves(trees) if hasattr(x, "nbytes")),
               default=0)


def _is_closed_loop_noise(exc: BaseException | None) -> bool:
    """True for the `RuntimeError('Event loop is closed')` that orbax's asyncio writers raise
    from tensorstore callbacks after a save was aborted (e.g. by a full disk): the save has
    already failed with its own error, so these are echoes of it."""
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


_NOISE_FILTERS: set = set()  # the hooks `_filter_aborted_save_noise` installed


def _filter_aborted_save_noise() -> None:
    """Process-wide: drop the closed-event-loop echoes of an aborted save (`sys.excepthook`,
    which tensorstore's callbacks print through, and `sys.unraisablehook`, which reports the
    writers' coroutines when they are collected); every other error goes to the previous hook.
    Installed once, by the first `CheckpointManager`."""
    if sys.excepthook in _NOISE_FILTERS:
        return
    log = logging.getLogger(__name__)
    prev_except, prev_unraisable = sys.excepthook, sys.unraisablehook

    def excepthook(typ, value, tb):
        if _is_closed_loop_noise(value):
            log.debug("ignored after an aborted checkpoint save: %r", value)
            return
        prev_except(typ, value, tb)

    def unraisablehook(unraisable):
        if _is_closed_loop_noise(unraisable.exc_value):
            log.debug("ignored after an aborted checkpoint save: %r in %r",
                      unraisable.exc_value, unraisable.object)
            return
        prev_unraisable(unraisable)

    _NOISE_FILTERS.update((excepthook, unraisablehook))
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


class CheckpointManager:
    """Saves and restores GRPO training state under `<run_dir>/checkpoints`.

    Args:
      run_dir: the run's output directory (created if needed).
      max_to_keep: number of most recent checkpoints kept on disk.
      subdir: checkpoint folder inside run_dir.
      save_concurrent_bytes: at most this many bytes of arrays are being written at once (at
        least the largest array's size; `largest_array_bytes`); None: orbax's default (96 GB).
      read_only: only read (export, inspection): creates no directory, deletes nothing, and
        leaves the temporary directory of a save in progress (a run still training) alone.
    """

    def __init__(self, run_dir: str | Path, *, max_to_keep: int = 3, subdir: str = "checkpoints",
                 save_concurrent_bytes: int | None = None, read_only: bool = False):
        self.directory = Path(run_dir).absolute() / subdir
        self.max_to_keep = max_to_keep
        _filter_aborted_save_noise()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep, enable_async_checkpointing=False,
            create=not read_only, cleanup_tmp_directories=not read_only, read_only=read_only,
            **({"save_interval_steps": 0} if read_only else {}))
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        # By default tensorstore holds every array's encoded bytes at once while writing (+1.5 GB
        # of RSS for the main job's 1.6 GB of params and moments); `save_concurrent_bytes` bounds
        # that (orbax's save_concurrent_gb; it must be at least the largest array).
        state_handler = ocp.StandardCheckpointHandler(
            **({} if save_concurrent_bytes is None else
               {"save_concurrent_gb": (math.ceil(save_concurrent_bytes / 1e6) + 1) / 1e3}))
        registry.add("state", ocp.args.StandardSave, state_handler)
        registry.add("state", ocp.args.StandardRestore, state_handler)
        registry.add("meta", ocp.args.JsonSave)
        registry.add("meta", ocp.args.JsonRestore)
        registry.add("drafter", StateSave, StateCheckpointHandler)
        registry.add("drafter", StateRestore, StateCheckpointHandler)
        # read_only: orbax warns that the directory is read only, as asked: keep that quiet
        with _quiet_absl_errors() if read_only else contextlib.nullcontext():
            self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                               handler_registry=registry)

    # -- queries
    def all_steps(self) -> list[int]:
        """Committed steps on disk, ascending (re-reads the directory)."""
        self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    # -- save / restore
    def save(self, step: int, params, opt_state, meta: dict | None = None,
             drafter_state: dict | None = None, *, rng_key=None) -> Path:
        """Writes one checkpoint atomically (blocks until committed); returns its directory.

        Args:
          step: the training step (number of optimizer updates applied to `params`).
          params, opt_state: pytrees of arrays.
          meta: small JSON-serialisable dict (data position, seeds, metrics, ...).
          drafter_state: the rollout state (dicts, lists, tuples, scalars, numpy arrays; see
            `encode_state`) or None.
          rng_key: optional JAX PRNG key (typed or raw uint32) restored into `meta["rng_key"]`.
        """
        step = int(step)
        if step in self.all_steps():
            raise CheckpointError(f"checkpoint for step {step} already exists at "
                                  f"{self.step_dir(step)}; refusing to overwrite it")
        meta = dict(meta or {})
        meta["step"] = step
        if rng_key is not None:
            meta[_RNG_META_KEY] = _rng_to_json(rng_key)
        try:
            json.dumps(meta)
        except TypeError as e:
            raise CheckpointError(f"checkpoint meta must be JSON-serialisable: {e}") from None
        encode_state(drafter_state)  # a state that is not plain data fails here, in one line
        # A failed save raises; orbax also logs each failing write at ERROR level (over 100 lines
        # for a full disk), which would bury the one-line error: keep those logs quiet.
        with _quiet_absl_errors():
            self._mngr.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                meta=ocp.args.JsonSave(meta),
                drafter=StateSave(drafter_state),
            ))
            self._mngr.wait_until_finished()
        if jax.process_index() == 0:     # committed: every process's files are in place
            checksums.write(self.step_dir(step))
        return self.step_dir(step)

    def _resolve_step(self, step: int | None, steps: list[int]) -> int:
        """`step`, or the newest of `steps` when None.

        Raises:
          CheckpointError: no checkpoint, or `step` is not one of `steps` (naming them).
        """
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoint found in {self.directory}")
            return steps[-1]
        step = int(step)
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} "
                                  f"(available steps: {steps or 'none'})")
        return step

    def restore(self, step: int | None = None, params_like=None, opt_state_like=None
                ) -> tuple[Any, Any, dict, dict | None]:
        """Restores (params, opt_state, meta, drafter_state) of `step` (default: the latest).

        `params_like` / `opt_state_like` give the target trees (arrays or `jax.ShapeDtypeStruct`;
        restored arrays take their dtypes). They are checked against the checkpoint first: a
        different tree or shape raises `CheckpointError` naming the directory and the keys. When
        omitted, the saved trees come back as nested dicts/lists of numpy arrays.

        Raises:
          CheckpointError: no checkpoint / unknown step / unreadable or corrupt step directory /
            mismatching trees.
        """
        steps = self.all_steps()
        step = self._resolve_step(step, steps)
        ckpt_dir = self.step_dir(step)
        checksums.verify(ckpt_dir)
        try:
            with _quiet_absl_errors():
                item_meta = self._mngr.item_metadata(step)
            state_meta = item_meta["state"]
            saved_tree = state_meta.tree if hasattr(state_meta, "tree") else state_meta
        except Exception as e:  # noqa: BLE001 - orbax raises many types on a damaged directory
            raise unreadable(ckpt_dir, e) from e
        if saved_tree is None:
            raise unreadable(ckpt_dir, None)
        target = None
        if params_like is not None or opt_state_like is not None:
            target = {"params": params_like if params_like is not None else saved_tree["params"],
                      "opt_state": (opt_state_like if opt_state_like is not None
                                    else saved_tree["opt_state"])}
            _compare_trees({"params": saved_tree.get("params"),
                            "opt_state": saved_tree.get("opt_state")},
                           _abstract(target), ckpt_dir)
        try:
            with _quiet_absl_errors():
                restored = self._mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_abstract(target) if target is not None
                                                   else None),
                    meta=ocp.args.JsonRestore(),
                    drafter=StateRestore(),
                ))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise unreadable(ckpt_dir, e) from e
        state, meta = restored["state"], dict(restored["meta"])
        if _RNG_META_KEY in meta:
            meta["rng_key"] = _rng_from_json(meta.pop(_RNG_META_KEY))
        state = jax.tree_util.tree_map(jnp.asarray, state)
        return state["params"], state["opt_state"], meta, restored["drafter"]

    def restore_params(self, step: int | None = None) -> tuple[Any, dict]:
        """Restores only the params and meta of `step` (default: the latest), as numpy arrays in
        their saved dtypes and tree (the optimizer state and rollout state are not read, so this
        needs the params' memory only, on the host; any device count).

        Raises:
          CheckpointError: no checkpoint / unknown step (naming the steps there) / unreadable or
            corrupt step directory.
        """
        steps = self.all_steps()
        step = self._resolve_step(step, steps)
        ckpt_dir = self.step_dir(step)
        checksums.verify(ckpt_dir)
        try:
            with _quiet_absl_errors():
                state_meta = self._mngr.item_metadata(step)["state"]
            saved_tree = state_meta.tree if hasattr(state_meta, "tree") else state_meta
            if saved_tree is None:
                raise unreadable(ckpt_dir, None)
            params_meta = saved_tree["params"]
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - orbax raises many types on a damaged directory
            raise unreadable(ckpt_dir, e) from e
        target = jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), params_meta,
            is_leaf=_is_array_metadata)
        restore_args = jax.tree_util.tree_map(
            lambda m: ocp.RestoreArgs(restore_type=np.ndarray, dtype=m.dtype), target)
        try:
            # the state item is a PyTree checkpoint: read its params subtree only
            with _quiet_absl_errors(), ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
                restored = reader.restore(ckpt_dir / "state", args=ocp.args.PyTreeRestore(
                    item={"params": target}, restore_args={"params": restore_args},
                    partial_restore=True))
            restored = {"params": restored["params"], "meta": self._mngr.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]}
        except Exception as e:  # noqa: BLE001
            raise unreadable(ckpt_dir, e) from e
        meta = dict(restored["meta"])
        if _RNG_META_KEY in meta:
            meta["rng_key"] = _rng_from_json(meta.pop(_RNG_META_KEY))
        return jax.tree_util.tree_map(np.asarray, restored["params"]), meta

    def close(self) -> None:
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def unreadable(ckpt_dir, error: BaseException | None) -> CheckpointError:
    """The one-line error of a checkpoint directory orbax cannot read: names it, gives the
    first line of the underlying error (cut to 160 characters: tensorstore's carry whole JSON
    specs) and the fix."""
    if error is None:
        why = "no state metadata"
    else:
        text = (str(error).strip().splitlines() or [""])[0]
        text = text if len(text) <= 160 else text[:157] + "..."
        why = f"{type(error).__name__}: {text}" if text else type(error).__name__
    error = CheckpointError(f"checkpoint {ckpt_dir} is corrupt or unreadable ({why}); its files "
                            "are damaged or incomplete: restore them from a copy, or remove "
                            "that step's directory to use an earlier checkpoint")
    error.reason = f"corrupt or unreadable ({why})"   # without the fix, for callers with their own
    return error


@contextlib.contextmanager
def _quiet_absl_errors():
    """Raises the `absl` logger (orbax's) to CRITICAL for the block."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _abstract(tree):
    """Array leaves -> ShapeDtypeStruct (keeps the tree structure; metadata leaves pass through)."""
    def f(x):
        if _is_array_metadata(x) and not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree_util.tree_map(f, tree, is_leaf=_is_array_metadata)
