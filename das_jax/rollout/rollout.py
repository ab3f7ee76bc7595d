"""`Rollout`: the one boundary between RL code and speculative generation.

A `Rollout` owns an `Engine` (one model, one device), the speculation chosen by name (a drafter,
a policy, and the cost model the policy plans with; `das_jax.speculation`), and the
default sampling settings. The trainer, the benchmarks and multi-device placement talk to it
only (in the spirit of Tunix's `BaseRollout`):

    rollout = rollout_from_config(config, model_config, params, tokenizer.eos_token_ids)
    outputs, stats = rollout.generate(requests, params)   # calibrates the cost model once
    rollout.advance_epoch()                               # end of a pass over the data
    state = rollout.state_dict(); rollout.load_state_dict(state)   # checkpoints
    forks = rollout.forks(jax.devices())                  # per-device copies, shared drafter

`rollout_from_config` (`das_jax.rollout.factory`) builds the engine from the config; with more
than one local device it returns a `ShardedRollout` (`das_jax.rollout.sharded`, a subclass this
module does not know): the same interface over data-parallel replicas on device meshes
(`rollout.replicas`), each tensor-parallel over KV heads when it has several devices.

Every setting comes from the config: `rollout:` (engine shapes and sampling), `drafter:` (the
speculation name) and `das:` (drafter, DAS-policy and cost-model settings).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from das_jax.draft_head.drafter import HeadDrafts
from das_jax.draft_head.runtime import HeadRuntime
from das_jax.drafter.base import set_policy_version
from das_jax.engine import Engine, SamplingParams
from das_jax.errors import UserError
from das_jax.rollout.multi_device import LockedDrafter
from das_jax.rollout.warmup import warm_up
from das_jax.speculation import CostModel, DASSection, calibrate, get_speculation


class Rollout:
    """An engine plus its speculation.

    Args:
      engine: the `das_jax.engine.Engine` to generate with.
      speculation: a registered speculation name (`speculation_names()`).
      das: the `das:` settings (`das_jax.speculation.DASSection`; default: its defaults).
      sampling: default `SamplingParams` of `generate` (default: `SamplingParams()`).
      cost_model: the `CostModel` the policy plans with (default: from `das.cost_model`).
      warm_kernels: start compiling the speculation's host kernels (numba) on a background
        thread now, so the first rollout does not pay their compiles
        (`das_jax.rollout.warmup`; the thread is `warm_up_thread`, None without a drafter).

    Raises:
      SpeculationError: an unknown speculation name.
    """

    def __init__(self, engine, speculation: str = "none", das=None, sampling=None,
                 cost_model=None, *, warm_kernels: bool = True, _parts: tuple | None = None):
        self.spec = get_speculation(speculation)
        self.engine = engine
        self.das = das if das is not None else DASSection()
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.warm_up_thread = None
        if _parts is not None:          # a fork: shares the drafter, owns a policy copy
            self.drafter, self.policy, self.cost_model, self.calibrated = _parts
            return
        self.cost_model = cost_model if cost_model is not None else CostModel.from_config(
            self.das.cost_model)
        self.drafter, self.policy = self.spec.build(self.das, self.cost_model)
        self.calibrated = False
        if warm_kernels and self.drafter is not None:
            ec = getattr(engine, "engine_config", None)
            self.warm_up_thread = warm_up(speculation, self.das,
                                          (1, 4, 8) if ec is None else ec.draft_widths)

    def attach_draft_head(self, head, steps: int, scale: float,
                          dtype: str | None = None) -> None:
        """Adds an EAGLE-3 draft head (`das_jax.draft_head`): it runs on the engine's device
        beside every prefill and verify step, and each row takes its draft or the history
        drafter's (`draft_head.HeadDrafts`; with no history drafter, the head's alone).

        Args:
          head: a `draft_head.DraftHead` fitted to this engine's model.
          steps: its draft tokens per step (cut to the widest draft width - 1).
          scale: the factor on its path probabilities in the choice (`HeadDrafts`).
          dtype: its matrices' dtype on the device (`HeadRuntime`; None: float32)."""
        widest = max(self.engine.engine_config.draft_widths)
        steps = max(1, min(int(steps), widest - 1))
        self.drafter = HeadDrafts(HeadRuntime(head, steps, dtype), self.drafter, head_scale=scale)

    @property
    def draft_head(self):
        """The attached `draft_head.DraftHead` (its current weights), or None."""
        runtime = getattr(self.drafter, "draft_model", None)
        return runtime.head if isinstance(runtime, HeadRuntime) else None

    def set_draft_head_params(self, params) -> None:
        """New weights for the attached draft head (an online update, same names and shapes);
        the next `generate` drafts with them.

        Raises:
          ValueError: no head is attached, or the params do not fit it."""
        runtime = getattr(self.drafter, "draft_model", None)
        if not isinstance(runtime, HeadRuntime):
            raise ValueError("no draft head is attached to this rollout")
        runtime.set_params(params)

    # ------------------------------------------------------------------ properties
    @property
    def name(self) -> str:
        """The speculation name."""
        return self.spec.name

    @property
    def engine_config(self):
        """The engine's `EngineConfig` (slots, cache length, compiled widths)."""
        return self.engine.engine_config

    @property
    def params(self):
        """The engine's own params (what `generate` samples from when given none)."""
        return self.engine.params

    # ------------------------------------------------------------------ generation
    def generate(self, requests, params=None, sampling=None,
                 progress: Callable[[int, int], None] | None = None,
                 request_ids: Sequence[int] | None = None):
        """`Engine.generate` with this rollout's drafter and policy.

        Args:
          requests: `Request`s; outputs come back in the same order.
          params: params to sample from (default: the engine's own).
          sampling: `SamplingParams` (default: this rollout's `sampling`).
          progress: optional callback(finished_requests, total).
          request_ids: the ids the drafter sees for the requests (default 0..n-1); forks that
            share one drafter pass indices into their common request list, so ids never
            collide across devices (`das_jax.rollout.multi_device`).

        Before the first call of a speculation that plans with the cost model (`das`), the
        cost model is calibrated (`calibrate`) unless `das.cost_model.calibrate` is false.

        Returns:
          (list of `RequestOutput`, `GenerateStats`).

        Raises:
          GenerateError / SamplingError: bad input, before anything is compiled.
        """
        sampling = sampling if sampling is not None else self.sampling
        if (self.spec.uses_cost_model and self.das.cost_model.calibrate
                and not self.calibrated):
            self.engine.validate(requests, sampling)
            self.calibrate(requests, sampling, params=params)
        drafter = self.drafter
        if request_ids is not None and getattr(drafter, "draft_model", None) is not None:
            raise UserError("a draft head runs with one rollout engine per process; forks "
                            "sharing its drafter are not supported (set draft_head.path: null "
                            "or rollout.replicas: 1)")
        if request_ids is not None and drafter is not None:
            drafter = LockedDrafter(drafter).view(request_ids)
        return self.engine.generate(requests, sampling, drafter=drafter, policy=self.policy,
                                    params=params, progress=progress)

    def calibrate(self, requests, sampling=None, params=None):
        """Fits the cost model to the engine's verify step timed at a few shapes (batch 1 and
        max_slots, every compiled width, the attended lengths of `das.cost_model`), with the
        cache length and sampling key these `requests` will use, so the executables compiled
        here are reused by `generate`. `params`: the params to time with (default: the
        engine's own; an engine built without params needs them). Returns the fitted
        `CostModel`."""
        sampling = sampling if sampling is not None else self.sampling
        c = self.das.cost_model
        own = self.engine.params
        if params is not None:
            self.engine.params = params
        try:
            calibrate(self.engine, self.cost_model,
                      cache_len=self.engine.cache_len_for(requests, sampling),
                      kv_lens=c.calibrate_kv_lens, repeats=c.calibrate_repeats,
                      sampling_key=sampling.static_key(),
                      draft_model=getattr(self.drafter, "draft_model", None))
        finally:
            self.engine.params = own
        self.calibrated = True
        return self.cost_model

    def set_policy_version(self, version: int) -> None:
        """The policy version (int >= 0: the updates the params of the next `generate` calls
        had seen) the drafter tags the rollouts it indexes from now on with; drafts report the
        age of their history against it and the DAS policy calibrates acceptance per age
        (`das_jax.drafter.history`). A no-op for a drafter without versions. Forks share the
        drafter: set it once, before generating."""
        if self.drafter is not None:
            set_policy_version(self.drafter, version)

    def advance_epoch(self) -> None:
        """End of a pass over the data: the drafter's current epoch becomes history. Forks share
        one drafter, so advance it once (on any one of them), not once per fork."""
        if self.drafter is not None:
            self.drafter.advance_epoch()

    def predicted_lengths(self, requests) -> np.ndarray:
        """float64 `[len(requests)]`: each request's predicted output length in tokens, the
        median of its problem's past rollout lengths (-1 = unknown). Placement uses it."""
        lengths = getattr(self.policy, "predicted_length", None)
        history = getattr(self.drafter, "lengths", None)
        cache: dict[Hashable, float] = {}

        def one(pid):
            if lengths is not None:
                return float(lengths(pid))
            if history is not None:
                past = list(history(pid))
                return float(np.median(past)) if past else -1.0
            return -1.0

        return np.array([cache[r.problem_id] if r.problem_id in cache else
                         cache.setdefault(r.problem_id, one(r.problem_id)) for r in requests],
                        np.float64)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """{"drafter": the drafter's state or None, "policy": the policy's state or None}:
        plain data (dicts, lists, tuples, scalars, numpy arrays; saved as JSON + npz)."""
        return {"drafter": self.drafter.state_dict() if self.drafter is not None else None,
                "policy": (self.policy.state_dict() if hasattr(self.policy, "state_dict")
                           else None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned (missing or None parts are skipped)."""
        if self.drafter is not None and state.get("drafter") is not None:
            self.drafter.load_state_dict(state["drafter"])
        policy = state.get("policy")
        if isinstance(policy, dict) and "replicas" in policy:   # a ShardedRollout's state
            policy = policy["replicas"][0] if policy["replicas"] else None
        if policy and hasattr(self.policy, "load_state_dict"):
            self.policy.load_state_dict(policy)

    # ------------------------------------------------------------------ devices
    def fork(self, device) -> "Rollout":
        """A copy of this rollout for `device` (a `jax.Device`, or a replica `Mesh`: the engine
        is then tensor-parallel over it, `das_jax.engine.placement`): its own engine there
        (params placed on device), its own policy (`policy.fork`: the learned state so far), and
        this rollout's drafter, shared behind one lock (`LockedDrafter`), so siblings of a problem
        generated on other devices feed the same history. The first fork wraps this rollout's
        own drafter in the lock, so keep using this rollout (or its forks) afterwards."""

        if self.drafter is not None and not isinstance(self.drafter, LockedDrafter):
            self.drafter = LockedDrafter(self.drafter)

        e = self.engine
        mesh = device if isinstance(device, Mesh) else None
        engine = Engine(e.config, e.params, e.eos_token_ids, e.engine_config,
                        device=None if mesh is not None else device, dtype=e.dtype, mesh=mesh)
        policy = self.policy.fork(self.drafter) if self.policy is not None else None
        return Rollout(engine, self.name, self.das, self.sampling,
                       _parts=(self.drafter, policy, getattr(policy, "cost_model",
                                                             self.cost_model),
                               self.calibrated))

    def forks(self, devices=None) -> list["Rollout"]:
        """One `fork` per device (default: `jax.devices()`). Keep the list across calls, so each
        fork's policy state persists (compiled executables are shared per shape and device)."""
        return [self.fork(d) for d in (list(devices) if devices is not None else jax.devices())]

    def with_speculation(self, speculation: str, das=None, cost_model=None) -> "Rollout":
        """A rollout on the same engine and sampling with another speculation (fresh drafter and
        policy), e.g. to compare drafters side by side in one process."""
        return Rollout(self.engine, speculation, das if das is not None else self.das,
                       self.sampling, cost_model)

    def __repr__(self) -> str:
        return (f"Rollout({self.name!r}, device={self.engine.device}, "
                f"engine_config={self.engine.engine_config})")

