"""Asynchronous GRPO: the rollouts of later steps are generated while the current step updates.

With `train.async_steps: k > 0` the trainer takes its batches from an `AsyncRollouts`, which
generates them on one worker thread, in step order (the rewards are computed on the main thread
when a batch is taken: reward functions may need it, e.g. math-verify's signal timeouts):

    step t:  schedule the rollout of step t + k from the params of version t (a snapshot)
             take the batch of step t (generated from version max(t - k, 0)), waiting if needed
             update: version t -> t + 1, while the worker generates steps t + 1 .. t + k

The policy *version* is the number of optimizer steps applied (`GRPOTrainer.step`). Which
version a step samples from is fixed by the schedule, not by timing: step s samples from
version max(s - k, 0), so an asynchronous run is as reproducible as a synchronous one and a
step's batch is never more than k versions old (the staleness bound; a batch older than that,
e.g. one restored by a run resumed with a smaller `async_steps`, is dropped, counted in
`dropped_groups`, and generated again from the current params).

Placement (`mesh.rollout_devices`): colocated (0) -- the worker thread and the update share the
devices. With `train.async_overlap: true` (the default) their programs run at once, as they are
dispatched: on a GPU they queue on the device and each side's host work (the rollout's
scheduler, drafter and DAS policy; the update's batch building) runs while the other's programs
run; on CPU devices both sides' XLA programs share the cores, which neither keeps busy alone
(the main job's steps on 2 cores: docs/results/async-grpo.md). With `async_overlap: false` a
whole rollout and a whole update never run at once (`device_lock`): the schedule and the
versions are the same, and what overlaps is the rest (rewards, logging, checkpoints and
evaluations wait less). Disaggregated (> 0) -- the rollout engine has devices of its own, the
train mesh the others, and the params reach the engine device to device
(`Engine.place_params`).
A rollout never crosses an update: each one samples from its own snapshot of the params (a copy
when the compute dtype is the master dtype, which the update donates), and its KV cache lives
for that rollout only. The drafter's history holds token ids only (independent of the weights;
drafts never change a sampled token) and is fed by the worker in step order, exactly as the
synchronous loop feeds it; it advances one epoch before the first rollout of each pass over
the data.

Off-policy correction: the importance ratio's old policy is the pre-update params (version t)
and each token's loss is weighted by min(pi_t(y) / pi_behaviour(y),
`grpo.importance_sampling_cap`) from the rollout's own log-probs (truncated importance
sampling, Yao et al. 2025). With `grpo.old_logprobs: recompute` the trainer recomputes pi_t
with a forward pass (`GRPOTrainer.build_batch`, `truncated_importance_weights`); with
`old_logprobs: rollout` and one iteration the train step takes pi_t from its own forward pass
(the decoupled objective, `das_jax.rl.losses.policy_terms`; `decoupled_is_cap`): the same loss
and gradient without the extra pass. With `rollout` and several iterations the ratio is taken
against the behaviour policy itself (PPO's clip bounds it) and the weight is 1.

Checkpoints drain the worker first (`drain`): the saved state holds the finished batches of
the steps after the checkpoint with their versions (`state_dict`), so a resumed run takes
them instead of generating them again and loses or repeats no step.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.engine import GenerateStats, Request, RequestOutput
from das_jax.rl.rollout_batch import RolloutBatch

__all__ = ["VersionedBatch", "AsyncRollouts", "RolloutCancelled", "IS_METRICS", "decoupled_is_cap",
           "truncated_importance_weights"]


class RolloutCancelled(Exception):
    """Raised inside a rollout on the worker when `AsyncRollouts.close(cancel=True)` stops it."""


@dataclasses.dataclass
class VersionedBatch:
    """One step's rollouts with the policy version that sampled them.

    step: the (0-based) train step the batch is for; version: the optimizer steps applied to the
    params it sampled from; rollout_s: wall seconds of its generation (on the worker) and its
    rewards (on the main thread); generated: the worker's (rows, outputs, stats) until the
    rewards are computed; batch: the scored `RolloutBatch` after that; reward_events: what the
    reward functions logged for it (`events.take()`, one per function).
    """

    step: int
    version: int
    generated: tuple | None
    rollout_s: float
    batch: RolloutBatch | None = None
    reward_events: list = dataclasses.field(default_factory=list)


class AsyncRollouts:
    """The rollouts of a `GRPOTrainer` run `async_steps` steps ahead (module docstring).

    Args:
      trainer: the `GRPOTrainer` (its `generate(step, params)`, `score`, `take_reward_events`,
        `rollout_params()`, `step`, `steps_per_epoch()`, `rollouts.advance_epoch()` are used).
      async_steps: k >= 1, the steps generated ahead (the staleness bound).
      total_steps: `train.steps` (nothing is generated for a step at or past it).
      serialize: a rollout and the update never run at once: the worker holds `device_lock`
        for each rollout, the trainer for each update (colocated with `train.async_overlap:
        false`; module docstring). False: `device_lock` is a no-op.

    Raises:
      ValueError: async_steps < 1.
    """

    def __init__(self, trainer, async_steps: int, total_steps: int, serialize: bool = False):
        if async_steps < 1:
            raise ValueError(f"async_steps must be >= 1, got {async_steps}")
        self.device_lock = threading.Lock() if serialize else contextlib.nullcontext()
        self.trainer, self.k, self.total_steps = trainer, int(async_steps), int(total_steps)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ready: dict[int, VersionedBatch] = {}
        # drafter epochs advanced so far (the synchronous loop's count at the trainer's step)
        self._drafter_epochs = trainer.step // trainer.steps_per_epoch()
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self.dropped_groups = 0

    # ------------------------------------------------------------------ scheduling
    def _snapshot(self):
        """The params of the current version, for a rollout: never the arrays the update
        donates."""
        t = self.trainer
        params = t.rollout_params()
        masters = {id(x) for x in jax.tree_util.tree_leaves(t.params)}
        if any(id(x) in masters for x in jax.tree_util.tree_leaves(params)):
            params = jax.tree_util.tree_map(jnp.copy, params)
        return jax.block_until_ready(params)

    def schedule(self) -> None:
        """Schedules, from the current params (version `trainer.step`), every step in
        [trainer.step, trainer.step + k] below `total_steps` that is neither generated nor on
        its way (the next ahead step, and the current one at the start or after a drop)."""
        step = self.trainer.step
        todo = [s for s in range(step, min(step + self.k, self.total_steps - 1) + 1)
                if s not in self._pending and s not in self._ready]
        if not todo:
            return
        params = self._snapshot()
        if self._executor is None:
            self._cancel.clear()
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="das-jax-rollout")
        for s in todo:
            self._pending[s] = self._executor.submit(self._generate, s, step, params)

    def _generate(self, step: int, version: int, params) -> VersionedBatch:
        t = self.trainer
        with self._lock:   # the drafter's epoch, in step order
            while self._drafter_epochs < step // t.steps_per_epoch():
                t.rollouts.advance_epoch()
                self._drafter_epochs += 1
        t0 = time.perf_counter()
        with self.device_lock:
            generated = t.generate(step, params=params, progress=self._check_cancel,
                                   version=version)
        del params
        return VersionedBatch(step, version, generated, time.perf_counter() - t0)

    def _check_cancel(self, finished: int, total: int) -> None:
        """The engine's progress callback (each finished request): stops a cancelled rollout."""
        if self._cancel.is_set():
            raise RolloutCancelled(f"rollout stopped after {finished} of {total} requests")

    def _scored(self, vb: VersionedBatch) -> VersionedBatch:
        """`vb` with its rewards, computed on the calling (main) thread: reward functions may
        need it (math-verify's timeouts are signals, which only the main thread receives)."""
        if vb.batch is None:
            t0 = time.perf_counter()
            vb.batch = self.trainer.score(*vb.generated)
            vb.generated = None
            vb.reward_events = self.trainer.take_reward_events()
            vb.rollout_s += time.perf_counter() - t0
        return vb

    # ------------------------------------------------------------------ taking batches
    def take(self, step: int) -> tuple[VersionedBatch, float]:
        """(the batch of `step`, seconds waited for it). A batch more than k versions older
        than the current params is dropped (counted in `dropped_groups`) and generated again
        from them. The worker's exception, if its rollout raised, is raised here."""
        self.schedule()
        t0 = time.perf_counter()
        vb = self._result(step)
        if self.trainer.step - vb.version > self.k:
            self.dropped_groups += len(vb.batch.outputs) // max(
                self.trainer.config.grpo.num_generations, 1)
            self.schedule()
            vb = self._result(step)
        return vb, time.perf_counter() - t0

    def _result(self, step: int) -> VersionedBatch:
        if step in self._ready:
            return self._scored(self._ready.pop(step))
        return self._scored(self._pending.pop(step).result())

    def drain(self) -> None:
        """Waits for every scheduled rollout and scores it (before a checkpoint, an evaluation,
        or the end of the run): afterwards the worker is idle and the drafter and policy can be
        read."""
        for s in sorted(self._pending):
            self._ready[s] = self._scored(self._pending.pop(s).result())

    def close(self, cancel: bool = False) -> None:
        """Cancels the rollouts not started, waits for the running one, stops the worker (a
        later `schedule` starts a new one). `cancel`: the running rollout stops at its next
        finished request (the run is ending on an error or an interrupt: nothing of it is
        kept)."""
        if cancel:
            self._cancel.set()
        for f in self._pending.values():
            f.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._pending.clear()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The finished batches of the steps ahead (after `drain`) and the drafter's epoch
        count: plain data (lists, dicts, scalars, numpy arrays).

        Raises:
          RuntimeError: rollouts are still running (call `drain` first).
        """
        if self._pending:
            raise RuntimeError("AsyncRollouts.state_dict needs drain() first")
        return {"drafter_epochs": self._drafter_epochs,
                "dropped_groups": self.dropped_groups,
                "batches": [_batch_state(vb) for _, vb in sorted(self._ready.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`'s batches (those of steps at or past the trainer's step) and
        counters ({} for a checkpoint of a synchronous run); the rows' problems are the
        trainer's data order for each step.

        Raises:
          ValueError: a saved batch's row count differs from this run's steps.
          RuntimeError: rollouts are running."""
        if self._pending:
            raise RuntimeError("AsyncRollouts.load_state_dict needs an idle worker")
        self._ready.clear()
        # a checkpoint of a synchronous run: its loop advanced the drafter at each epoch's end
        self._drafter_epochs = int(state.get(
            "drafter_epochs", self.trainer.step // self.trainer.steps_per_epoch()))
        self.dropped_groups = int(state.get("dropped_groups", 0))
        for b in state.get("batches", []):
            vb = _batch_from_state(self.trainer, b)
            if vb.step >= self.trainer.step:
                self._ready[vb.step] = vb


def _batch_state(vb: VersionedBatch) -> dict[str, Any]:
    rb = vb.batch
    return {
        "step": vb.step, "version": vb.version, "rollout_s": vb.rollout_s,
        "reward_events": vb.reward_events,
        "token_ids": [list(map(int, o.token_ids)) for o in rb.outputs],
        "logprobs": [np.asarray(o.logprobs, np.float32) for o in rb.outputs],
        "finish_reasons": [o.finish_reason for o in rb.outputs],
        "completions": list(rb.completions),
        "rewards": np.asarray(rb.rewards, np.float32),
        "reward_parts": {k: [float(x) for x in v] for k, v in rb.reward_parts.items()},
        "stats": (rb.stats.to_dict() if isinstance(rb.stats, GenerateStats) else None),
    }


def _batch_from_state(trainer, b: dict[str, Any]) -> VersionedBatch:
    step = int(b["step"])
    G = trainer.config.grpo.num_generations
    rows = [p for p in trainer.problems_for_step(step) for _ in range(G)]
    if len(rows) != len(b["token_ids"]):
        raise ValueError(f"a saved rollout of step {step} has {len(b['token_ids'])} rows, "
                         f"this run's steps have {len(rows)}")
    outputs = []
    for g, (p, toks, lps, fr) in enumerate(zip(rows, b["token_ids"], b["logprobs"],
                                               b["finish_reasons"])):
        req = Request(tuple(trainer.prompt_ids[p.problem_id]), problem_id=p.problem_id,
                      sample_index=g % G)
        outputs.append(RequestOutput(req, [int(x) for x in toks],
                                     [float(x) for x in np.asarray(lps, np.float32)], str(fr)))
    stats = GenerateStats(**{k: v for k, v in (b.get("stats") or {}).items()
                             if k in {f.name for f in dataclasses.fields(GenerateStats)}
                             and k != "steps"})
    rb = RolloutBatch(rows, [list(o.request.prompt_ids) for o in outputs], outputs,
                      list(b["completions"]), np.asarray(b["rewards"], np.float32),
                      {k: list(v) for k, v in b["reward_parts"].items()}, stats)
    return VersionedBatch(step, int(b["version"]), None, float(b["rollout_s"]), rb,
                          list(b.get("reward_events") or []))


# the off-policy correction's metrics in an asynchronous run's records
IS_METRICS = ("is_weight_mean", "is_weight_max", "is_truncated_fraction")


def decoupled_is_cap(config) -> float | None:
    """The train step's decoupled-objective cap for a run (`das_jax.rl.losses.policy_terms`):
    `grpo.importance_sampling_cap` in an asynchronous run (`train.async_steps > 0`) whose old
    log-probs are the rollout's (`grpo.old_logprobs: rollout`) with one update per batch
    (`grpo.num_iterations: 1`); None otherwise: a synchronous run samples from the params it
    trains, `recompute` weighs the batch in `GRPOTrainer.build_batch`
    (`truncated_importance_weights`), and several iterations take the behaviour policy as PPO's
    old policy."""
    if (config.train.async_steps > 0 and config.grpo.old_logprobs == "rollout"
            and config.grpo.num_iterations == 1):
        return float(config.grpo.importance_sampling_cap)
    return None


def truncated_importance_weights(old_BxT: np.ndarray, behaviour_BxT: np.ndarray,
                                 cmask_BxT: np.ndarray, cap: float):
    """(float32 `[N, T]` weights, metrics): min(exp(old - behaviour), cap) on the completion
    tokens (`cmask_BxT`), 0 elsewhere -- truncated importance sampling (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"): the rollout sampled
    from an older policy (behaviour log-probs, float32 `[N, T]`) than the pre-update params the
    ratio starts from (old). metrics: is_weight_mean (of the truncated weights), is_weight_max
    (before truncation), is_truncated_fraction."""
    cap = float(cap)
    raw = np.exp(np.where(cmask_BxT, old_BxT - behaviour_BxT, 0.0)).astype(np.float32)
    w = np.where(cmask_BxT, np.minimum(raw, cap), 0.0).astype(np.float32)
    n = int(cmask_BxT.sum())
    metrics = dict(zip(IS_METRICS, (float(w[cmask_BxT].mean()) if n else 1.0,
                                    float(raw[cmask_BxT].max()) if n else 1.0,
                                    float((raw[cmask_BxT] > cap).mean()) if n else 0.0)))
    return w, metrics
