"""A GRPO trainer's checkpoints: what `GRPOTrainer.save` writes and `GRPOTrainer.restore` reads
back (params, optimizer state, step, and each process's drafter / DAS policy state) through a
`CheckpointManager`, with one-line errors for a full disk, a missing, corrupt or mismatching
checkpoint."""
from __future__ import annotations

import logging

from das_jax.config import config_to_dict
from das_jax.draft_head.store import save_head
from das_jax.errors import is_disk_full
from das_jax.malloc import release_free_memory
from das_jax.parallel import distributed as dist
from das_jax.rl.checkpoint import (CheckpointError, CheckpointFormatError, CheckpointManager,
                                   CheckpointMismatchError)
from das_jax.rl.run_dir import set_aside_checkpoints
from das_jax.rl.train_error import TrainError

log = logging.getLogger("das_jax.train")

ROLLOUT_STATE_KEY = "rollout_state"
SPLIT_STATE_KEY = "rollout_split"     # the process split of groups (several processes only)
ASYNC_STATE_KEY = "async_rollouts"    # batches generated ahead (train.async_steps > 0 only)
DRAFT_HEAD_STATE_KEY = "draft_head"    # the head trained online (train.draft_loss_weight > 0)
DRAFT_HEAD_FILE = "draft_head.safetensors"   # ... and its current weights, for draft_head.path


def trainer_meta(trainer) -> dict:
    """What a checkpoint stores beside the arrays: step, seed, DAS policy state, the config."""
    return {"step": trainer.step, "seed": trainer.config.train.seed,
            "policy_state": trainer.rollouts.state_dict()["policy"],
            "config": config_to_dict(trainer.config)}


def save_trainer(trainer, manager: CheckpointManager) -> None:
    """Checkpoints `trainer` (a `GRPOTrainer`) at its current step.

    Raises:
      TrainError: the disk is full (names the checkpoint directory and how to go on).
    """
    ahead = getattr(trainer, "async_rollouts", None)
    if ahead is not None:
        ahead.drain()   # the batches generated ahead are saved with their versions
    try:
        state = {ROLLOUT_STATE_KEY: trainer.rollouts.state_dict()}
        if getattr(trainer, "split", None) is not None:
            state[SPLIT_STATE_KEY] = trainer.split.state_dict()
        if ahead is not None:
            state[ASYNC_STATE_KEY] = ahead.state_dict()
        online = getattr(trainer, "draft_trainer", None)
        if online is not None:
            state[DRAFT_HEAD_STATE_KEY] = online.state_dict()
        manager.save(trainer.step, trainer.params, trainer.opt_state, trainer_meta(trainer),
                     state)
        if online is not None and dist.is_primary():
            save_head(str(trainer.run_dir / DRAFT_HEAD_FILE),
                      online.draft_head({"online_run": str(trainer.run_dir),
                                         "online_step": trainer.step}))
        release_free_memory()  # tensorstore's write buffers
    except Exception as e:  # noqa: BLE001 - orbax / tensorstore wrap OSErrors in many types
        if not is_disk_full(e):
            raise
        previous = [s for s in manager.all_steps() if s < trainer.step]
        then = (f"pass --resume {trainer.run_dir} to continue from step {previous[-1]}"
                if previous else "start it again with --overwrite (it has no earlier "
                                 "checkpoint)")
        raise TrainError(f"disk full while checkpointing step {trainer.step} to "
                         f"{manager.step_dir(trainer.step)}; free space on that disk (or move "
                         f"the run to another one), then {then}") from None


def restore_trainer(trainer, manager: CheckpointManager, max_step: int | None = None) -> int:
    """Restores into `trainer` (a `GRPOTrainer`) the newest readable checkpoint (at or below
    `max_step` when given); returns its step. A corrupt or unreadable newer checkpoint is skipped with a one-line warning
    naming it.

    Raises:
      TrainError: no checkpoint, none readable, one written for another model/optimizer, or
        one in a format this version does not read (an older version's pickle).
    """
    steps = [s for s in manager.all_steps() if max_step is None or s <= max_step]
    where = manager.step_dir(0).parent
    if not steps:
        raise TrainError(f"no checkpoint to resume from under {where}; start a new run "
                         "without --resume (with --overwrite to replace this one, or "
                         "another output_dir)")
    unreadable: list[tuple[int, str]] = []
    for step in reversed(steps):
        try:
            params, opt_state, meta, drafter_state = manager.restore(
                step, params_like=trainer.params, opt_state_like=trainer.opt_state)
            break
        except CheckpointMismatchError as e:
            raise TrainError(f"{e}; resume with the run's own model.source / model and grpo "
                             "settings, or start a new run in another output_dir") from None
        except CheckpointFormatError as e:
            raise TrainError(str(e)) from None
        except CheckpointError as e:
            reason = (getattr(e, "reason", None) or
                      (str(e).splitlines()[0] if str(e) else type(e).__name__))
            unreadable.append((step, reason if len(reason) <= 240 else reason[:237] + "..."))
    else:
        raise TrainError(f"no readable checkpoint under {where}: all of steps "
                         f"{', '.join(str(s) for s, _ in unreadable)} are corrupt (newest: "
                         f"{unreadable[0][1]}); start a new run (--overwrite or another "
                         "output_dir)")
    if unreadable:
        moved = set_aside_checkpoints(trainer.run_dir, [s for s, _ in unreadable])
        log.warning("checkpoint step %s is unreadable (%s); resuming from step %d, the newest "
                    "readable checkpoint (the unreadable one moved to %s)",
                    ", ".join(str(s) for s, _ in unreadable), unreadable[0][1], step, moved)
    try:
        if isinstance(drafter_state, dict) and ROLLOUT_STATE_KEY in drafter_state:
            # this process's drafter and DAS policy state
            trainer.rollouts.load_state_dict(drafter_state[ROLLOUT_STATE_KEY])
            if getattr(trainer, "split", None) is not None and SPLIT_STATE_KEY in drafter_state:
                trainer.split.load_state_dict(drafter_state[SPLIT_STATE_KEY])
        else:  # a checkpoint written before per-process rollout state
            trainer.rollouts.load_state_dict({"drafter": drafter_state,
                                           "policy": meta.get("policy_state")})
    except (ValueError, KeyError, TypeError, IndexError) as e:
        saved = (meta.get("config") or {}) if isinstance(meta.get("config"), dict) else {}
        was = (f" (the run was trained with drafter={saved['drafter']})"
               if saved.get("drafter") not in (None, trainer.config.drafter) else "")
        raise TrainError(
            f"checkpoint {manager.step_dir(step)}: its drafter / DAS policy state does not "
            f"fit drafter={trainer.config.drafter} and this run's das settings{was}: "
            f"{type(e).__name__}: {e}; resume with the run's own drafter and das settings "
            "(drop those --set overrides), or start a new run in another output_dir"
            ) from None
    online = getattr(trainer, "draft_trainer", None)
    saved_head = (drafter_state.get(DRAFT_HEAD_STATE_KEY) if isinstance(drafter_state, dict)
                  else None)
    if online is not None and saved_head is not None:
        try:
            online.load_state_dict(saved_head)
        except (ValueError, KeyError, TypeError) as e:
            raise TrainError(
                f"checkpoint {manager.step_dir(step)}: its online draft head does not fit "
                f"draft_head.path={trainer.config.draft_head.path} ({e}); resume with the run's "
                "own draft_head.path, or start a new run in another output_dir") from None
        trainer.rollouts.set_draft_head_params(online.params)
    elif online is not None:
        log.warning("checkpoint step %d holds no online draft head (the run trained none): the "
                    "head starts from draft_head.path", step)
    trainer.params, trainer.opt_state, trainer.step = params, opt_state, int(meta["step"])
    ahead = getattr(trainer, "async_rollouts", None)
    if ahead is not None:   # the batches generated ahead, saved with their versions
        saved = drafter_state.get(ASYNC_STATE_KEY) if isinstance(drafter_state, dict) else None
        try:
            ahead.load_state_dict(saved or {})
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise TrainError(
                f"checkpoint {manager.step_dir(step)}: its rollouts generated ahead do not fit "
                f"this run ({type(e).__name__}: {e}); resume with the run's own grpo and data "
                "settings, or start a new run in another output_dir") from None
    return trainer.step
