"""Continuous-batching generation with speculative verification: `Engine.generate`.

The host scheduler (`scheduler.run_schedule`: admission, slot refill, compaction, buckets,
per-row bookkeeping, stats; shared with the trace replay) drives the engine's `DeviceExecutor`
(`executor.py`), which runs the jitted programs of `step.py` (packed prefill, prompt sharing,
packed verify, compaction) on a donated KV cache through the engine's `Programs`
(`programs.py`: one owner of every compiled program, keyed by its typed spec, `specs.py`).

* Slots: the cache has B rows, B a batch bucket (powers of two up to `max_slots`). Freed rows are
  refilled from the queue; when the queue is empty and the live rows fit a smaller bucket, they
  are compacted into it, so the long tail runs a small, cheap batch.
* Shapes: B from batch buckets; verify: N token slots from `schedule.verify_token_buckets`
  (N = B without drafts, else a bucket of sum_b (1 + n_draft_b) over the live rows) and a query
  block W from `draft_widths` (the step's longest row); the attended cache length from
  quarter-octave buckets of the longest live row, prompt lengths from power-of-two buckets.
  Each distinct shape is compiled once (ahead of time, timed separately as `compile_s`); with
  `EngineConfig(precompile=True)` the verify shapes a call can reach are compiled before its
  first step (`Engine.precompile`), so no compile lands inside a later call.
* Exactness: every token is sampled with the position-keyed rule of `sampling.py`, seeded by the
  request's own seed, so outputs do not depend on drafts, slots, buckets or batch neighbours
  (up to float rounding of the logits across shapes: see docs/design.md, "Exactness"; with
  `EngineConfig(exact=True)` the logits themselves are shape-invariant and outputs token-identical).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.engine import scheduler
from das_jax.engine.engine_config import (EngineConfig, GenerateError, Request,  # noqa: F401
                                          size_slots)
from das_jax.engine.executor import DeviceExecutor
from das_jax.engine.paged_executor import PagedExecutor
from das_jax.engine.placement import MeshPlacement
from das_jax.engine.policy import SpeculationPolicy
from das_jax.engine.programs import Programs
from das_jax.engine.schedule import (bucket, cache_len_for, kv_len_bucket,
                                     precompile_token_buckets, step_shape_fn, wide_rows_for)
from das_jax.engine.scheduler import GenerateStats, RequestOutput
from das_jax.engine.sampling import SamplingError, SamplingParams, validate_stop_ids
from das_jax.engine.specs import DecodeSpec, PrefillSpec, VerifySpec
from das_jax.models.config import ModelConfig
from das_jax.models.contraction import EXACT
from das_jax.models.transformer import KVCache, Params


class Engine:
    """The rollout engine for one model.

    Args:
      config: model config; params: model params (the engine reads whatever params it is given at
      each `generate` call, so a trainer passes its freshly updated params).
      eos_token_ids: the tokenizer's end-of-sequence ids (always stop tokens).
      engine_config: `EngineConfig`.
      device: optional `jax.Device` this engine runs on: its params, KV cache and compiled
        executables live there (params passed to `generate` are copied there); None = JAX's
        default placement.
      mesh: optional `jax.sharding.Mesh` (instead of `device`) this engine runs on,
        tensor-parallel over its `tensor` axis: params and KV cache sharded on the heads
        (`das_jax.engine.placement`); params passed to `generate` on any sharding are resharded
        there on device. One engine per replica mesh gives data-parallel rollouts
        (`das_jax.rollout.sharded`).
      dtype: the compute dtype the KV cache is sized for (default: the params' dtype). An engine
        built with params=None (a trainer that passes fresh params to every `generate`, so the
        engine keeps none alive) needs it.

    Raises:
      GenerateError: both `device` and `mesh`, or neither params nor dtype.
    """

    def __init__(self, config: ModelConfig, params: Params | None,
                 eos_token_ids: Sequence[int] = (), engine_config: EngineConfig = EngineConfig(),
                 device: jax.Device | None = None, dtype=None, mesh=None):
        if engine_config.exact:
            config = dataclasses.replace(config, contraction=EXACT)
        if config.layer_loop != engine_config.layer_loop:
            config = dataclasses.replace(config, layer_loop=engine_config.layer_loop)
        if device is not None and mesh is not None:
            raise GenerateError("give an Engine a device or a mesh, not both")
        if mesh is not None and engine_config.kv_cache == "paged":
            raise GenerateError("rollout.kv_cache: paged runs an engine on one device (set "
                                "rollout.replicas to the device count), or use "
                                "rollout.kv_cache: dense on a tensor-parallel mesh")
        self.config = config
        self.device = device
        self.mesh = mesh
        if mesh is not None:
            self.placement = MeshPlacement(mesh)
        else:
            self.placement = None
        self.params = None if params is None else self.place_params(params)
        self.eos_token_ids = validate_stop_ids(eos_token_ids, config.vocab_size)
        if dtype is None:
            if params is None:
                raise GenerateError("an Engine built without params needs its compute dtype "
                                    "(dtype=...) to size the KV cache")
            dtype = params["embed"].dtype
        self.dtype = jnp.dtype(dtype)
        self.engine_config = size_slots(
            config, engine_config, self.dtype,
            device if mesh is None else self.placement.devices[0],
            kv_shards=1 if mesh is None else self.placement.kv_shards(config))
        self.programs = Programs(config, device, self.placement)
        self._precompiled: set = set()    # precompile calls done (their shapes)

    def place_params(self, params: Params) -> Params:
        """`params` where this engine computes: on its mesh's shardings, its device, or as given
        (no copy when already there; device-to-device when on other devices)."""
        if self.placement is not None:
            return self.placement.put_params(params)
        if self.device is not None:
            return jax.device_put(params, self.device)
        return params

    def zeros_cache(self, batch: int, cache_len: int, dtype) -> KVCache:
        """An empty KV cache of `batch` rows x `cache_len` positions where this engine
        computes (`Programs.zeros_cache`)."""
        return self.programs.zeros_cache(batch, cache_len, dtype)

    @property
    def slots(self) -> int:
        """Concurrent rows after sizing from the KV memory budget (<= engine_config.max_slots)."""
        return self.engine_config.max_slots

    # ------------------------------------------------------------------ validation
    def validate(self, requests: Sequence[Request], sampling: SamplingParams) -> None:
        """Checks a `generate` call's input without compiling anything.

        Raises:
          SamplingError: `sampling` is not a SamplingParams or has stop ids outside the vocab.
          GenerateError: no requests, an empty prompt, token ids outside the vocabulary, or a
            request that needs more than `max_cache_len` cache positions (the message names
            the request and the fix).
        """
        if not isinstance(sampling, SamplingParams):
            raise SamplingError("sampling must be a SamplingParams")
        validate_stop_ids(sampling.stop_token_ids, self.config.vocab_size)
        if not requests:
            raise GenerateError("no requests to generate (num_samples must be >= 1)")
        max_w = max(self.engine_config.draft_widths)
        limit = self.engine_config.max_cache_len
        for i, r in enumerate(requests):
            if len(r.prompt_ids) == 0:
                raise GenerateError(f"request {i} (problem {r.problem_id!r}) has an empty prompt; "
                                    "every prompt needs at least one token")
            need = len(r.prompt_ids) + sampling.max_new_tokens + max_w
            if need > limit:
                raise GenerateError(
                    f"request {i} (problem {r.problem_id!r}): prompt of {len(r.prompt_ids)} tokens + "
                    f"max_new_tokens={sampling.max_new_tokens} + draft width {max_w} needs {need} "
                    f"cache positions but max_cache_len={limit}; shorten the prompt, lower "
                    f"max_new_tokens, raise max_cache_len"
                    + (", or drop the widest draft width from draft_widths" if max_w > 1
                       else ""))
            bad = [t for t in r.prompt_ids if not 0 <= int(t) < self.config.vocab_size]
            if bad:
                raise GenerateError(f"request {i}: token ids {bad[:5]} outside the vocabulary "
                                    f"[0, {self.config.vocab_size})")

    def cache_len_for(self, requests: Sequence[Request], sampling: SamplingParams) -> int:
        """Cache positions per row for these requests: a power of two >= 128 that holds the
        longest prompt + max_new_tokens + the widest draft, capped at max_cache_len."""
        ec = self.engine_config
        return cache_len_for(ec.max_cache_len, ec.draft_widths,
                             max(len(r.prompt_ids) for r in requests), sampling.max_new_tokens)

    def max_step_tokens(self, batch: int) -> int:
        """The largest packed slot bucket at this batch bucket: batch x the widest draft width."""
        return batch * max(self.engine_config.draft_widths)

    def verify_shapes(self, requests: Sequence[Request], sampling: SamplingParams,
                      drafting: bool) -> list[tuple[int, int, int, int, int]]:
        """The packed verify shapes (B, N, W, kv_len, R) `generate(requests, sampling)` can
        reach and `precompile` compiles: every batch bucket up to the call's first batch, every
        attended-length bucket its rows can reach (prompt lengths .. longest prompt +
        max_new_tokens), N = B with W = 1, and with `drafting`, for every width W > 1 of
        `draft_widths`, the slot buckets N of `schedule.precompile_token_buckets` with
        B < N <= B * W (R = 0: one query block), then the split query blocks
        (`wide_row_buckets`: each R that `schedule.wide_rows_for` can pick at (B, W), with the
        slot buckets B < N <= B + R * (W - 1)). Sorted by attended length, then batch (largest
        first)."""
        ec = self.engine_config
        S = self.cache_len_for(requests, sampling)
        lens = [len(r.prompt_ids) for r in requests]
        hi = max(lens) + max(sampling.max_new_tokens - 1, 0)
        kvs = sorted({kv_len_bucket(np.array([x]), S) for x in range(min(lens), hi + 1)})
        top = bucket(min(len(requests), ec.max_slots), ec.batch_buckets)
        wmax = max(ec.draft_widths)
        out = []
        for kv in kvs:
            for B in sorted((b for b in ec.batch_buckets if b <= top), reverse=True):
                out.append((B, B, 1, kv, 0))
                if drafting:
                    out.extend((B, N, W, kv, 0) for W in ec.draft_widths if W > 1
                               for N in precompile_token_buckets(B, wmax) if B < N <= B * W)
                    out.extend((B, N, W, kv, R) for W in ec.draft_widths if W > 1
                               for R in ec.wide_row_buckets
                               if wide_rows_for([1] * R, B, W, ec.wide_row_buckets) == R
                               for N in precompile_token_buckets(B, wmax)
                               if B < N <= bucket(B + R * (W - 1),
                                                  precompile_token_buckets(B, wmax)))
        return list(dict.fromkeys(out))

    def refill_prefill_shapes(self, requests: Sequence[Request], sampling: SamplingParams
                              ) -> list[tuple[int, int, int]]:
        """(B, N, T) of the packed prefill admitting one prompt into the call's first batch B,
        for each prompt length among the requests (N its slot bucket, T its length bucket):
        the refills of a running call (with `share_prompts`, a refill prefills only prompts no
        row holds, mostly one). [] when every request fits the first batch (no refill)."""
        ec = self.engine_config
        if len(requests) <= ec.max_slots:
            return []
        S = self.cache_len_for(requests, sampling)
        B = bucket(ec.max_slots, ec.batch_buckets)
        out = set()
        for L in {len(r.prompt_ids) for r in requests}:
            lay = scheduler.prefill_layout([(0,) * L], ec.batch_buckets, ec.min_prompt_bucket,
                                           S, packed_batch=B)
            out.add((B, lay.N, lay.T))
        return sorted(out)

    def precompile(self, requests: Sequence[Request], sampling: SamplingParams,
                   drafting: bool, params: Params | None = None,
                   max_programs: int = 64, feature_layers: tuple = ()) -> int:
        """Compiles (without running) the packed verify programs of `verify_shapes` (without
        drafting and with `decode_steps` > 1: the multi-step decode programs of those shapes), at
        most `max_programs` of them (in that order), and the packed prefill of one prompt of each
        length among the requests (`refill_prefill_shapes`: the admissions of a running
        call), from abstract arguments (nothing is allocated). The time counts in `compile_s`
        of the running `generate` call. Does nothing for an engine on a mesh. Returns the
        number of programs compiled now (0 when all were compiled before). `feature_layers`:
        the blocks a draft model reads (the programs that also return them)."""
        if self.placement is not None:
            return 0
        params = self.params if params is None else params
        S = self.cache_len_for(requests, sampling)
        skey = sampling.static_key()
        dtype = jnp.dtype(params["embed"].dtype).name
        shapes = self.verify_shapes(requests, sampling, drafting)[:max_programs]
        refills = self.refill_prefill_shapes(requests, sampling)
        memo = (S, skey, dtype, tuple(shapes), tuple(refills), tuple(feature_layers))
        if memo in self._precompiled:
            return 0
        logits = self.engine_config.share_prompts
        k = self.engine_config.decode_steps
        top = bucket(min(len(requests), self.engine_config.max_slots),
                     self.engine_config.batch_buckets)
        pages = self.engine_config.paging(top, S)
        if not drafting and k > 1:   # plain decoding runs k steps per call (`step.decode_steps`)
            stop = tuple(sorted(self.limits(sampling).stop_ids))
            specs = [DecodeSpec(self.config, skey, B, N, k, S, kv, stop, dtype, pages)
                     for B, N, W, kv, _ in shapes]
        else:
            specs = [VerifySpec(self.config, skey, B, N, W, S, kv, dtype, pages,
                                tuple(feature_layers), R) for B, N, W, kv, R in shapes]
        specs += [PrefillSpec(self.config, skey, B, N, 1, T, S, dtype, logits, pages,
                              tuple(feature_layers)) for B, N, T in refills]
        n = self.programs.precompile(specs, params)
        self._precompiled.add(memo)
        return n

    def step_shape(self, batch: int, kv_len: int, widths: Sequence[int] | None = None):
        """`step_shape(n_draft_B) -> (num_tokens, attended_kv)` of this engine's verify step at
        batch bucket `batch` and attended length `kv_len`, for per-row draft lengths of the live
        rows (the cost model's inputs)."""
        return step_shape_fn(batch, kv_len, widths or self.engine_config.draft_widths,
                             wide_buckets=self.engine_config.wide_row_buckets)

    def time_verify_step(self, batch: int, width: int, kv_len: int, cache_len: int,
                         repeats: int = 3, sampling_key: tuple = (1.0, 0, 1.0),
                         num_tokens: int | None = None, draft_model=None,
                         wide_rows: int = 0) -> float:
        """Median seconds of the packed verify step at (B, W, attended length), on dummy tokens.

        `num_tokens` slots (default `batch * width`, every row drafting `width - 1` tokens;
        fewer: the first rows get full width, the remaining slots go one per row, then padding,
        `VerifySpec.dummy`) with a query block of `width`; every row attends `kv_len` cached
        positions. Compiles the shape once (not timed; the executable is the one `generate`
        uses when `cache_len` and `sampling_key` = `SamplingParams.static_key()` match) and
        discards the first timed call (`Programs.time`). Used by the cost-model calibration and
        the engine benchmark. `draft_model`: a `step_io.DraftModel` (a draft head) run beside
        the steps as `generate` runs it: the step returns its features and each timed call
        includes the draft model's drafting on them (every row live). `wide_rows`: the split
        query block's R (`VerifySpec.wide_rows`; the full-width rows are then at most R).
        """
        params = self.place_params(self.params)
        N = batch * width if num_tokens is None else int(num_tokens)
        layers = tuple(draft_model.feature_layers) if draft_model is not None else ()
        spec = VerifySpec(self.config, tuple(sampling_key), batch, N, width, cache_len, kv_len,
                          jnp.dtype(params["embed"].dtype).name,
                          self.engine_config.paging(batch, cache_len), layers, wide_rows)
        if draft_model is None:
            return self.programs.time(spec, params, repeats)
        draft_model.start(self.programs, batch, cache_len, params)
        live_B = np.ones(batch, bool)

        def drafting(y_BxW, logp_BxW, n_emit_B, feats_BxWxFD):
            return draft_model.extend(live_B, feats_BxWxFD, y_BxW, n_emit_B, kv_len + width)
        try:
            return self.programs.time(spec, params, repeats, drafting)
        finally:
            draft_model.stop()

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        requests: Sequence[Request],
        sampling: SamplingParams,
        drafter=None,
        policy: SpeculationPolicy | None = None,
        params: Params | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[list[RequestOutput], GenerateStats]:
        """Generates every request with continuous batching and (optional) speculation: the host
        scheduler (`scheduler.run_schedule`) driving this engine's `DeviceExecutor`.

        Args:
          requests: the rollouts; outputs come back in the same order.
          sampling: `SamplingParams` shared by all requests.
          drafter: None (plain decoding) or an object implementing the Drafter protocol of
            `das_jax.drafter` (begin / propose / append / end). A drafter with a
            `draft_model` (a `step_io.DraftModel`, e.g. `das_jax.draft_head.HeadRuntime`) has
            it run on the device beside the policy's steps and gets its drafts each step
            (`set_model_drafts(request_ids_A, tokens_AxJ, probs_AxJ)`).
          policy: speculation policy (default `FixedPolicy()`, i.e. draft up to max width - 1).
          params: params to sample from (default: the engine's).
          progress: optional callback(finished_requests, total).

        Returns:
          (outputs, stats).

        Raises:
          GenerateError / SamplingError: bad input, before any compilation.
        """
        self.validate(requests, sampling)
        draft_model = getattr(drafter, "draft_model", None)
        executor = self.step_executor(requests, sampling, params, draft_model)
        compile_before = self.programs.compile_s
        t_start = time.perf_counter()
        if self.engine_config.precompile:
            self.precompile(requests, sampling, drafting=drafter is not None,
                            params=executor.params, feature_layers=executor.feature_layers)
        try:
            outputs, stats = scheduler.run_schedule(requests, executor, self.engine_config,
                                                    self.limits(sampling), drafter, policy,
                                                    progress)
        finally:
            if draft_model is not None:
                draft_model.stop()
        stats.compile_s = self.programs.compile_s - compile_before
        stats.wall_s = time.perf_counter() - t_start - stats.compile_s
        return outputs, stats

    def limits(self, sampling: SamplingParams) -> scheduler.Limits:
        """Where a request ends: max_new_tokens, or a stop token (the tokenizer's EOS ids and
        `sampling.stop_token_ids`)."""
        return scheduler.Limits(sampling.max_new_tokens,
                                frozenset(int(t) for t in self.eos_token_ids)
                                | frozenset(int(t) for t in sampling.stop_token_ids))

    def step_executor(self, requests: Sequence[Request], sampling: SamplingParams,
                      params: Params | None = None, draft_model=None) -> DeviceExecutor:
        """The `scheduler.StepExecutor` `generate` drives for these requests (for tools and tests
        that run `scheduler.run_schedule` themselves); params default to the engine's;
        `draft_model`: an optional `step_io.DraftModel` run beside the steps."""
        cls = PagedExecutor if self.engine_config.kv_cache == "paged" else DeviceExecutor
        return cls(self, requests, sampling,
                   self.place_params(self.params if params is None else params), draft_model)

