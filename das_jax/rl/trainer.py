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

A run directory holds the resolved `config.yaml`, `metrics.jsonl`, TensorBoard events under
`tb/`, orbax checkpoints under `checkpoints/`, and PNG plots under `plots/`.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from das_jax.config import Config, config_to_dict, save_config
from das_jax.data import Problem, load_dataset_from_config, render_prompt, reward_kwargs
from das_jax.engine.cost_model import CostModel, calibrate
from das_jax.engine.das_policy import DASConfig
from das_jax.engine.generate import Engine, EngineConfig, Request, RequestOutput
from das_jax.engine.sampling import SamplingParams, request_seed
from das_jax.rl.advantages import group_advantages
from das_jax.rl.checkpoint import CheckpointManager
from das_jax.rl.rewards import combine_rewards, get_reward_fn
from das_jax.rl.train_step import compute_logprobs, make_batch, make_optimizer, make_train_step
from das_jax.speculation import build_speculation

log = logging.getLogger("das_jax.train")


class TrainError(ValueError):
    """A run that cannot start or resume (names the problem and the fix)."""


@dataclasses.dataclass
class RolloutBatch:
    """What one step's rollouts produced (host-side)."""

    problems: list[Problem]            # one per row (each problem repeated num_generations times)
    prompt_ids: list[list[int]]
    outputs: list[RequestOutput]
    completions: list[str]
    rewards: np.ndarray                # float32 [N]
    reward_parts: dict[str, list[float]]
    stats: Any                         # GenerateStats


def _token_bucket(n: int, multiple: int = 64) -> int:
    return int(math.ceil(n / multiple) * multiple)


class GRPOTrainer:
    """Runs GRPO with DAS rollouts for a `Config`.

    Args:
      config: the resolved run config.
      model: optional (model_config, params, tokenizer) to use instead of loading
        `config.model.source` (tests pass tiny random models).
      problems: optional problems instead of `config.data`.
      reward_fns: optional TRL-signature reward functions instead of `config.grpo.reward_funcs`.
    """

    def __init__(self, config: Config, *, model=None, problems: Sequence[Problem] | None = None,
                 reward_fns: Sequence[Callable] | None = None):
        self.config = config
        c = config
        if model is None:
            from das_jax.models import load
            model = load(c.model.source, dtype=getattr(jnp, c.model.dtype))
        self.model_config, self.params, self.tokenizer = model
        if problems is None:
            problems = load_dataset_from_config(
                c.data.kind, c.data.path, num_problems=c.data.num_problems, limit=c.data.limit,
                seed=c.data.seed)
        self.problems = list(problems)
        if not self.problems:
            raise TrainError("the dataset is empty; check data.kind / data.path / data.limit")
        self.prompt_ids = {}
        self.prompt_text = {}
        for p in self.problems:
            text = render_prompt(p, self.tokenizer if c.data.chat else None,
                                 instruction=c.data.instruction, chat=c.data.chat)
            self.prompt_text[p.problem_id] = text
            self.prompt_ids[p.problem_id] = self.tokenizer.encode(text)
        self.engine = Engine(
            self.model_config, self.params, eos_token_ids=self.tokenizer.eos_token_ids,
            engine_config=EngineConfig(max_slots=c.rollout.max_slots,
                                       max_cache_len=c.rollout.max_cache_len,
                                       draft_widths=tuple(c.rollout.draft_widths),
                                       exact=c.rollout.exact))
        self.sampling_template = SamplingParams(
            temperature=c.rollout.temperature, top_k=c.rollout.top_k, top_p=c.rollout.top_p,
            max_new_tokens=c.rollout.max_new_tokens,
            stop_token_ids=tuple(c.rollout.stop_token_ids), seed=c.train.seed)
        self.drafter, self.policy = build_speculation(
            c.drafter, das_config=DASConfig(), cost_model=CostModel(),
            **({} if c.drafter in ("none", "ngram") else dict(
                window=c.das.window, max_depth=c.das.max_depth,
                min_token_prob=c.das.min_token_prob)))
        if reward_fns is None:
            reward_fns = [get_reward_fn(n) for n in c.grpo.reward_funcs]
        self.reward_fn = combine_rewards(reward_fns, c.grpo.reward_weights)
        self.optimizer = make_optimizer(c.grpo, c.train.steps)
        self.opt_state = self.optimizer.init(self.params)
        self.train_step = make_train_step(self.model_config, c.grpo, self.optimizer,
                                          temperature=c.rollout.temperature or 1.0)
        self.ref_params = self.params if c.grpo.beta > 0 else None
        self.step = 0
        self.run_dir = Path(c.output_dir)
        self._calibrated = False
        self.last_logprob_gap: float | None = None

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
        c = self.config
        G = c.grpo.num_generations
        problems = self.problems_for_step(step)
        sampling = dataclasses.replace(
            self.sampling_template, seed=request_seed(c.train.seed, f"step-{step}", 0))
        requests = [Request(tuple(self.prompt_ids[p.problem_id]), problem_id=p.problem_id,
                            sample_index=g) for p in problems for g in range(G)]
        if self.policy is not None and hasattr(self.policy, "cost_model") and not self._calibrated:
            calibrate(self.engine, self.policy.cost_model,
                      cache_len=self.engine.cache_len_for(requests, sampling),
                      sampling_key=sampling.static_key())
            self._calibrated = True
        outputs, stats = self.engine.generate(requests, sampling, drafter=self.drafter,
                                              policy=self.policy, params=self.params)
        rows = [p for p in problems for _ in range(G)]
        completions = [self.tokenizer.decode(o.token_ids) for o in outputs]
        prompts = [self.prompt_text[p.problem_id] for p in rows]
        total, parts = self.reward_fn.breakdown(prompts, completions, **reward_kwargs(rows))
        return RolloutBatch(rows, [list(r.prompt_ids) for r in requests], outputs, completions,
                            np.asarray(total, np.float32), parts, stats)

    # ------------------------------------------------------------------ update
    def build_batch(self, rb: RolloutBatch):
        c = self.config
        advantages = np.asarray(group_advantages(jnp.asarray(rb.rewards), c.grpo.num_generations,
                                                 c.grpo.scale_rewards))
        lens_p = np.array([len(p) for p in rb.prompt_ids])
        lens_c = np.array([max(len(o.token_ids), 0) for o in rb.outputs])
        T = _token_bucket(int((lens_p + lens_c).max()))
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
                jnp.asarray(valid), c.rollout.temperature or 1.0, c.grpo.micro_batch_size))

        ref = logprobs(self.ref_params) if self.ref_params is not None else None
        self.last_logprob_gap = None
        if c.grpo.old_logprobs == "recompute":
            recomputed = logprobs(self.params)
            cmask = (positions >= lens_p[:, None]) & valid
            # How far the sampler's log-probs are from the trainer's (float rounding, plus the
            # top-k / top-p truncation the sampler applies): a health check of the rollouts.
            self.last_logprob_gap = float(np.abs(recomputed - old)[cmask].mean()) if cmask.any() \
                else 0.0
            old = recomputed
        return make_batch(tokens, lens_p, lens_c, old_logprobs_BxT=old, ref_logprobs_BxT=ref,
                          advantages_B=advantages), advantages

    def update(self, rb: RolloutBatch) -> dict[str, float]:
        batch, _ = self.build_batch(rb)
        metrics = {}
        for _ in range(self.config.grpo.num_iterations):
            self.params, self.opt_state, m = self.train_step(self.params, self.opt_state, batch)
            metrics = {k: float(v) for k, v in m.items()}
        return metrics

    # ------------------------------------------------------------------ one step
    def train_one_step(self) -> dict[str, Any]:
        step = self.step
        t0 = time.perf_counter()
        rb = self.rollout(step)
        rollout_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        train_metrics = self.update(rb)
        train_s = time.perf_counter() - t1
        self.step += 1
        if self.drafter is not None and self.step % self.steps_per_epoch() == 0:
            self.drafter.advance_epoch()
        lens = np.array([len(o.token_ids) for o in rb.outputs])
        st = rb.stats
        acc_part = next((v for k, v in rb.reward_parts.items()
                         if k.startswith(("math_accuracy", "code"))), None)
        record = {
            "step": self.step,
            "epoch": (self.step - 1) // self.steps_per_epoch(),
            "reward_mean": float(rb.rewards.mean()),
            "reward_std": float(rb.rewards.std()),
            "accuracy": float(np.mean(acc_part)) if acc_part is not None else None,
            "loss": train_metrics.get("loss"),
            "kl": train_metrics.get("kl"),
            "entropy": train_metrics.get("entropy"),
            "clip_fraction": train_metrics.get("clip_region"),
            "grad_norm": train_metrics.get("grad_norm"),
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
            "acceptance_length": st.acceptance_length,
            "draft_s": st.draft_s,
            "train_s": train_s,
            "rollout_logprob_gap": self.last_logprob_gap,
        }
        for k, v in rb.reward_parts.items():
            record[f"reward/{k}"] = float(np.mean(v))
        return record

    # ------------------------------------------------------------------ checkpoints
    def _meta(self) -> dict:
        return {"step": self.step, "seed": self.config.train.seed,
                "policy_state": self.policy.state_dict() if hasattr(self.policy, "state_dict")
                else None,
                "config": config_to_dict(self.config)}

    def save(self, manager: CheckpointManager) -> None:
        manager.save(self.step, self.params, self.opt_state, self._meta(),
                     self.drafter.state_dict() if self.drafter is not None else None)

    def restore(self, manager: CheckpointManager) -> int:
        step = manager.latest_step()
        if step is None:
            raise TrainError(f"no checkpoint to resume from under {manager.step_dir(0).parent}; "
                             "start a new run without --resume")
        params, opt_state, meta, drafter_state = manager.restore(
            step, params_like=self.params, opt_state_like=self.opt_state)
        self.params, self.opt_state, self.step = params, opt_state, int(meta["step"])
        if self.drafter is not None and drafter_state is not None:
            self.drafter.load_state_dict(drafter_state)
        if meta.get("policy_state") and hasattr(self.policy, "load_state_dict"):
            self.policy.load_state_dict(meta["policy_state"])
        return self.step

    # ------------------------------------------------------------------ the loop
    def train(self, resume: bool = False, progress: bool = True,
              stop_after: int | None = None) -> list[dict]:
        """Runs until `train.steps` (or `stop_after` more steps); returns this call's records."""
        from das_jax.rl.logging import RunLogger
        c = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        manager = CheckpointManager(self.run_dir, max_to_keep=c.train.keep_checkpoints)
        if resume:
            self.restore(manager)
        elif manager.latest_step() is not None:
            raise TrainError(f"{self.run_dir} already holds checkpoints; pass --resume "
                             f"{self.run_dir} to continue it, or choose another output_dir")
        save_config(c, self.run_dir / "config.yaml")
        logger = RunLogger(self.run_dir, total_steps=c.train.steps, start_step=self.step,
                           progress=progress)
        records = []
        try:
            while self.step < c.train.steps:
                if stop_after is not None and len(records) >= stop_after:
                    break
                record = self.train_one_step()
                records.append(record)
                logger.log(record)
                if self.step % c.train.save_every == 0 or self.step == c.train.steps:
                    self.save(manager)
        finally:
            logger.close()
            manager.close()
        return records
