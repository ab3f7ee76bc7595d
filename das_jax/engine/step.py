"""The two jitted device functions of the engine: prefill-and-insert, and the verify step.

Both are pure functions of (params, KV cache, small int arrays). The cache is donated, so its
update is in place. Shapes are static per compiled variant:

* prefill (padded): `U` unique prompts padded to `T` tokens (a prompt-length bucket), inserted
  into `R` slots (GRPO's `num_generations` samples of one prompt share one prefill).
* prefill_packed (the default, `EngineConfig.prefill`): the unique prompts concatenated into N
  flat token slots (N a bucket of their total length), dense work on the N slots, attention
  within a prompt (`das_jax.models.packed.prefill_packed_hidden`); inserted into the B cache
  rows. Same first tokens and cache contents as the padded prefill.
* share_prompt_rows: admission of a request whose prompt a cache row already holds (a GRPO
  sibling admitted later than its group): a row copy and the first token sampled from the
  stored last-position logits, no forward pass.
* verify (padded): `tokens[B, W]`, W = 1 + draft width from a small compiled set, B from batch
  buckets, attending to the first `kv_len` cache positions (a bucket of the longest live row).
  Every row pays for the widest draft: dense work on B * W token rows.
* verify_packed (the engine's default): N flat token slots, each live row's pending token and its
  own drafts (`das_jax.models.packed`); dense work on N = a bucket of sum_b (1 + n_draft_b)
  slots, attention per row over its cache. Same sampling rule, same outputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from das_jax.engine import sampling as sampling_lib
from das_jax.models.config import ModelConfig
from das_jax.models.packed import (forward_packed_hidden, prefill_packed_hidden, slot_positions,
                                   to_rows)
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


@functools.partial(jax.jit, static_argnames=("config", "sampling_key", "rows", "width",
                                             "with_logits"),
                   donate_argnames=("cache",))
def prefill_packed(
    config: ModelConfig,
    sampling_key: tuple,
    rows: int,
    width: int,
    params: Params,
    cache: KVCache,
    tokens_N: jax.Array,
    row_N: jax.Array,
    offset_N: jax.Array,
    slots_B: jax.Array,
    src_B: jax.Array,
    last_B: jax.Array,
    lengths_B: jax.Array,
    seeds_B: jax.Array,
    with_logits: bool = False,
):
    """Packed prefill: the rule of `prefill_insert` on prompts concatenated into N flat slots.

    Args:
      rows: static attention-block rows U (>= the number of prompts; a batch bucket). The
        attention runs on a `[U, width]` block: its cost is the padded prefill's, and grows
        with the block's rows (blocks of all B cache rows were measured ~1.5x slower than the
        padded prefill on XLA CPU at B=16, U=4).
      width: static block width (>= the longest prompt; a prompt-length bucket).
      tokens_N, row_N, offset_N: int32 slot token, prompt index u (in [0, U); a value >= U marks
        a padding slot) and position in the prompt (`das_jax.engine.schedule.pack_prompts`).
      slots_B: int32 cache row each admitted request goes to (B: none, a padding entry).
      src_B: int32 prompt index u of each entry; last_B: int32 slot index of that prompt's last
        token; lengths_B: int32 its length (>= 1); seeds_B: int32 request seeds.
      with_logits: static; also return each entry's logits (for `share_prompt_rows`).

    Returns:
      (cache with each entry's prompt K/V in positions `[0, len)` of row `slots_B[j]`,
      first_tokens_B int32, first_logprobs_B float32[, logits_BxV float32 with_logits]);
      entry j's first token is sampled at absolute index lengths_B[j] from the logits of slot
      last_B[j], as in `prefill_insert`.
    """
    hidden_NxD, scratch = prefill_packed_hidden(config, params, tokens_N, row_N, offset_N,
                                                rows=rows, width=width, cache_dtype=cache.dtype)
    logits_BxV = lm_head(config, params, hidden_NxD[last_B][:, None])[:, 0]
    new_cache = cache.insert_rows(slots_B, scratch, src_B)
    tokens_B, logprobs_B = sampling_lib.sample(logits_BxV, seeds_B, lengths_B, sampling_key,
                                               config.contraction)
    if with_logits:
        return new_cache, tokens_B, logprobs_B, logits_BxV
    return new_cache, tokens_B, logprobs_B


@functools.partial(jax.jit, static_argnames=("config", "sampling_key"), donate_argnames=("cache",))
def share_prompt_rows(
    config: ModelConfig,
    sampling_key: tuple,
    cache: KVCache,
    dst_B: jax.Array,
    src_B: jax.Array,
    logits_BxV: jax.Array,
    seeds_B: jax.Array,
    lengths_B: jax.Array,
):
    """Admits requests whose prompt some cache row already holds, without a forward pass: copies
    row `src_B[j]` of the cache into row `dst_B[j]` (a value >= B: a padding entry, dropped;
    every row is read before any is written, so a row may be both a source and a destination)
    and samples each entry's first token from that prompt's last-position logits
    `logits_BxV[j]` (returned by the `prefill_packed` that computed the prompt) at absolute
    index lengths_B[j] with seed seeds_B[j]: the rule and the `[B, V]` shape of
    `prefill_packed`'s sampling, so the token is the one a prefill would sample from those
    logits.

    Returns:
      (cache, first_tokens_B int32, first_logprobs_B float32).
    """
    new_cache = cache.insert_rows(dst_B, cache, src_B)
    tokens_B, logprobs_B = sampling_lib.sample(logits_BxV, seeds_B, lengths_B, sampling_key,
                                               config.contraction)
    return new_cache, tokens_B, logprobs_B


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
    return cache, y_BxW, logp_BxW, _emitted(tokens_BxW, y_BxW, n_draft_B)


def _emitted(tokens_BxW, y_BxW, n_draft_B):
    """int32 `[B]` tokens emitted per row: 1 + the accepted drafts (d_j accepted while
    d_j == y_{j-1} for every j' <= j <= n_draft)."""
    B, W = tokens_BxW.shape
    if W == 1:
        return jnp.ones((B,), jnp.int32)
    match_Bx = (tokens_BxW[:, 1:] == y_BxW[:, :-1]) & (
        jnp.arange(1, W)[None, :] <= n_draft_B[:, None])
    n_acc_B = jnp.sum(jnp.cumprod(match_Bx.astype(jnp.int32), axis=1), axis=1)
    return (n_acc_B + 1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "sampling_key", "kv_len", "width"),
                   donate_argnames=("cache",))
def verify_packed(
    config: ModelConfig,
    sampling_key: tuple,
    kv_len: int,
    width: int,
    params: Params,
    cache: KVCache,
    cache_len_B: jax.Array,
    tokens_N: jax.Array,
    row_N: jax.Array,
    offset_N: jax.Array,
    n_draft_B: jax.Array,
    seeds_B: jax.Array,
):
    """The packed speculative decode step: the rule of `verify` on N flat token slots.

    Row b's slots are its pending token (offset 0) and its own draft tokens d_1..d_{n_draft_B[b]}
    (offsets 1..n_draft_B[b]); rows have different draft lengths and no padding to a shared
    width (`das_jax.models.packed`). At every slot the target token for the next absolute index
    is sampled with the position-keyed rule; acceptance and emission are those of `verify`.

    Args:
      kv_len: static attended-length bucket (>= every live row's cache_len).
      width: static query-block width W >= 1 + max_b n_draft_B[b] (a compiled draft width).
      tokens_N, row_N, offset_N: int32 slot token, cache row (>= B: a padding slot) and offset in
        the row; N is a compiled slot bucket >= sum_b (1 + n_draft_B[b]).
      cache_len_B, n_draft_B, seeds_B: int32 per cache row (rows without slots: anything).

    Returns:
      (cache, y_BxW int32, logprobs_BxW float32, n_emit_B int32), laid out as `verify`'s: row b's
      column i is slot (b, i); columns past a row's slots, and rows without slots, are garbage.
    """
    B = cache.batch
    pos_N = slot_positions(cache_len_B, row_N, offset_N)
    hidden_NxD, cache = forward_packed_hidden(config, params, tokens_N, row_N, offset_N, cache,
                                              cache_len_B, width=width, kv_len=kv_len)
    logits_NxV = lm_head(config, params, hidden_NxD[None])[0]
    y_N, logp_N = sampling_lib.sample(logits_NxV, seeds_B[jnp.minimum(row_N, B - 1)], pos_N + 1,
                                      sampling_key, config.contraction)
    y_BxW = to_rows(y_N, row_N, offset_N, B, width)
    logp_BxW = to_rows(logp_N, row_N, offset_N, B, width)
    tokens_BxW = to_rows(tokens_N, row_N, offset_N, B, width)
    return cache, y_BxW, logp_BxW, _emitted(tokens_BxW, y_BxW, n_draft_B)


@jax.jit
def gather_rows(cache: KVCache, rows_B: jax.Array) -> KVCache:
    """A cache of `len(rows_B)` rows taken from `cache` (compaction into a smaller bucket).

    rows_B may repeat (padding rows).
    """
    return cache.gather_rows(rows_B)
