"""Continuous-batching generation with speculative verification: `Engine.generate`.

The host scheduler (`scheduler.run_schedule`: admission, slot refill, compaction, buckets,
per-row bookkeeping, stats; shared with the trace replay) drives this module's `DeviceExecutor`,
which runs `step.prefill_packed` and `step.verify_packed` (or the padded `step.prefill_insert` /
`step.verify`: `EngineConfig.prefill` / `verify`) on a donated KV cache and keeps each row's
pending token and seed.

* Slots: the cache has B rows, B a batch bucket (powers of two up to `max_slots`). Freed rows are
  refilled from the queue; when the queue is empty and the live rows fit a smaller bucket, they
  are compacted into it, so the long tail runs a small, cheap batch.
* Shapes: B from batch buckets; packed verify: N token slots from
  `schedule.verify_token_buckets` (N = B without drafts, else a bucket of sum_b (1 + n_draft_b)
  over the live rows) and a query block W from `draft_widths` (the step's longest row);
  padded verify: B x W; the attended cache length from quarter-octave
  buckets of the longest live row, prompt lengths from power-of-two buckets. Each distinct shape is compiled
  once (ahead of time, timed separately as `compile_s`); with `EngineConfig(precompile=True)`
  the verify shapes a call can reach are compiled before its first step (`Engine.precompile`),
  so no compile lands inside a later call.
* Exactness: every token is sampled with the position-keyed rule of `sampling.py`, seeded by the
  request's own seed, so outputs do not depend on drafts, slots, buckets or batch neighbours
  (up to float rounding of the logits across shapes: see docs/design.md, "Exactness"; with
  `EngineConfig(exact=True)` the logits themselves are shape-invariant and outputs token-identical).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.engine import scheduler
from das_jax.engine import step as step_lib
from das_jax.engine.policy import SpeculationPolicy
from das_jax.engine.schedule import (PromptRows, bucket, cache_len_for, compact_rows,
                                     pack_prompts, step_shape_fn)
from das_jax.engine.scheduler import GenerateStats, RequestOutput
from das_jax.engine.sampling import SamplingError, SamplingParams, request_seed, validate_stop_ids
from das_jax.models.config import ModelConfig
from das_jax.models.transformer import KVCache, Params


class GenerateError(ValueError):
    """Bad generation input, raised before anything is compiled (names the request and the fix)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One rollout to generate.

    prompt_ids: token ids of the rendered prompt (non-empty).
    problem_id: the problem it samples (drafters share history per problem; seeds derive from it).
    sample_index: index within the problem's group (GRPO `num_generations`).
    seed: explicit request seed; default `request_seed(run seed, problem_id, sample_index)`.
    """

    prompt_ids: tuple[int, ...]
    problem_id: Hashable = 0
    sample_index: int = 0
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine settings.

    max_slots: most concurrent rows (largest batch bucket).
    max_cache_len: most positions per row (prompt + completion + draft width); the cache of one
      `generate` call is sized to what its requests need, up to this.
    draft_widths: compiled W values (1 + draft tokens); must contain 1.
    min_prompt_bucket: smallest prompt-length bucket.
    kv_memory_gb / kv_memory_fraction: KV-cache budget per device, in GB or as a fraction of the
      device's free memory when the engine is built (both None: no budget). The engine then runs
      `min(max_slots, rows of max_cache_len that fit)` slots (`Engine.slots`), and refuses to
      start (`GenerateError` naming `rollout.kv_memory_gb`) when not one row fits.
    exact: exact mode: every contraction and reduction feeding the logits is shape-invariant
      (`das_jax.models.contraction`), so rollouts are token-identical with and without
      speculation, whatever the batch bucket, width or attended length (README, "Exact mode").
    verify: "packed" (default: `step.verify_packed`, dense work on the live rows' own tokens,
      N = a bucket of sum_b (1 + n_draft_b)) or "padded" (`step.verify`, B x W token rows: every
      row pays the widest draft). Same tokens either way.
    prefill: "packed" (default: `step.prefill_packed`, the admitted unique prompts concatenated
      into N flat slots, N a bucket of their total length) or "padded" (`step.prefill_insert`,
      U prompts padded to a power-of-two length T). Same first tokens and cache contents.
    precompile: `generate` first compiles every packed verify program the call can reach
      (`Engine.precompile`), so a later call whose steps reach a shape for the first time does
      not compile inside its steps; off by default (tests with tiny models compile only what
      they run).
    share_prompts: with the packed prefill, a request whose prompt a cache row already holds
      (its K/V in positions `[0, len)`: a sibling still running, or a finished row not yet
      overwritten) is admitted by copying that row and sampling its first token from the
      prompt's stored last-position logits (`step.share_prompt_rows`), not by a prefill: GRPO's
      `num_generations` samples of a prompt admitted at different steps compute it once.
      Same first tokens (the same logits, seed and position).
    """

    max_slots: int = 16
    max_cache_len: int = 2048
    draft_widths: tuple[int, ...] = (1, 4, 8)
    min_prompt_bucket: int = 16
    kv_memory_gb: float | None = None
    kv_memory_fraction: float | None = None
    exact: bool = False
    verify: str = "packed"
    prefill: str = "packed"
    precompile: bool = False
    share_prompts: bool = True

    def __post_init__(self):
        if self.verify not in ("packed", "padded"):
            raise GenerateError(f"verify must be 'packed' or 'padded', got {self.verify!r}")
        if self.prefill not in ("packed", "padded"):
            raise GenerateError(f"prefill must be 'packed' or 'padded', got {self.prefill!r}")
        if self.max_slots < 1:
            raise GenerateError(f"max_slots must be >= 1, got {self.max_slots}")
        widths = tuple(sorted(set(int(w) for w in self.draft_widths)))
        if not widths or widths[0] != 1:
            raise GenerateError(f"draft_widths must include 1 (plain decoding), got "
                                f"{self.draft_widths}")
        object.__setattr__(self, "draft_widths", widths)

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        out, b = [], 1
        while b < self.max_slots:
            out.append(b)
            b *= 2
        return tuple(out) + (self.max_slots,)


_COMPILED_EXECUTABLES: dict[tuple, Any] = {}


class _Compiled:
    """Ahead-of-time compiled variants, keyed by static shape; time spent compiling is counted.

    The executables are shared by every engine of the process (`_COMPILED_EXECUTABLES`): the key
    holds the model config, the param dtype and every static shape, never the param values; an
    engine placed on a device (`Engine(device=...)`) adds the device to the key, since an
    executable only accepts arguments on the device it was compiled for; an engine on a mesh
    (`Engine(mesh=...)`) adds its devices and compiles with the mesh's shardings at the jit
    boundary (`placement.MeshPlacement.compile`).
    """

    def __init__(self, device: jax.Device | None = None, placement=None):
        self._cache = _COMPILED_EXECUTABLES
        self._device_key = None if device is None else (device.platform, device.id)
        self._placement = placement
        if placement is not None:
            self._device_key = placement.key
        self.compile_s = 0.0

    def get(self, key: tuple, fn, *args, **static):
        if self._device_key is not None:
            key = key + (self._device_key,)
        compiled = self._cache.get(key)
        if compiled is None:
            t0 = time.perf_counter()
            if self._placement is not None:
                compiled = self._placement.compile(fn, args, **static)
            else:
                compiled = fn.lower(*args, **static).compile()
            self.compile_s += time.perf_counter() - t0
            self._cache[key] = compiled
        return compiled


def _dummy_slots(batch: int, width: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(row_N, offset_N) of `num_tokens` timing slots: full-width rows first, then one slot per
    remaining row, then padding (row index = batch)."""
    rows, offs = [], []
    full = max(0, min(batch, (num_tokens - batch) // max(width - 1, 1))) if width > 1 else 0
    for b in range(batch):
        w = width if b < full else 1
        for o in range(w):
            if len(rows) < num_tokens:
                rows.append(b)
                offs.append(o)
    rows += [batch] * (num_tokens - len(rows))
    offs += [0] * (num_tokens - len(offs))
    return np.asarray(rows, np.int32), np.asarray(offs, np.int32)


def device_free_bytes(device: jax.Device | None = None) -> int | None:
    """Free memory of `device` (default: the first device) in bytes: `bytes_limit - bytes_in_use`
    of its allocator, or the host's available memory for a CPU device; None when unknown."""
    device = device or jax.devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without allocator stats
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        import os
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def size_slots(config: ModelConfig, ec: "EngineConfig", dtype, device=None,
               kv_shards: int = 1) -> "EngineConfig":
    """`ec` with `max_slots` lowered to the rows of `max_cache_len` positions that fit the KV
    budget (`EngineConfig.kv_memory_gb`, else `kv_memory_fraction` of the free device memory).
    `kv_shards`: devices one row's KV is split over (tensor parallelism over KV heads), so a
    row takes 1/kv_shards of its bytes on each device.

    Raises:
      GenerateError: not one row fits; names `rollout.kv_memory_gb` / `rollout.max_cache_len`.
    """
    if ec.kv_memory_gb is not None:
        budget, source = int(ec.kv_memory_gb * 1e9), f"rollout.kv_memory_gb={ec.kv_memory_gb}"
    elif ec.kv_memory_fraction is not None:
        free = device_free_bytes(device)
        if free is None:
            return ec
        budget = int(ec.kv_memory_fraction * free)
        source = (f"rollout.kv_memory_fraction={ec.kv_memory_fraction} of {free / 1e9:.2f} GB "
                  "free device memory")
    else:
        return ec
    per_row = -(-KVCache.nbytes_for(config, 1, ec.max_cache_len, dtype) // kv_shards)
    rows = budget // per_row
    if rows < 1:
        raise GenerateError(
            f"the KV cache needs {per_row / 1e9:.3f} GB per row (max_cache_len={ec.max_cache_len}"
            f" positions) but the budget is {budget / 1e9:.3f} GB ({source}); raise "
            "rollout.kv_memory_gb or lower rollout.max_cache_len")
    if rows >= ec.max_slots:
        return ec
    return dataclasses.replace(ec, max_slots=int(rows))


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
            from das_jax.models.contraction import EXACT
            config = dataclasses.replace(config, contraction=EXACT)
        if device is not None and mesh is not None:
            raise GenerateError("give an Engine a device or a mesh, not both")
        self.config = config
        self.device = device
        self.mesh = mesh
        if mesh is not None:
            from das_jax.engine.placement import MeshPlacement
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
        self._compiled = _Compiled(device, self.placement)
        self._precompiled: set = set()    # precompile calls done (their shapes)

    def place_params(self, params: Params) -> Params:
        """`params` where this engine computes: on its mesh's shardings, its device, or as given
        (no copy when already there; device-to-device when on other devices)."""
        if self.placement is not None:
            return self.placement.put_params(params)
        if self.device is not None:
            return jax.device_put(params, self.device)
        return params

    def _zeros_cache(self, batch: int, cache_len: int, dtype):
        """An empty KV cache where this engine computes."""
        if self.placement is not None:
            return self.placement.zeros_cache(self.config, batch, cache_len, dtype)
        with (jax.default_device(self.device) if self.device is not None
              else contextlib.nullcontext()):
            return KVCache.zeros(self.config, batch, cache_len, dtype)

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
                    f"max_new_tokens, or raise max_cache_len")
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

    def _verify_executable(self, B: int, W: int, S: int, kv_len: int, skey: tuple, dtype: str,
                           args: tuple):
        """The compiled verify step for these shapes (compiled on first use, then shared)."""
        return self._compiled.get(("verify", B, W, S, kv_len, skey, self.config, dtype),
                                  step_lib.verify, *args)

    def _packed_executable(self, B: int, N: int, W: int, S: int, kv_len: int, skey: tuple,
                           dtype: str, args: tuple):
        """The compiled packed verify step for these shapes (compiled on first use, shared)."""
        return self._compiled.get(("verify_packed", B, N, W, S, kv_len, skey, self.config, dtype),
                                  step_lib.verify_packed, *args)

    def _prefill_packed(self, params, cache, skey, dtype, S, T, prompts, src, rows, seeds,
                        with_logits: bool = False):
        """Runs `step.prefill_packed` (compiled per cache batch, cache length, slot bucket N,
        attention block U x T: prompts and prompt-length buckets); returns (cache, first tokens,
        first log-probs[, logits with_logits]) per admitted row."""
        N, arrays = pack_prompts(prompts, src, rows, seeds, cache.batch, T)
        U = bucket(len(prompts), self.engine_config.batch_buckets)
        args = (self.config, skey, U, T, params, cache) + arrays
        fn = self._compiled.get(("prefill_packed", cache.batch, S, N, U, T, skey, self.config,
                                 dtype) + (("logits",) if with_logits else ()),
                                step_lib.prefill_packed, *args, with_logits=with_logits)
        return fn(*args[4:])

    def _prefill_padded(self, params, cache, skey, dtype, S, T, prompts, src, rows, seeds):
        """Runs `step.prefill_insert`: U unique prompts padded to T tokens, inserted into R rows
        (U, R batch buckets); returns (cache, first tokens, first log-probs) per admitted row."""
        ec, B = self.engine_config, cache.batch
        U = bucket(len(prompts), ec.batch_buckets)
        R = bucket(len(rows), ec.batch_buckets)
        toks_UxT = np.zeros((U, T), np.int32)
        lens_U = np.ones(U, np.int32)
        for u, p in enumerate(prompts):
            toks_UxT[u, :len(p)] = p
            lens_U[u] = len(p)
        slots_R = np.full(R, B, np.int32)          # out of range: dropped
        slots_R[:len(rows)] = rows
        src_R = np.zeros(R, np.int32)
        src_R[:len(rows)] = src
        seeds_R = np.zeros(R, np.int32)
        seeds_R[:len(rows)] = seeds
        args = (self.config, skey, params, cache, toks_UxT, lens_U, slots_R, src_R, seeds_R)
        fn = self._compiled.get(("prefill", B, S, U, T, R, skey, self.config, dtype),
                                step_lib.prefill_insert, *args)
        return fn(*args[2:])

    def max_step_tokens(self, batch: int) -> int:
        """The largest packed slot bucket at this batch bucket: batch x the widest draft width."""
        return batch * max(self.engine_config.draft_widths)

    def verify_shapes(self, requests: Sequence[Request], sampling: SamplingParams,
                      drafting: bool) -> list[tuple[int, int, int, int]]:
        """The packed verify shapes (B, N, W, kv_len) `generate(requests, sampling)` can reach
        and `precompile` compiles: every batch bucket up to the call's first batch, every
        attended-length bucket its rows can reach (prompt lengths .. longest prompt +
        max_new_tokens), N = B with W = 1, and with `drafting`, for every width W > 1 of
        `draft_widths`, the slot buckets N of `schedule.precompile_token_buckets` with
        B < N <= B * W. Sorted by attended length, then batch (largest first). [] for the
        padded verify."""
        ec = self.engine_config
        if ec.verify != "packed":
            return []
        from das_jax.engine.schedule import kv_len_bucket, precompile_token_buckets
        S = self.cache_len_for(requests, sampling)
        lens = [len(r.prompt_ids) for r in requests]
        hi = max(lens) + max(sampling.max_new_tokens - 1, 0)
        kvs = sorted({kv_len_bucket(np.array([x]), S) for x in range(min(lens), hi + 1)})
        top = bucket(min(len(requests), ec.max_slots), ec.batch_buckets)
        wmax = max(ec.draft_widths)
        out = []
        for kv in kvs:
            for B in sorted((b for b in ec.batch_buckets if b <= top), reverse=True):
                out.append((B, B, 1, kv))
                if drafting:
                    out.extend((B, N, W, kv) for W in ec.draft_widths if W > 1
                               for N in precompile_token_buckets(B, wmax) if B < N <= B * W)
        return list(dict.fromkeys(out))

    def refill_prefill_shapes(self, requests: Sequence[Request], sampling: SamplingParams
                              ) -> list[tuple[int, int, int]]:
        """(B, N, T) of the packed prefill admitting one prompt into the call's first batch B,
        for each prompt length among the requests (N its slot bucket, T its length bucket):
        the refills of a running call (with `share_prompts`, a refill prefills only prompts no
        row holds, mostly one). [] for the padded prefill or when every request fits the first
        batch (no refill)."""
        ec = self.engine_config
        if ec.prefill != "packed" or len(requests) <= ec.max_slots:
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
                   max_programs: int = 64) -> int:
        """Compiles (without running) the packed verify programs of `verify_shapes`, at most
        `max_programs` of them (in that order), and the packed prefill of one prompt of each
        length among the requests (`refill_prefill_shapes`: the admissions of a running
        call), from abstract arguments (nothing is allocated). The time counts in `compile_s`
        of the running `generate` call. Does nothing for an engine on a mesh. Returns the
        number of programs compiled now (0 when all were compiled before)."""
        if self.placement is not None:
            return 0
        params = self.params if params is None else params
        S = self.cache_len_for(requests, sampling)
        skey = sampling.static_key()
        dtype = jnp.dtype(params["embed"].dtype)
        sharding = (jax.sharding.SingleDeviceSharding(self.device) if self.device is not None
                    else None)

        def abstract(x):
            return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding)

        shapes = self.verify_shapes(requests, sampling, drafting)[:max_programs]
        refills = self.refill_prefill_shapes(requests, sampling)
        memo = (S, skey, dtype.name, tuple(shapes), tuple(refills))
        if memo in self._precompiled:
            return 0
        params_abs = jax.tree_util.tree_map(abstract, params)

        def i32(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

        @functools.lru_cache(maxsize=None)
        def cache_abs(B):
            return jax.tree_util.tree_map(abstract, jax.eval_shape(
                lambda: KVCache.zeros(self.config, B, S, dtype)))

        before = len(self._compiled._cache)
        for B, N, W, kv in shapes:
            args = (self.config, skey, kv, W, params_abs, cache_abs(B), i32(B), i32(N), i32(N),
                    i32(N), i32(B), i32(B))
            self._packed_executable(B, N, W, S, kv, skey, dtype.name, args)
        logits = self.engine_config.share_prompts
        for B, N, T in refills:
            args = ((self.config, skey, 1, T, params_abs, cache_abs(B)) + (i32(N),) * 3
                    + (i32(B),) * 5)
            self._compiled.get(("prefill_packed", B, S, N, 1, T, skey, self.config, dtype.name)
                               + (("logits",) if logits else ()), step_lib.prefill_packed,
                               *args, with_logits=logits)
        self._precompiled.add(memo)
        return len(self._compiled._cache) - before

    def step_shape(self, batch: int, kv_len: int, widths: Sequence[int] | None = None):
        """`step_shape(n_draft_B) -> (num_tokens, attended_kv)` of this engine's verify step at
        batch bucket `batch` and attended length `kv_len`, for per-row draft lengths of the live
        rows (the cost model's inputs; `EngineConfig.verify` decides packed or padded)."""
        return step_shape_fn(self.engine_config.verify, batch, kv_len,
                             widths or self.engine_config.draft_widths)

    def time_verify_step(self, batch: int, width: int, kv_len: int, cache_len: int,
                         repeats: int = 3, sampling_key: tuple = (1.0, 0, 1.0),
                         num_tokens: int | None = None) -> float:
        """Median seconds of the verify step at (B, W, attended length), on dummy tokens.

        Packed (`EngineConfig.verify`): `num_tokens` slots (default `batch * width`, every row
        drafting `width - 1` tokens; fewer: the first rows get full width, the remaining slots
        go one per row, then padding) with a query block of `width`. Padded: B x W. Every row
        attends `kv_len` cached positions. Compiles the shape once (not timed; the executable
        is the one `generate` uses when `cache_len` and `sampling_key` =
        `SamplingParams.static_key()` match) and discards the first timed call. Used by the
        cost-model calibration and the engine benchmark.
        """
        params = self.place_params(self.params)
        dtype = jnp.dtype(params["embed"].dtype)
        cache = self._zeros_cache(batch, cache_len, dtype)
        skey = tuple(sampling_key)
        cache_len_B = np.full((batch,), kv_len, np.int32)
        seeds_B = np.arange(batch, dtype=np.int32)
        if self.engine_config.verify == "packed":
            N = batch * width if num_tokens is None else int(num_tokens)
            rows, offs = _dummy_slots(batch, width, N)
            n_draft_B = np.bincount(rows[rows < batch], minlength=batch).astype(np.int32) - 1
            args = (self.config, skey, kv_len, width, params, cache, cache_len_B,
                    np.full((N,), 7, np.int32), rows, offs, np.maximum(n_draft_B, 0), seeds_B)
            fn = self._packed_executable(batch, N, width, cache_len, kv_len, skey, dtype.name,
                                         args)
            rest = args[6:]
        else:
            args = (self.config, skey, kv_len, params, cache, cache_len_B,
                    np.full((batch, width), 7, np.int32), np.full((batch,), width - 1, np.int32),
                    seeds_B)
            fn = self._verify_executable(batch, width, cache_len, kv_len, skey, dtype.name, args)
            rest = args[5:]
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            cache, y, *_ = fn(params, cache, *rest)
            np.asarray(y)
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def _packed_args(self, B, W, N, kv_len, skey, params, cache, cache_len_B, pending_B, seeds_B,
                     live, drafts, n_draft_B) -> tuple:
        """Arguments of `step.verify_packed`: each live row's pending token then its drafts, as
        consecutive slots; the rest of the N slots are padding (row index B)."""
        tokens_N = np.zeros(N, np.int32)
        row_N = np.full(N, B, np.int32)
        offset_N = np.zeros(N, np.int32)
        i = 0
        for j, r in enumerate(live):
            k = len(drafts[j])
            tokens_N[i] = pending_B[r]
            tokens_N[i + 1:i + 1 + k] = drafts[j]
            row_N[i:i + 1 + k] = r
            offset_N[i:i + 1 + k] = np.arange(1 + k)
            i += 1 + k
        return (self.config, skey, kv_len, W, params, cache, cache_len_B, tokens_N, row_N,
                offset_N, n_draft_B, seeds_B)

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
            `das_jax.drafter` (begin / propose / append / end).
          policy: speculation policy (default `FixedPolicy()`, i.e. draft up to max width - 1).
          params: params to sample from (default: the engine's).
          progress: optional callback(finished_requests, total).

        Returns:
          (outputs, stats).

        Raises:
          GenerateError / SamplingError: bad input, before any compilation.
        """
        self.validate(requests, sampling)
        executor = self.step_executor(requests, sampling, params)
        compile_before = self._compiled.compile_s
        t_start = time.perf_counter()
        if self.engine_config.precompile:
            self.precompile(requests, sampling, drafting=drafter is not None,
                            params=executor.params)
        outputs, stats = scheduler.run_schedule(requests, executor, self.engine_config,
                                                self.limits(sampling), drafter, policy,
                                                progress)
        stats.compile_s = self._compiled.compile_s - compile_before
        stats.wall_s = time.perf_counter() - t_start - stats.compile_s
        return outputs, stats

    def limits(self, sampling: SamplingParams) -> scheduler.Limits:
        """Where a request ends: max_new_tokens, or a stop token (the tokenizer's EOS ids and
        `sampling.stop_token_ids`)."""
        return scheduler.Limits(sampling.max_new_tokens,
                                frozenset(int(t) for t in self.eos_token_ids)
                                | frozenset(int(t) for t in sampling.stop_token_ids))

    def step_executor(self, requests: Sequence[Request], sampling: SamplingParams,
                      params: Params | None = None) -> "DeviceExecutor":
        """The `scheduler.StepExecutor` `generate` drives for these requests (for tools and tests
        that run `scheduler.run_schedule` themselves); params default to the engine's."""
        return DeviceExecutor(self, requests, sampling,
                              self.place_params(self.params if params is None else params))


class DeviceExecutor:
    """The engine's `scheduler.StepExecutor`: jitted steps on a donated KV cache, timed with the
    real clock (compilation excluded: `Engine._compiled` counts it apart).

    It keeps the device side of every cache row: the KV cache `[B, S]`, the pending token (sampled,
    not yet fed) and the request seed per row. Prefill of the admitted prompts
    (`scheduler.prefill_layout`): `step.prefill_packed` (the prompts concatenated in N slots) or
    the padded `step.prefill_insert` (U x T), by `EngineConfig.prefill`; verify:
    `step.verify_packed` (N token slots) or the padded `step.verify` (B x W), by
    `EngineConfig.verify`; compaction: `step.gather_rows`.
    """

    def __init__(self, engine: Engine, requests: Sequence[Request], sampling: SamplingParams,
                 params: Params):
        self.engine = engine
        self.requests = requests
        self.params = params
        self.skey = sampling.static_key()
        self.dtype = jnp.dtype(params["embed"].dtype).name
        self.seeds = np.array([r.seed if r.seed is not None else
                               request_seed(sampling.seed, r.problem_id, r.sample_index)
                               for r in requests], np.int64).astype(np.int32)

    def start(self, batch: int, cache_len: int) -> None:
        self.S = cache_len
        self.cache = self.engine._zeros_cache(batch, cache_len, self.dtype)
        self.pending = np.zeros(batch, np.int32)       # sampled, not yet fed token per row
        self.row_seed = np.zeros(batch, np.int32)
        # Prompt sharing (EngineConfig.share_prompts): the prompt whose K/V each row holds in
        # positions [0, len), and each such prompt's last-position logits.
        self.prompt_rows = PromptRows(batch)
        self.prompt_logits: dict[tuple, np.ndarray] = {}

    def prefill(self, request_ids: Sequence[int], rows: np.ndarray,
                batch: int) -> scheduler.Prefilled:
        ec = self.engine.engine_config
        t0 = time.perf_counter()
        take, rows = list(request_ids), np.asarray(rows)
        prompts = [tuple(int(t) for t in self.requests[i].prompt_ids) for i in take]
        first = np.zeros(len(take), np.int32)
        first_logp = np.zeros(len(take), np.float32)
        share = ec.share_prompts and ec.prefill == "packed"
        shared, sources, computed = (self.prompt_rows.split(prompts) if share
                                     else ([], [], list(range(len(take)))))
        if shared:   # before the prefill: it may overwrite a source row
            self._share(batch, [take[k] for k in shared], rows[shared], sources,
                        [prompts[k] for k in shared], first, first_logp, shared)
        tokens = 0
        if computed:
            tokens = self._compute(batch, [take[k] for k in computed], rows[computed], first,
                                   first_logp, computed, share)
        for k, (ri, row) in enumerate(zip(take, rows)):
            self.pending[row] = first[k]
            self.row_seed[row] = self.seeds[ri]
        if share:
            self.prompt_rows.admit(rows, prompts)
            held = self.prompt_rows.held()
            self.prompt_logits = {p: v for p, v in self.prompt_logits.items() if p in held}
        return scheduler.Prefilled(first, first_logp, time.perf_counter() - t0, tokens)

    def _compute(self, batch, take, rows, first, first_logp, where, with_logits) -> int:
        """Prefills requests `take` into `rows`; writes their first tokens / log-probs at
        `where`; returns the token slots computed."""
        eng, ec, S = self.engine, self.engine.engine_config, self.S
        packed = ec.prefill == "packed"
        lay = scheduler.prefill_layout([self.requests[i].prompt_ids for i in take],
                                       ec.batch_buckets, ec.min_prompt_bucket, S,
                                       packed_batch=batch if packed else None)
        if packed:
            out = eng._prefill_packed(self.params, self.cache, self.skey, self.dtype, S, lay.T,
                                      lay.prompts, lay.src, rows, self.seeds[take],
                                      with_logits=with_logits)
        else:
            out = eng._prefill_padded(self.params, self.cache, self.skey, self.dtype, S, lay.T,
                                      lay.prompts, lay.src, rows, self.seeds[take])
        self.cache, first_R, first_logp_R = out[:3]
        first[where] = np.asarray(first_R)[:len(take)]
        first_logp[where] = np.asarray(first_logp_R)[:len(take)]
        if with_logits:
            logits = np.asarray(out[3])
            for k, u in enumerate(lay.src):
                self.prompt_logits.setdefault(lay.prompts[u], logits[k])
        return lay.tokens

    def _share(self, batch, take, rows, src_rows, prompts, first, first_logp, where) -> None:
        """Admits requests `take` into `rows` by copying cache rows `src_rows` (which hold their
        prompts) and sampling from the stored logits (`step.share_prompt_rows`)."""
        eng, B = self.engine, batch
        V = next(iter(self.prompt_logits.values())).shape[-1]
        dst_B = np.full(B, B, np.int32)
        src_B = np.zeros(B, np.int32)
        logits_BxV = np.zeros((B, V), np.float32)
        seeds_B = np.zeros(B, np.int32)
        lengths_B = np.ones(B, np.int32)
        k = len(take)
        dst_B[:k], src_B[:k], seeds_B[:k] = rows, src_rows, self.seeds[take]
        for j, p in enumerate(prompts):
            logits_BxV[j] = self.prompt_logits[p]
            lengths_B[j] = len(p)
        args = (eng.config, self.skey, self.cache, dst_B, src_B, logits_BxV, seeds_B, lengths_B)
        fn = eng._compiled.get(("share_prompt_rows", B, self.S, self.skey, eng.config,
                                self.dtype), step_lib.share_prompt_rows, *args)
        self.cache, tok_B, logp_B = fn(*args[2:])
        first[where] = np.asarray(tok_B)[:k]
        first_logp[where] = np.asarray(logp_B)[:k]

    def compact(self, live: np.ndarray, new_batch: int) -> None:
        eng, nb = self.engine, new_batch
        B = len(self.pending)
        rows_nb = np.zeros(nb, np.int32)
        rows_nb[:len(live)] = live
        fn = eng._compiled.get(("gather", B, nb, self.S, eng.config, self.dtype),
                               step_lib.gather_rows, self.cache, rows_nb)
        self.cache = fn(self.cache, rows_nb)
        self.pending, self.row_seed = compact_rows(live, nb, self.pending, 0, self.row_seed, 0)
        self.prompt_rows.compact(live, nb)

    def verify(self, st: scheduler.StepInput) -> scheduler.StepOutput:
        eng, skey, dtype = self.engine, self.skey, self.dtype
        B, W, live, kv_len = st.batch, st.width, st.live, st.kv_len
        compiled_before = eng._compiled.compile_s
        if eng.engine_config.verify == "packed":
            args = eng._packed_args(B, W, st.num_tokens, kv_len, skey, self.params, self.cache,
                                    st.cache_len_B, self.pending, self.row_seed, live, st.drafts,
                                    st.n_draft_B)
            fn = eng._packed_executable(B, st.num_tokens, W, self.S, kv_len, skey, dtype, args)
            run_args = args[4:]
        else:
            tokens_BxW = np.zeros((B, W), np.int32)
            tokens_BxW[:, 0] = self.pending
            for j, r in enumerate(live):
                tokens_BxW[r, 1:1 + len(st.drafts[j])] = st.drafts[j]
            args = (eng.config, skey, kv_len, self.params, self.cache, st.cache_len_B,
                    tokens_BxW, st.n_draft_B, self.row_seed)
            fn = eng._verify_executable(B, W, self.S, kv_len, skey, dtype, args)
            run_args = args[3:]
        t0 = time.perf_counter()
        self.cache, y_BxW, logp_BxW, n_emit_B = fn(*run_args)
        y_BxW, logp_BxW, n_emit_B = np.asarray(y_BxW), np.asarray(logp_BxW), np.asarray(n_emit_B)
        seconds = time.perf_counter() - t0
        tokens, logps = [], []
        for r in live:
            ne = int(n_emit_B[r])
            self.pending[r] = y_BxW[r, ne - 1]
            tokens.append(y_BxW[r, :ne])
            logps.append(logp_BxW[r, :ne])
        return scheduler.StepOutput(tokens, logps, seconds,
                                    compile_s=eng._compiled.compile_s - compiled_before)
