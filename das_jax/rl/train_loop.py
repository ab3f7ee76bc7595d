"""The GRPO run loop behind `GRPOTrainer.train`: the run directory's lock and checks, resume,
the step loop with its logging, checkpoints and evaluations, and a stop on a non-finite loss."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

from das_jax.config import Config, save_config
from das_jax.parallel import distributed as dist
from das_jax.rl import run_dir as rd
from das_jax.rl.checkpoint import CheckpointManager, largest_array_bytes
from das_jax.rl.evaluate import Evaluator, eval_due
from das_jax.rl.run_log import RunLogger
from das_jax.rl.train_error import TrainError

log = logging.getLogger("das_jax.train")


def run_training(trainer, resume: bool = False, progress: bool = True,
                 stop_after: int | None = None, overwrite: bool = False) -> list[dict]:
    """`GRPOTrainer.train` for `trainer`: runs until `train.steps` (or `stop_after` more steps)
    and returns this call's records; that method's docstring says what it checks and raises."""
    c = trainer.config
    primary = dist.is_primary()  # process 0 owns the run directory's files and logs
    with rd.lock_run_dir(trainer.run_dir) if primary else contextlib.nullcontext():
        if not resume and primary:
            rd.check_new_run(trainer.run_dir, overwrite=overwrite,
                             has_checkpoint=bool(rd.checkpoint_steps(trainer.run_dir)))
            if overwrite:
                rd.clear_run(trainer.run_dir)
        if primary:
            rd.write_manifest(trainer.run_dir)   # a resumed older run gets one too
        dist.sync("das_jax.train.run_dir_checked")
        # one array at a time in flight while saving (bounds tensorstore's buffers)
        manager = CheckpointManager(trainer.run_dir, max_to_keep=c.train.keep_checkpoints,
                                    save_concurrent_bytes=largest_array_bytes(
                                        trainer.params, trainer.opt_state))
        with _closing(manager):
            if resume:
                trainer.restore(manager)
                if trainer.step >= c.train.steps:
                    log.warning("%s", rd.complete_message(trainer.run_dir, trainer.step,
                                                          c.train.steps))
                    return []
            if primary:
                save_config(dataclasses.replace(c, distributed=dataclasses.replace(
                    c.distributed, process_id=None)), trainer.run_dir / "config.yaml")
                logger = RunLogger(trainer.run_dir, total_steps=c.train.steps,
                                   start_step=trainer.step, progress=progress,
                                   max_new_tokens=c.rollout.max_new_tokens,
                                   steps_per_epoch=trainer.steps_per_epoch())
            else:
                logger = _SilentLogger()
            records = []
            evaluator = Evaluator.for_trainer(trainer)
            with _closing(logger), _stopping_rollouts(trainer):
                if evaluator is not None and trainer.step == 0 < c.train.steps:
                    with logger.between_steps():
                        logger.log_eval(evaluator.run(trainer, 0))
                while trainer.step < c.train.steps:
                    if stop_after is not None and len(records) >= stop_after:
                        break
                    record = trainer.train_one_step()
                    _check_finite(record, c, manager)
                    records.append(record)
                    logger.log(record, samples=trainer.last_samples)
                    every = c.train.save_every
                    if every and (trainer.step % every == 0 or trainer.step == c.train.steps):
                        trainer.save(manager)
                    if trainer.step >= c.train.steps:
                        trainer.release_optimizer_state()
                    if evaluator is not None and eval_due(trainer.step, c.train.steps,
                                                          c.eval.every):
                        trainer.quiesce()   # the engine is idle during the evaluation
                        with logger.between_steps():
                            logger.log_eval(evaluator.run(trainer, trainer.step))
    # process 0 closes the logs (plots) last: the others wait, so that none reaches jax's
    # shutdown barrier long before it
    dist.sync("das_jax.train.done")
    return records


class _SilentLogger:
    """The run logger of processes other than 0: they log nothing."""

    def log(self, record, samples=None) -> None:
        pass

    def log_eval(self, record) -> None:
        pass

    @contextlib.contextmanager
    def between_steps(self):
        yield

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _stopping_rollouts(trainer):
    """Stops an asynchronous run's rollout worker when the loop ends; on an error or an
    interrupt (Ctrl-C) its running rollout is cancelled, not waited for."""
    close = getattr(trainer, "close", None)
    try:
        yield
    except BaseException:
        if close is not None:
            close(cancel=True)
        raise
    if close is not None:
        close()


@contextlib.contextmanager
def _closing(resource):
    """Closes `resource` after the block. When the block raised, a failure to close (e.g. the
    disk that is full also fails the final plot) is logged, not raised over the first error."""
    try:
        yield resource
    except BaseException:
        try:
            resource.close()
        except Exception as e:  # noqa: BLE001 - secondary; the block's error is the one to see
            log.debug("closing %s after an error also failed: %s", type(resource).__name__, e)
        raise
    resource.close()


def _check_finite(record: dict, c: Config, manager) -> None:
    """Raises TrainError when a step's loss, gradient norm or update norm is NaN/inf (before it
    is logged or saved): the model's logits or the update overflowed, and the parameters after
    a non-finite update are not saved. `manager` (the run's `CheckpointManager`) is read only
    then, for the last checkpoint's step."""
    for key in ("loss", "grad_norm", "update_norm", "reward_mean"):
        v = record.get(key)
        if isinstance(v, float) and not math.isfinite(v):
            last_checkpoint = manager.latest_step()
            since = (f"the last checkpoint is step {last_checkpoint}" if last_checkpoint
                     is not None else "no checkpoint was written")
            raise TrainError(
                f"step {record['step']}: {key} is {v}, so the model's logits or the update "
                f"overflowed (model.source={c.model.source!r}, model.dtype={c.model.dtype}); this "
                f"step was not logged or saved and {since}; check the model files, use "
                "model.dtype: float32 or a lower grpo.learning_rate")
