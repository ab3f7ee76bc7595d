"""The GRPO trainer loop: DAS rollouts, rewards, group advantages, the jitted train step.

One training step (Shao et al. 2024, GRPO; TRL's GRPOTrainer semantics):

1. Take `prompts_per_step` problems from the data order (a seeded shuffle per epoch).
2. Roll out `num_generations` completions per problem with the DAS engine from the *current*
   params; request seeds derive from (run seed, step, problem id, sample index) only, so a rollout
   is a pure function of the params and the step, with or without speculation.
3. Score them with the reward functions (a raising reward logs an error and scores 0).
4. Group-normalised advantages; `num_iterations` optimizer updates on the batch. The importance
   ratio's old log-probs are, by default, recomputed by the trainer from the pre-update params
   (`grpo.old_logprobs: recompute`, as verl does): a pure function of params and tokens, so a
   run with DAS reproduces a run without it bit for bit. `old_logprobs: rollout` uses the
   log-probs the engine returned instead; they differ from the trainer's at float-rounding level
   (a verify step of width W rounds differently from width 1), which the metric
   `rollout_logprob_gap` reports either way.
5. At the end of each pass over the data, the drafter's history advances one epoch.

With `eval.num_problems > 0`, a greedy evaluation on held-out problems runs at step 0, every
`eval.every` steps and at the end (`das_jax.rl.evaluate`; records with `"kind": "eval"`).

A run directory holds the resolved `config.yaml`, `metrics.jsonl`, the first completions of
each step in `samples.jsonl`, TensorBoard events under `tb/`, orbax checkpoints under
`checkpoints/`, and PNG plots under `plots/`.

The run loop lives in `das_jax.rl.train_loop`, saving and restoring a trainer's checkpoints in
`das_jax.rl.trainer_checkpoint`; `GRPOTrainer.train`, `.save` and `.restore` call them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.config import Config
from das_jax.data import Problem, problems_from_config, render_prompt, reward_kwargs
from das_jax.draft_head.online import OnlineConfig, OnlineHeadTrainer
from das_jax.engine import Request, RequestOutput, request_seed
from das_jax.malloc import release_free_memory, release_trace_caches
from das_jax.models.loading import load
from das_jax.models.transformer import ActivationConfig
from das_jax.models.tokenizer import encode_prompt
from das_jax.parallel import distributed as dist
from das_jax.parallel.rollout_split import GroupSplit
from das_jax.parallel.sharding import TrainShardings, place, replicated
from das_jax.rl.advantages import advantage_metrics
from das_jax.rl.async_rollouts import (IS_METRICS, AsyncRollouts, decoupled_is_cap,
                                      truncated_importance_weights)
from das_jax.rl.batches import make_batch
from das_jax.rl.checkpoint import CheckpointManager
from das_jax.rl.logprobs import cast_params, compute_logprobs
from das_jax.rl.optimizer import Optimizer
from das_jax.rl.rewards import combine_rewards, reward_fns_from_config, self_test_rewards
from das_jax.rl.rollout_batch import RolloutBatch
from das_jax.rl.run_checks import check_prompts_and_stop_ids, check_registered_names
from das_jax.rl.run_log import sample_rows
from das_jax.rl.split_rollout import split_rollout
from das_jax.rl.train_error import TrainError
from das_jax.rl.train_loop import run_training
from das_jax.rl.train_devices import split_devices, train_mesh
from das_jax.rl.train_step import TrainStep
from das_jax.rl.trainer_checkpoint import (ROLLOUT_STATE_KEY,  # noqa: F401 - re-exported
                                          restore_trainer, save_trainer)
from das_jax.rollout import rollout_from_config


def _token_bucket(n: int, multiple: int = 64) -> int:
    return int(math.ceil(n / multiple) * multiple)


class GRPOTrainer:
    """Runs GRPO with DAS rollouts for a `Config`.

    Args:
      config: the resolved run config.
      model: optional (model_config, params, tokenizer) to use instead of loading
        `config.model.source` (tests pass tiny random models). The trainer takes ownership of
        the params: when they are already in `train.master_dtype` they become the master copy,
        which the train step donates, so the caller must not use them afterwards.
      problems: optional problems instead of `config.data`.
      reward_fns: optional TRL-signature reward functions instead of `config.grpo.reward_funcs`.
    """

    def __init__(self, config: Config, *, model=None, problems: Sequence[Problem] | None = None,
                 reward_fns: Sequence[Callable] | None = None):
        self.config = config
        c = config
        self.advantage_fn, _ = check_registered_names(c)
        # Rewards first: a code reward whose sandbox cannot run here (or judges its self-test
        # wrongly) stops the run in one line before the model loads.
        if reward_fns is None:
            reward_fns = reward_fns_from_config(c.grpo.reward_funcs, c.rewards)
        self_test_rewards(reward_fns)
        self._reward_events = [fn.events for fn in reward_fns if hasattr(getattr(fn, "events", None), "take")]
        if model is None:
            model = load(c.model.source, dtype=getattr(jnp, c.train.master_dtype))
        self.model_config, params, self.tokenizer = model
        # Mixed precision: the trainer holds master params (and Adam moments) in
        # train.master_dtype; forward passes and the engine run in model.dtype.
        self.compute_dtype = c.model.dtype
        # Several devices or processes: the train state lives on the `mesh:` (FSDP by the rules
        # of das_jax.parallel.sharding); one device keeps the plain single-device path.
        dist.check_same_config(c)
        # mesh.rollout_devices > 0: the last devices only generate, the train mesh is over the
        # others (disaggregated); 0: both share every device
        train_devices, rollout_devices = split_devices(c)
        self.mesh = train_mesh(c, train_devices)
        self.params = cast_params(params, c.train.master_dtype)
        del params, model
        release_free_memory()  # the loader's freed host buffers (dequantised tensors)
        self.shardings = None
        if self.mesh is not None:
            self.shardings = TrainShardings(self.params, self.mesh)
            self.params = place(self.params, self.shardings.params)
        if problems is None:
            problems = problems_from_config(c.data)
        self.problems = list(problems)
        if not self.problems:
            raise TrainError("the dataset is empty; check data.kind / data.path / data.limit")
        self.prompt_ids = {}
        self.prompt_text = {}
        for p in self.problems:
            text = render_prompt(p, self.tokenizer if c.data.chat else None,
                                 instruction=c.data.instruction, chat=c.data.chat)
            self.prompt_text[p.problem_id] = text
            self.prompt_ids[p.problem_id] = encode_prompt(self.tokenizer, text, chat=c.data.chat)
        # The rollout boundary: engine, drafter, policy and cost model, all from the config. The
        # engine keeps no params of its own: every rollout passes the current ones, cast to the
        # compute dtype (`rollout_params`), so nothing stays alive across the update.
        placement = ({} if rollout_devices is None else
                     {"device": rollout_devices[0]} if len(rollout_devices) == 1 else
                     {"devices": rollout_devices})
        self.rollouts = rollout_from_config(c, self.model_config, None,
                                            self.tokenizer.eos_token_ids, **placement)
        # With several processes each generates its share of a step's groups
        # (`das_jax.parallel.rollout_split`); the gathered batch is the same on every process.
        self.split = (GroupSplit(dist.process_count()) if dist.process_count() > 1 else None)
        check_prompts_and_stop_ids(c, self.model_config, self.rollouts, self.prompt_ids)
        self.reward_fn = combine_rewards(reward_fns, c.grpo.reward_weights)
        self.optimizer = Optimizer(c.grpo, c.train.steps)
        if self.mesh is None:
            self.opt_state = self.optimizer.init(self.params)
        else:
            opt_sh = self.shardings.like(jax.eval_shape(self.optimizer.init, self.params))
            self.opt_state = jax.jit(self.optimizer.init, out_shardings=opt_sh)(self.params)
        self.activation = ActivationConfig(remat=c.train.remat, logits_chunk=c.train.logits_chunk,
                                           attention_chunk=c.train.attention_chunk)
        self.train_step = TrainStep(self.model_config, c.grpo, self.optimizer,
                                    temperature=c.rollout.temperature, donate=True,
                                    activation=self.activation, compute_dtype=self.compute_dtype,
                                    mesh=self.mesh,
                                    skip_zero_advantage=c.train.skip_zero_advantage,
                                    leafwise=True, fused=c.train.fused_update,
                                    decoupled_is_cap=decoupled_is_cap(c))
        # The reference policy: a copy in the compute dtype (the master params are donated),
        # sharded like the master params on a mesh.
        self.ref_params = None
        if c.grpo.beta > 0:
            self.ref_params = (jax.tree_util.tree_map(jnp.copy, self.rollout_params())
                               if self.mesh is None else
                               jax.jit(lambda p: cast_params(p, self.compute_dtype),
                                       out_shardings=self.shardings.params)(self.params))
        # The draft head trained online beside the policy (train.draft_loss_weight > 0): its own
        # params and AdamW, its loss read from the rollout params' features detached
        self.draft_trainer = None
        if c.train.draft_loss_weight > 0:
            self.draft_trainer = self._online_draft_head()
        self.step = 0
        self.run_dir = Path(c.output_dir)
        self.last_logprob_gap: float | None = None
        self.last_is_metrics: dict[str, float] = {}
        # Asynchronous GRPO: the rollouts of the next train.async_steps steps are generated while
        # this step updates (das_jax.rl.async_rollouts); None is the synchronous loop.
        self.async_rollouts = None
        if c.train.async_steps > 0:
            if self.split is not None:
                raise TrainError(
                    f"train.async_steps={c.train.async_steps} runs in one process, but this run "
                    f"has {dist.process_count()}; set train.async_steps: 0 for a multi-process "
                    "run")
            # colocated: a rollout and an update run at once, or take turns (`device_lock`)
            serialize = rollout_devices is None and not c.train.async_overlap
            self.async_rollouts = AsyncRollouts(self, c.train.async_steps, c.train.steps,
                                                serialize=serialize)

    def _online_draft_head(self):
        c = self.config
        if self.mesh is not None:
            raise TrainError(
                f"train.draft_loss_weight={c.train.draft_loss_weight} trains the draft head on "
                "one device, but this run trains on a mesh of "
                f"{self.mesh.devices.size} devices; set train.draft_loss_weight: 0 (the head "
                "stays frozen) or train on one device")
        head = self.rollouts.draft_head    # loaded and checked against the model by the rollout
        if head is None:
            raise TrainError("train.draft_loss_weight > 0 needs a draft head on the rollout; set "
                             "draft_head.path")
        return OnlineHeadTrainer(head, self.model_config, OnlineConfig(
            weight=c.train.draft_loss_weight, learning_rate=c.train.draft_learning_rate,
            max_grad_norm=c.train.draft_max_grad_norm, steps=c.draft_head.steps,
            micro_batch_size=c.grpo.micro_batch_size))

    def train_draft_head(self, rb: RolloutBatch) -> dict[str, float]:
        """One update of the online draft head on `rb` (`das_jax.draft_head.online`), from the
        current params (before this step's update: the rollout's in a synchronous run); the
        rollout's head drafts with the new weights from the next `generate`. Returns the
        head's metrics (draft_loss, draft_top1, draft_grad_norm, draft_train_s: the seconds
        it took, inside the step's train_s; {} without online training)."""
        if self.draft_trainer is None:
            return {}
        t0 = time.perf_counter()
        params = self.rollout_params()
        metrics = self.draft_trainer.update(params, rb.prompt_ids,
                                            [o.token_ids for o in rb.outputs])
        del params
        self.rollouts.set_draft_head_params(self.draft_trainer.params)
        metrics["draft_train_s"] = time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------ data order
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.problems) / self.config.grpo.prompts_per_step)

    def problems_for_step(self, step: int) -> list[Problem]:
        """The problems of (0-based) `step`: a seeded shuffle per epoch, taken in order."""
        k = self.config.grpo.prompts_per_step
        epoch, idx = divmod(step, self.steps_per_epoch())
        order = np.random.default_rng([self.config.train.seed, epoch]).permutation(len(self.problems))
        picked = order[idx * k: (idx + 1) * k]
        if len(picked) < k:  # last partial chunk of an epoch: top up from the start
            picked = np.concatenate([picked, order[: k - len(picked)]])
        return [self.problems[i] for i in picked]

    # ------------------------------------------------------------------ rollout
    def rollout(self, step: int) -> RolloutBatch:
        """The rollouts of (0-based) `step`, sampled from the current params, decoded and
        rewarded."""
        if self.split is None:
            return self.score(*self.generate(step))
        # several processes: each generates its groups; gathered
        rows, requests, sampling = self._requests(step)
        params = self.rollout_params()
        self.rollouts.set_policy_version(self.step)
        rb = split_rollout(self, self.split, requests, rows, self.config.grpo.num_generations,
                           params, sampling)
        del params
        release_trace_caches() or release_free_memory()
        return rb

    def _requests(self, step: int):
        """(rows: each problem of `step` repeated num_generations times, their `Request`s, the
        step's `SamplingParams`: seeds from (train.seed, step, problem, sample index) only)."""
        c = self.config
        G = c.grpo.num_generations
        problems = self.problems_for_step(step)
        sampling = dataclasses.replace(
            self.rollouts.sampling, seed=request_seed(c.train.seed, f"step-{step}", 0))
        requests = [Request(tuple(self.prompt_ids[p.problem_id]), problem_id=p.problem_id,
                            sample_index=g) for p in problems for g in range(G)]
        return [p for p in problems for _ in range(G)], requests, sampling

    def generate(self, step: int, params=None, progress=None, version: int | None = None):
        """(rows, outputs, stats): the unscored rollouts of (0-based) `step` in this process,
        sampled from `params` (default: the current params, `rollout_params()`); rows are the
        problems of the outputs (each repeated num_generations times). `progress`: the
        engine's callback(finished requests, total). `version`: the policy version of `params`
        (the updates they had seen; default the current one, `step`), which the drafter tags
        these rollouts with."""
        rows, requests, sampling = self._requests(step)
        if params is None:
            params = self.rollout_params()
        self.rollouts.set_policy_version(self.step if version is None else version)
        outputs, stats = self.rollouts.generate(requests, params, sampling, progress=progress)
        del params  # the compute-dtype copy is not kept across the update
        # the engine's freed buffers and the tracing caches of the programs it compiled, before
        # the update needs the room
        release_trace_caches() or release_free_memory()
        return rows, outputs, stats

    def score(self, rows: Sequence[Problem], outputs: Sequence[RequestOutput],
              stats: Any = None) -> RolloutBatch:
        """Decodes and rewards `outputs` (one per row of `rows`, the problem it sampled)."""
        completions = [self.tokenizer.decode(o.token_ids) for o in outputs]
        prompts = [self.prompt_text[p.problem_id] for p in rows]
        total, parts = self.reward_fn.breakdown(prompts, completions, **reward_kwargs(rows))
        return RolloutBatch(list(rows), [list(o.request.prompt_ids) for o in outputs],
                            list(outputs), completions, np.asarray(total, np.float32), parts,
                            stats)

    def take_reward_events(self) -> list:
        """What each reward function with an event log (`fn.events.take()`, e.g. the code
        reward's timeouts) logged since the last call: one entry per such function."""
        return [ev.take() for ev in self._reward_events]

    # ------------------------------------------------------------------ update
    def rollout_params(self, on_mesh: bool = False):
        """The params the engine samples from: the master params cast to model.dtype (the same
        arrays when the dtypes agree).

        On a mesh the cast runs on the devices and gathers the params replicated (no host round
        trip); `on_mesh=False` (what today's single-device engine takes) returns this process's
        copy on its first local device, `on_mesh=True` the arrays replicated over the whole
        mesh (for a rollout that places them itself)."""
        if self.mesh is None:
            return cast_params(self.params, self.compute_dtype)
        if getattr(self, "_gather_rollout_params", None) is None:
            dtype = self.compute_dtype
            self._gather_rollout_params = jax.jit(lambda p: cast_params(p, dtype),
                                                  out_shardings=replicated(self.mesh))
        full = self._gather_rollout_params(self.params)
        if on_mesh:
            return full
        return jax.tree_util.tree_map(lambda x: x.addressable_data(0), full)

    def build_batch(self, rb: RolloutBatch):
        """(the `TrainBatch` of `rb`, its advantages `[N]`). Recomputes the old log-probs
        (`grpo.old_logprobs: recompute`) and, in an asynchronous run, the truncated importance
        weights (`das_jax.rl.async_rollouts`; their metrics in `last_is_metrics`). With
        `rollout` the batch carries the engine's log-probs, and an asynchronous run's train
        step weighs the tokens itself (`decoupled_is_cap`)."""
        c = self.config
        advantages = np.asarray(self.advantage_fn(
            jnp.asarray(rb.rewards), c.grpo))
        lens_p = np.array([len(p) for p in rb.prompt_ids], np.int32)
        lens_c = np.array([max(len(o.token_ids), 0) for o in rb.outputs], np.int32)
        T = _token_bucket(dist.max_over_processes(int((lens_p + lens_c).max())))
        tokens = np.zeros((len(rb.outputs), T), np.int32)
        old = np.zeros((len(rb.outputs), T), np.float32)
        for b, (p, o) in enumerate(zip(rb.prompt_ids, rb.outputs)):
            tokens[b, :len(p)] = p
            tokens[b, len(p):len(p) + len(o.token_ids)] = o.token_ids
            old[b, len(p):len(p) + len(o.token_ids)] = o.logprobs
        positions = np.broadcast_to(np.arange(T), tokens.shape)
        valid = positions < (lens_p + lens_c)[:, None]

        def logprobs(params):
            return np.asarray(compute_logprobs(
                self.model_config, params, jnp.asarray(tokens), jnp.asarray(positions),
                jnp.asarray(valid), c.rollout.temperature, c.grpo.micro_batch_size,
                activation=self.activation, compute_dtype=self.compute_dtype, mesh=self.mesh))

        ref = logprobs(self.ref_params) if self.ref_params is not None else None
        self.last_logprob_gap = None
        is_weights = None
        if c.grpo.old_logprobs == "recompute":
            recomputed = logprobs(self.params)
            cmask = (positions >= lens_p[:, None]) & valid
            if self.async_rollouts is not None:
                is_weights, self.last_is_metrics = truncated_importance_weights(
                    recomputed, old, cmask, c.grpo.importance_sampling_cap)
            # How far the sampler's log-probs are from the trainer's (both under the
            # temperature-scaled full softmax, so only float rounding): a health check of the
            # rollouts. In "rollout" mode the train step's first iteration measures the same gap.
            self.last_logprob_gap = float(np.abs(recomputed - old)[cmask].mean()) if cmask.any() \
                else 0.0
            old = recomputed
        return make_batch(tokens, lens_p, lens_c, old_logprobs_BxT=old, ref_logprobs_BxT=ref,
                          advantages_B=advantages, is_weights_BxT=is_weights), advantages

    def update(self, rb: RolloutBatch) -> dict[str, float]:
        batch, _ = self.build_batch(rb)
        # the head first: the policy's update donates the params its features are read from
        head_metrics = self.train_draft_head(rb)
        metrics = {}
        for it in range(self.config.grpo.num_iterations):
            self.params, self.opt_state, m = self.train_step(self.params, self.opt_state, batch)
            metrics = {k: float(v) for k, v in m.items()}
            if it == 0 and self.config.grpo.old_logprobs == "rollout":
                # first iteration: mean |trainer logp - rollout logp| is the gap (on-policy, or
                # the decoupled objective's proximal vs behaviour log-probs)
                self.last_logprob_gap = metrics.get("logprob_gap")
            if it == 0 and "is_weight_mean" in metrics:   # the decoupled objective's weights
                self.last_is_metrics = {k: metrics[k] for k in IS_METRICS}
        metrics.update(head_metrics)
        return metrics

    # ------------------------------------------------------------------ one step
    def train_one_step(self) -> dict[str, Any]:
        step = self.step
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        if self.async_rollouts is None:
            rb = self.rollout(step)
            reward_events = self.take_reward_events()
            rollout_s = time.perf_counter() - t0
        else:   # generated ahead on the rollout worker (it also advances the drafter's epochs)
            dropped = self.async_rollouts.dropped_groups
            vb, wait_s = self.async_rollouts.take(step)
            rb, reward_events, rollout_s = vb.batch, vb.reward_events, vb.rollout_s
            self.last_is_metrics = {}
            extra = {"policy_version": vb.version, "version_lag": step - vb.version,
                     "rollout_wait_s": wait_s,
                     "dropped_groups": self.async_rollouts.dropped_groups - dropped}
        t1 = time.perf_counter()
        with (self.async_rollouts.device_lock if self.async_rollouts is not None
              else contextlib.nullcontext()):
            train_metrics = self.update(rb)
        release_trace_caches() or release_free_memory()
        train_s = time.perf_counter() - t1
        self.step += 1
        if self.async_rollouts is None and self.step % self.steps_per_epoch() == 0:
            self.rollouts.advance_epoch()
        lens = np.array([len(o.token_ids) for o in rb.outputs])
        st = rb.stats
        acc_part = next((v for k, v in rb.reward_parts.items()
                         if k.startswith(("math_accuracy", "code"))), None)
        record = {
            "step": self.step,
            "epoch": (self.step - 1) // self.steps_per_epoch(),
            "reward_mean": float(rb.rewards.mean()),
            "reward_std": float(rb.rewards.std()),
            "frac_reward_zero_std": advantage_metrics(
                rb.rewards, self.config.grpo.num_generations)["frac_reward_zero_std"],
            "accuracy": float(np.mean(acc_part)) if acc_part is not None else None,
            "loss": train_metrics.get("loss"),
            "kl": train_metrics.get("kl"),
            "entropy": train_metrics.get("entropy"),
            "clip_fraction": train_metrics.get("clip_region"),
            "grad_norm": train_metrics.get("grad_norm"),
            "update_norm": train_metrics.get("update_norm"),
            "response_length_mean": float(lens.mean()),
            "response_length_max": int(lens.max()),
            "rollout_s": rollout_s,
            "generation_s": st.wall_s,
            "compile_s": st.compile_s,
            "forward_passes": st.forward_passes,
            "generated_tokens": st.generated_tokens,
            "drafted_tokens": st.drafted_tokens,
            "accepted_draft_tokens": st.accepted_draft_tokens,
            "accepted_per_forward": st.accepted_draft_tokens / max(st.forward_passes, 1),
            "tokens_per_forward": st.generated_tokens / max(st.forward_passes, 1),
            "acceptance_length": st.acceptance_length,
            # per draft position / source: counts, and accepted / drafted rates
            "drafted_by_position": list(getattr(st, "drafted_by_position", [])),
            "accepted_by_position": list(getattr(st, "accepted_by_position", [])),
            "drafted_by_source": dict(getattr(st, "drafted_by_source", {})),
            "accepted_by_source": dict(getattr(st, "accepted_by_source", {})),
            "acceptance_by_position": [round(x, 4) for x in st.acceptance_by_position()],
            "acceptance_by_source": {k: round(v, 4)
                                     for k, v in st.acceptance_by_source().items()},
            "prefill_s": st.prefill_s,
            "decode_s": st.decode_s,
            "draft_s": st.draft_s,
            "policy_s": st.policy_s,
            "draft_model_s": st.draft_model_s,
            "host_s": st.host_s,
            "overlap_s": st.overlap_s,
            "train_s": train_s,
            "rollout_logprob_gap": self.last_logprob_gap,
            # code samples that used up their CPU time (logged by the code reward, once a step)
            "reward_timeouts": sum(e.get("timeout", 0) for e in reward_events),
        }
        for k in ("draft_loss", "draft_top1", "draft_grad_norm", "draft_train_s"):  # online head
            if k in train_metrics:
                record[k] = train_metrics[k]
        if extra:
            record.update(extra)
            record.update(self.last_is_metrics)
        for k, v in rb.reward_parts.items():
            record[f"reward/{k}"] = float(np.mean(v))
        self.last_samples = sample_rows(rb, self.step, self.config.train.log_samples,
                                        self.prompt_text)
        return record

    def quiesce(self) -> None:
        """Waits for the rollouts generated ahead (an asynchronous run; nothing otherwise), so
        that the engine, the drafter and the DAS policy are idle: before a checkpoint or an
        evaluation."""
        if self.async_rollouts is not None:
            self.async_rollouts.drain()

    def close(self, cancel: bool = False) -> None:
        """Stops the rollout worker of an asynchronous run (rollouts not started are
        cancelled; a running one finishes first, or with `cancel` stops at its next finished
        request); the end of `train` (`cancel` when it ends on an error or an interrupt)."""
        if self.async_rollouts is not None:
            self.async_rollouts.close(cancel=cancel)

    def release_optimizer_state(self) -> None:
        """Drops the optimizer state once the run has reached `train.steps` (after its last
        checkpoint, which holds it): no update follows, so the final evaluation and the plots
        run without the Adam moments (2x the params). `update` and `save` need it, so neither
        may be called afterwards."""
        self.opt_state = None
        gc.collect()
        release_free_memory()

    # ------------------------------------------------------------------ checkpoints
    def save(self, manager: CheckpointManager) -> None:
        """Checkpoints the current step (`das_jax.rl.trainer_checkpoint.save_trainer`).

        Raises:
          TrainError: the disk is full (names the checkpoint directory and how to go on).
        """
        save_trainer(self, manager)

    def restore(self, manager: CheckpointManager, max_step: int | None = None) -> int:
        """Restores the newest readable checkpoint (at or below `max_step` when given); returns
        its step (`das_jax.rl.trainer_checkpoint.restore_trainer`).

        Raises:
          TrainError: no checkpoint, none readable, one written for another model/optimizer, or
            one in a format this version does not read (an older version's pickle).
        """
        return restore_trainer(self, manager, max_step)

    # ------------------------------------------------------------------ the loop
    def train(self, resume: bool = False, progress: bool = True,
              stop_after: int | None = None, overwrite: bool = False) -> list[dict]:
        """Runs until `train.steps` (or `stop_after` more steps); returns this call's records
        (`das_jax.rl.train_loop.run_training`).

        The run directory is locked for the whole call (`das_jax.rl.run_dir`). A new run
        (`resume=False`) refuses a directory holding a previous run's files unless `overwrite`
        (which removes only the files das-jax wrote there), and a directory whose files it
        would write over but no das-jax run wrote (`das_jax.rl.run_dir`). A resumed run that
        already reached `train.steps` logs that it is complete and returns [].

        Raises:
          RunDirError: output_dir is in use by another run, holds a previous run (new run without
            overwrite) or files a new run would write over that no das-jax run wrote, or is not
            a directory.
          TrainError: nothing to resume; a non-finite loss (nothing of that step is saved); the
            disk filled up while checkpointing.
        """
        return run_training(self, resume=resume, progress=progress, stop_after=stop_after,
                            overwrite=overwrite)
