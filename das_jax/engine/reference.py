"""The padded engine steps: the tests' oracle for the packed programs, not an engine mode.

* `prefill_insert`: U unique prompts right-padded to T tokens (a prompt-length bucket), inserted
  into R cache rows; the packed prefill (`step.prefill_packed`) gives the same first tokens and
  cache contents.
* `verify`: `tokens[B, W]`, W = 1 + draft width, every row paying for the widest draft; the
  packed verify (`step.verify_packed`) gives the same tokens, log-probs and emitted counts.

Both are also programs (`PaddedPrefillSpec`, `PaddedVerifySpec`, registered with
`programs.register_program`), so `PaddedExecutor` runs whole generations through the engine's
scheduler with either padded step (`generate`), and `time_verify_padded` times the padded verify
at a shape (the engine benchmark's packed-vs-padded comparison).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.engine import sampling as sampling_lib
from das_jax.engine import scheduler
from das_jax.engine.executor import DeviceExecutor
from das_jax.engine.programs import register_program
from das_jax.engine.specs import OnCache, batch_pytree, int32_abstract
from das_jax.engine.step import emitted
from das_jax.models.config import ModelConfig
from das_jax.models.transformer import KVCache, Params, forward, forward_hidden, lm_head


@functools.partial(jax.jit, static_argnames=("config", "sampling_key"), donate_argnames=("cache",))
def prefill_insert(
    config: ModelConfig,
    sampling_key: tuple,
    params: Params,
    cache: KVCache,
    tokens_UxT: jax.Array,
    lengths_U: jax.Array,
    slots_R: jax.Array,
    src_R: jax.Array,
    seeds_R: jax.Array,
):
    """Prefills U prompts and writes their KV into R cache rows; samples each row's first token.

    Args:
      tokens_UxT: int32 right-padded prompts; lengths_U: int32 prompt lengths (>= 1).
      slots_R: int32 cache rows to fill (a row index >= B is dropped: padding of the R bucket).
      src_R: int32 index into U of the prompt each slot receives.
      seeds_R: int32 request seeds.

    Returns:
      (cache, first_tokens_R int32, first_logprobs_R float32 under the policy, see
      `sampling.sample`); the first token of slot r is
      sampled at absolute index lengths_U[src_R[r]].
    """
    U, T = tokens_UxT.shape
    positions_UxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (U, T))
    valid_UxT = positions_UxT < lengths_U[:, None]
    scratch = type(cache).zeros(config, U, T, cache.dtype)
    hidden, scratch = forward_hidden(config, params, tokens_UxT, positions_UxT, scratch,
                                     jnp.zeros((U,), jnp.int32), valid_BxT=valid_UxT, kv_len=0)
    last_Ux1xD = jnp.take_along_axis(hidden, (lengths_U - 1)[:, None, None], axis=1)
    logits_UxV = lm_head(config, params, last_Ux1xD)[:, 0]
    new_cache = cache.insert_rows(slots_R, scratch, src_R)
    tokens_R, logprobs_R = sampling_lib.sample(logits_UxV[src_R], seeds_R, lengths_U[src_R],
                                               sampling_key, config.contraction)
    return new_cache, tokens_R, logprobs_R


@functools.partial(jax.jit, static_argnames=("config", "sampling_key", "kv_len"),
                   donate_argnames=("cache",))
def verify(
    config: ModelConfig,
    sampling_key: tuple,
    kv_len: int,
    params: Params,
    cache: KVCache,
    cache_len_B: jax.Array,
    tokens_BxW: jax.Array,
    n_draft_B: jax.Array,
    seeds_B: jax.Array,
):
    """One speculative decode step: writes KV for `tokens_BxW`, samples, accepts, emits.

    Column 0 of `tokens_BxW` is each row's pending token (sampled last step, not yet in the
    cache); columns 1..n_draft_B[b] are draft tokens d_1..d_k, the rest padding. At every column
    i the target token y_i (for absolute index cache_len + i + 1) is sampled with the
    position-keyed rule. Draft d_j is accepted while d_j == y_{j-1} for all j' <= j; with n_acc
    accepted, the step emits y_0..y_{n_acc} (the accepted drafts and the correction or bonus token).
    Rejected positions are rolled back by the caller advancing cache_len by n_emit only.

    Returns:
      (cache, y_BxW int32, logprobs_BxW float32, n_emit_B int32 in [1, n_draft + 1]).
    """
    B, W = tokens_BxW.shape
    positions_BxW = cache_len_B[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]
    logits_BxWxV, cache = forward(config, params, tokens_BxW, positions_BxW, cache, cache_len_B,
                                  kv_len=kv_len)
    y_N, logp_N = sampling_lib.sample(
        logits_BxWxV.reshape(B * W, -1), jnp.repeat(seeds_B, W), (positions_BxW + 1).reshape(-1),
        sampling_key, config.contraction)
    y_BxW, logp_BxW = y_N.reshape(B, W), logp_N.reshape(B, W)
    return cache, y_BxW, logp_BxW, emitted(tokens_BxW, y_BxW, n_draft_B)



# ---------------------------------------------------------------------- the padded programs
@dataclasses.dataclass(frozen=True)
class PaddedVerifySpec(OnCache):
    """Static shape of the padded verify: `batch` rows x `width` columns, attended length
    `kv_len`, on a cache of `batch` rows x `cache_len` positions."""

    config: ModelConfig
    sampling_key: tuple
    batch: int
    width: int
    cache_len: int
    kv_len: int
    dtype: str

    def abstract(self, sharding=None) -> "PaddedVerifyBatch":
        B, W = self.batch, self.width
        return PaddedVerifyBatch(self, int32_abstract((B,), sharding),
                                 int32_abstract((B, W), sharding),
                                 int32_abstract((B,), sharding), int32_abstract((B,), sharding))

    def dummy(self) -> "PaddedVerifyBatch":
        """A timing batch: every row drafts `width - 1` tokens (token 7) and attends `kv_len`."""
        B, W = self.batch, self.width
        return PaddedVerifyBatch(self, np.full((B,), self.kv_len, np.int32),
                                 np.full((B, W), 7, np.int32), np.full((B,), W - 1, np.int32),
                                 np.arange(B, dtype=np.int32))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class PaddedVerifyBatch:
    """cache_len_B `[B]`, tokens_BxW (column 0 the pending token, then the drafts),
    n_draft_B `[B]`, seeds_B `[B]`; int32."""

    spec: PaddedVerifySpec
    cache_len_B: Any
    tokens_BxW: Any
    n_draft_B: Any
    seeds_B: Any


@dataclasses.dataclass(frozen=True)
class PaddedPrefillSpec(OnCache):
    """Static shape of the padded prefill: `rows` (U) prompts x `width` (T) tokens inserted
    into `inserts` (R) of the `batch` cache rows of `cache_len` positions."""

    config: ModelConfig
    sampling_key: tuple
    batch: int
    rows: int
    width: int
    inserts: int
    cache_len: int
    dtype: str

    def abstract(self, sharding=None) -> "PaddedPrefillBatch":
        U, T, R = self.rows, self.width, self.inserts
        return PaddedPrefillBatch(self, int32_abstract((U, T), sharding),
                                  int32_abstract((U,), sharding),
                                  *(int32_abstract((R,), sharding) for _ in range(3)))


@batch_pytree
@dataclasses.dataclass(frozen=True)
class PaddedPrefillBatch:
    """tokens_UxT (right-padded prompts), lengths_U, slots_R (>= B: dropped), src_R, seeds_R;
    int32."""

    spec: PaddedPrefillSpec
    tokens_UxT: Any
    lengths_U: Any
    slots_R: Any
    src_R: Any
    seeds_R: Any

    @classmethod
    def pack(cls, spec: PaddedPrefillSpec, prompts, src, rows, seeds) -> "PaddedPrefillBatch":
        U, T, R, B = spec.rows, spec.width, spec.inserts, spec.batch
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
        return cls(spec, toks_UxT, lens_U, slots_R, src_R, seeds_R)


@functools.partial(jax.jit, donate_argnames=("cache",))
def verify_program(params: Params, cache: KVCache, batch: PaddedVerifyBatch):
    """`verify` as a program (`fn(params, cache, batch)`)."""
    s = batch.spec
    return verify(s.config, s.sampling_key, s.kv_len, params, cache, batch.cache_len_B,
                  batch.tokens_BxW, batch.n_draft_B, batch.seeds_B)


@functools.partial(jax.jit, donate_argnames=("cache",))
def prefill_program(params: Params, cache: KVCache, batch: PaddedPrefillBatch):
    """`prefill_insert` as a program (`fn(params, cache, batch)`)."""
    s = batch.spec
    return prefill_insert(s.config, s.sampling_key, params, cache, batch.tokens_UxT,
                          batch.lengths_U, batch.slots_R, batch.src_R, batch.seeds_R)


register_program(PaddedVerifySpec, verify_program)
register_program(PaddedPrefillSpec, prefill_program)


# ---------------------------------------------------------------------- generation and timing
class PaddedExecutor(DeviceExecutor):
    """The engine's executor with the padded prefill (`padded_prefill`; prompt sharing off, as
    the padded prefill keeps no logits) and / or the padded verify (`padded_verify`)."""

    def __init__(self, engine, requests, sampling, params, padded_prefill: bool = True,
                 padded_verify: bool = True):
        super().__init__(engine, requests, sampling, params)
        self.padded_prefill = padded_prefill
        self.padded_verify = padded_verify
        self.share_prompts_supported = not padded_prefill

    def _compute(self, batch, take, rows, first, first_logp, where, with_logits) -> int:
        if not self.padded_prefill:
            return super()._compute(batch, take, rows, first, first_logp, where, with_logits)
        lay = self._layout(take, batch, packed=False)
        spec = PaddedPrefillSpec(self.config, self.skey, batch, lay.U, lay.T, lay.R, self.S,
                                 self.dtype)
        pb = PaddedPrefillBatch.pack(spec, lay.prompts, lay.src, rows, self.seeds[take])
        self.cache, first_R, first_logp_R = self.programs.run(self.params, self.cache, pb)
        first[where] = np.asarray(first_R)[:len(take)]
        first_logp[where] = np.asarray(first_logp_R)[:len(take)]
        return lay.tokens

    def _verify_batch(self, st: scheduler.StepInput):
        if not self.padded_verify:
            return super()._verify_batch(st)
        B, W = st.batch, st.width
        tokens_BxW = np.zeros((B, W), np.int32)
        tokens_BxW[:, 0] = self.pending
        K = st.drafts_AxK.shape[1]
        tokens_BxW[st.live, 1:1 + K] = st.drafts_AxK   # zeros past a row's draft
        spec = PaddedVerifySpec(self.config, self.skey, B, W, self.S, st.kv_len, self.dtype)
        return PaddedVerifyBatch(spec, st.cache_len_B, tokens_BxW, st.n_draft_B, self.row_seed)


def generate(engine, requests: Sequence, sampling: sampling_lib.SamplingParams, drafter=None,
             policy=None, padded_prefill: bool = True, padded_verify: bool = True):
    """`engine.generate(requests, sampling, drafter, policy)` with the padded steps: the same
    scheduler (`scheduler.run_schedule`) driving a `PaddedExecutor`. Returns (outputs, stats);
    stats.wall_s / compile_s are not set."""
    engine.validate(requests, sampling)
    executor = PaddedExecutor(engine, requests, sampling, engine.place_params(engine.params),
                              padded_prefill, padded_verify)
    return scheduler.run_schedule(requests, executor, engine.engine_config,
                                  engine.limits(sampling), drafter, policy)


def time_verify_padded(engine, batch: int, width: int, kv_len: int, cache_len: int,
                       repeats: int = 3, sampling_key: tuple = (1.0, 0, 1.0)) -> float:
    """Median seconds of the padded verify at B x W (every row drafting W - 1 tokens) attending
    `kv_len` positions, as `Engine.time_verify_step` times the packed one."""
    params = engine.place_params(engine.params)
    spec = PaddedVerifySpec(engine.config, tuple(sampling_key), batch, width, cache_len, kv_len,
                            jnp.dtype(params["embed"].dtype).name)
    return engine.programs.time(spec, params, repeats)

