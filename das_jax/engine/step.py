"""The jitted device programs of the engine: each is `fn(params, cache, batch)`.

All are pure functions of (params, KV cache, a typed batch, `das_jax.engine.specs`); the batch's
static spec fixes every shape, so one spec is one compiled program
(`das_jax.engine.programs.Programs` compiles and runs them). The cache is donated, so its update is
in place (except by the compaction: its output is smaller, so XLA cannot write it over the
input and a donation would go unused; the memory plan counts both caches).

* prefill_packed: the unique admitted prompts concatenated into N flat token slots (N a bucket
  of their total length), dense work on the N slots, attention within a prompt
  (`das_jax.models.packed.prefill_packed_hidden`); inserted into the B cache rows.
* share_prompt_rows: admission of a request whose prompt a cache row already holds (a GRPO
  sibling admitted later than its group): a row copy and the first token sampled from the
  stored last-position logits, no forward pass.
* verify_packed: N flat token slots, each live row's pending token and its own drafts
  (`das_jax.models.packed`); dense work on N = a bucket of sum_b (1 + n_draft_b) slots,
  attention per row over its cache.
* share_prompt_pages: the same admission on the paged cache: the host shares the source row's
  full prompt pages, the program copies each partial last page and samples.
* decode_steps: up to k plain decode steps (no drafts) in one call, a `lax.while_loop` that
  stops rows at a stop token or their budget on the device, so the host sees the tokens once
  per k steps.
* gather_rows: the compaction of the live rows into a smaller batch bucket.

The padded variants (U prompts padded to T tokens; B x W verify rows) are the tests' oracle in
`das_jax.engine.reference`; they sample with the same rule and give the same outputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from das_jax.engine import sampling as sampling_lib
from das_jax.engine.specs import (DecodeBatch, GatherBatch, PrefillBatch, ShareBatch,
                                  SharePagesBatch, VerifyBatch)
from das_jax.models.packed import (forward_packed_hidden, prefill_packed_hidden, slot_positions,
                                   to_rows)
from das_jax.models.transformer import KVCache, Params, lm_head


@functools.partial(jax.jit, donate_argnames=("cache",))
def prefill_packed(params: Params, cache: KVCache, batch: PrefillBatch):
    """Packed prefill: prefills the U prompts concatenated in N flat slots and writes their KV
    into cache rows; samples each admitted entry's first token.

    The attention runs on a `[spec.rows, spec.width]` block (prompt u's tokens in block row u);
    entry j's prompt K/V goes to positions `[0, len)` of row `slots_B[j]` (a value >= B is
    dropped: padding), and its first token is sampled at absolute index `lengths_B[j]` from the
    logits of slot `last_B[j]`, with seed `seeds_B[j]`.

    Returns:
      (cache, first_tokens_B int32, first_logprobs_B float32 under the policy, see
      `sampling.sample`[, logits_BxV float32 when `spec.with_logits`][, feats_UxTxFD float32
      when `spec.feature_layers`: the named blocks' outputs at prompt u's positions, in block
      row u, `forward_packed_hidden`]).
    """
    spec = batch.spec
    config = spec.config
    out = prefill_packed_hidden(config, params, batch.tokens_N, batch.row_N, batch.offset_N,
                                rows=spec.rows, width=spec.width, cache_dtype=cache.dtype,
                                feature_layers=spec.feature_layers)
    hidden_NxD, scratch = out[:2]
    logits_BxV = lm_head(config, params, hidden_NxD[batch.last_B][:, None])[:, 0]
    new_cache = cache.insert_rows(batch.slots_B, scratch, batch.src_B)
    tokens_B, logprobs_B = sampling_lib.sample(logits_BxV, batch.seeds_B, batch.lengths_B,
                                               spec.sampling_key, config.contraction)
    result = (new_cache, tokens_B, logprobs_B)
    if spec.with_logits:
        result += (logits_BxV,)
    if spec.feature_layers:
        result += (to_rows(out[2], batch.row_N, batch.offset_N, spec.rows, spec.width),)
    return result


@functools.partial(jax.jit, donate_argnames=("cache",))
def share_prompt_rows(params: Params, cache: KVCache, batch: ShareBatch):
    """Admits requests whose prompt some cache row already holds, without a forward pass: copies
    positions `[0, spec.width)` of row `src_B[j]` into row `dst_B[j]` in place, entry by entry
    in order, with a one-row stash for cycles of rows (`save_B` / `from_stash_B`,
    `schedule.share_order`; a value >= B in `dst_B`: a padding entry, dropped), so the scratch is
    one row's prompt positions, never a second cache; and samples each entry's first token from
    that prompt's last-position logits `logits_BxV[j]` (returned by the `prefill_packed` that
    computed the prompt) at absolute index lengths_B[j] with seed seeds_B[j]: the rule and the
    `[B, V]` shape of `prefill_packed`'s sampling, so the token is the one a prefill would
    sample from those logits. `params` is not read (every program takes the same three
    arguments).

    Returns:
      (cache, first_tokens_B int32, first_logprobs_B float32).
    """
    del params
    spec = batch.spec
    new_cache = cache.copy_prefix(batch.dst_B, batch.src_B, batch.save_B, batch.from_stash_B,
                                  spec.width)
    tokens_B, logprobs_B = sampling_lib.sample(batch.logits_BxV, batch.seeds_B, batch.lengths_B,
                                               spec.sampling_key, spec.config.contraction)
    return new_cache, tokens_B, logprobs_B


@functools.partial(jax.jit, donate_argnames=("cache",))
def share_prompt_pages(params: Params, cache, batch: SharePagesBatch):
    """`share_prompt_rows` on the paged cache (`PagedKVCache`): the host has already pointed each
    admitted row at its source's full prompt pages (`pages.PagePool.share`); this copies each
    entry's partial last page (`src_pages_B[j]` onto `dst_pages_B[j]`; a destination >= the
    pool's pages: none) and samples each entry's first token from its prompt's last-position
    logits, as `share_prompt_rows` does. `params` is not read.

    Returns:
      (cache, first_tokens_B int32, first_logprobs_B float32).
    """
    del params
    spec = batch.spec
    new_cache = cache.copy_pages(batch.dst_pages_B, batch.src_pages_B)
    tokens_B, logprobs_B = sampling_lib.sample(batch.logits_BxV, batch.seeds_B, batch.lengths_B,
                                               spec.sampling_key, spec.config.contraction)
    return new_cache, tokens_B, logprobs_B


def emitted(tokens_BxW, y_BxW, n_draft_B):
    """int32 `[B]` tokens emitted per row: 1 + the accepted drafts (d_j accepted while
    d_j == y_{j-1} for every j' <= j <= n_draft)."""
    B, W = tokens_BxW.shape
    if W == 1:
        return jnp.ones((B,), jnp.int32)
    match_Bx = (tokens_BxW[:, 1:] == y_BxW[:, :-1]) & (
        jnp.arange(1, W)[None, :] <= n_draft_B[:, None])
    n_acc_B = jnp.sum(jnp.cumprod(match_Bx.astype(jnp.int32), axis=1), axis=1)
    return (n_acc_B + 1).astype(jnp.int32)


@functools.partial(jax.jit, donate_argnames=("cache",))
def verify_packed(params: Params, cache: KVCache, batch: VerifyBatch):
    """One speculative decode step on N flat token slots: writes KV for the slots, samples,
    accepts, emits.

    Row b's slots are its pending token (offset 0: sampled last step, not yet in the cache) and
    its own draft tokens d_1..d_{n_draft_B[b]} (offsets 1..n_draft_B[b]); rows have different
    draft lengths and no padding to a shared width (`das_jax.models.packed`). At every slot i
    the target token y_i (for absolute index cache_len + i + 1) is sampled with the
    position-keyed rule. Draft d_j is accepted while d_j == y_{j-1} for all j' <= j; with n_acc
    accepted, the step emits y_0..y_{n_acc} (the accepted drafts and the correction or bonus
    token). Rejected positions are rolled back by the caller advancing cache_len by n_emit only.
    Every row attends `spec.kv_len` cached positions (>= every live row's cache_len); the query
    block is `spec.width` >= 1 + max_b n_draft_B[b] (with `spec.wide_rows` R > 0: split into a
    `[B, 1]` block and an `[R, W]` block of the rows with drafts, at most R of them).

    Two-branch token tree (`spec.branch_rows` R2 > 0): row b's slots after its branch A
    (n_draft_B[b] drafts) are a second draft, branch B (batch.n_alt_B[b] drafts, at most R2
    rows with one), at the same positions: its draft e_j is accepted while e_j == y^B_{j-1}, the
    target sampled after the root and e_1..e_{j-1} (y^B_0 = y_0), by the same position-keyed
    rule. The branch with more accepted drafts wins (A on a tie) and the step emits its
    tokens, so the emitted tokens are those of a step that verified the winning draft alone:
    a tree changes which drafts are verified, never the sampled tokens. Only the root's and
    the winning branch's K/V are written.

    Returns:
      (cache, y_BxW int32, logprobs_BxW float32, n_emit_B int32 in [1, n_draft + 1]), W =
      `spec.width`: row b's column i is slot (b, i) (with a tree: the winning branch's depth-i
      slot, the root at 0); columns past a row's slots, and rows without slots, are garbage.
      With `spec.feature_layers` (F blocks) a fifth item: feats_BxWxFD float32, the blocks'
      outputs at each slot (the draft head's features of the positions the step commits,
      `das_jax.draft_head`). A tree's step always returns six items: the features (None
      without `spec.feature_layers`) and won_B bool `[B]`, the row emitted branch B.
    """
    spec = batch.spec
    if spec.branch_rows:
        return _verify_tree(params, cache, batch)
    config, B, width = spec.config, cache.batch, spec.width
    row_N, offset_N = batch.row_N, batch.offset_N
    pos_N = slot_positions(batch.cache_len_B, row_N, offset_N)
    out = forward_packed_hidden(config, params, batch.tokens_N, row_N, offset_N, cache,
                                batch.cache_len_B, width=width, kv_len=spec.kv_len,
                                feature_layers=spec.feature_layers, wide_rows=spec.wide_rows)
    hidden_NxD, cache = out[:2]
    logits_NxV = lm_head(config, params, hidden_NxD[None])[0]
    y_N, logp_N = sampling_lib.sample(logits_NxV, batch.seeds_B[jnp.minimum(row_N, B - 1)],
                                      pos_N + 1, spec.sampling_key, config.contraction)
    y_BxW = to_rows(y_N, row_N, offset_N, B, width)
    logp_BxW = to_rows(logp_N, row_N, offset_N, B, width)
    tokens_BxW = to_rows(batch.tokens_N, row_N, offset_N, B, width)
    result = (cache, y_BxW, logp_BxW, emitted(tokens_BxW, y_BxW, batch.n_draft_B))
    if spec.feature_layers:
        result += (to_rows(out[2], row_N, offset_N, B, width),)
    return result


def _verify_tree(params: Params, cache: KVCache, batch: VerifyBatch):
    """`verify_packed` of a two-branch token tree (its docstring)."""
    spec = batch.spec
    config, B, W = spec.config, cache.batch, spec.width
    Wt = 2 * W - 1                        # a row's slots: the root and both branches
    row_N, offset_N = batch.row_N, batch.offset_N
    n_a_B, n_b_B = batch.n_draft_B, batch.n_alt_B
    out = forward_packed_hidden(config, params, batch.tokens_N, row_N, offset_N, cache,
                                batch.cache_len_B, width=W, kv_len=spec.kv_len,
                                feature_layers=spec.feature_layers,
                                branch_rows=spec.branch_rows, branch_at_B=n_a_B,
                                n_alt_B=n_b_B, defer_write=True)
    hidden_NxD, (k_LxN, v_LxN, pos_N) = out[:2]
    logits_NxV = lm_head(config, params, hidden_NxD[None])[0]
    y_N, logp_N = sampling_lib.sample(logits_NxV, batch.seeds_B[jnp.minimum(row_N, B - 1)],
                                      pos_N + 1, spec.sampling_key, config.contraction)
    y_BxT, logp_BxT, tok_BxT = (to_rows(a, row_N, offset_N, B, Wt)
                                for a in (y_N, logp_N, batch.tokens_N))
    j = jnp.arange(1, W, dtype=jnp.int32)[None, :]                # depth of a draft token
    match_a = (tok_BxT[:, 1:W] == y_BxT[:, :W - 1]) & (j <= n_a_B[:, None])
    col_b = jnp.minimum(n_a_B[:, None] + j, Wt - 1)                # branch B's depth-j slot
    prev_b = jnp.where(j == 1, 0, col_b - 1)
    match_b = ((jnp.take_along_axis(tok_BxT, col_b, axis=1)
                == jnp.take_along_axis(y_BxT, prev_b, axis=1)) & (j <= n_b_B[:, None]))
    acc_a, acc_b = (jnp.sum(jnp.cumprod(m.astype(jnp.int32), axis=1), axis=1)
                    for m in (match_a, match_b))
    won_B = acc_b > acc_a
    n_emit_B = (jnp.maximum(acc_a, acc_b) + 1).astype(jnp.int32)
    col_BxW = jnp.concatenate(
        [jnp.zeros((B, 1), jnp.int32), jnp.where(won_B[:, None], col_b, j)], axis=1)
    pick = (lambda a_BxT: jnp.take_along_axis(
        a_BxT, col_BxW.reshape(col_BxW.shape + (1,) * (a_BxT.ndim - 2)), axis=1))
    rowc_N = jnp.minimum(row_N, B - 1)
    alt_N = offset_N > n_a_B[rowc_N]
    keep_N = (offset_N == 0) | (alt_N == won_B[rowc_N])
    cache = cache.write_slots(k_LxN, v_LxN, jnp.where(keep_N, row_N, B), pos_N)
    feats = pick(to_rows(out[2], row_N, offset_N, B, Wt)) if spec.feature_layers else None
    return cache, pick(y_BxT), pick(logp_BxT), n_emit_B, feats, won_B


@functools.partial(jax.jit, donate_argnames=("cache",))
def decode_steps(params: Params, cache: KVCache, batch: DecodeBatch):
    """Up to `spec.steps` plain decode steps of the live rows in one call, each the verify step
    of a row without drafts (`verify_packed` at width 1): feed the pending token, write its K/V,
    sample the next token with the position-keyed rule. A row stops once it has emitted a stop
    token (`spec.stop_ids`, included) or `budget_B` tokens; the loop ends when every row has
    stopped or after `spec.steps` steps. A stopped row's slot is still computed (its outputs
    dropped, its cache length frozen), so the tokens and log-probs are those of single steps.

    Returns:
      (cache, y_BxK int32, logprobs_BxK float32, n_emit_B int32): K = `spec.steps`; row b
      emitted y_BxK[b, :n_emit_B[b]] (its last token is pending: sampled, not in the cache);
      rows without a slot emit 0.
    """
    spec = batch.spec
    config, B, K = spec.config, cache.batch, spec.steps
    row_N = batch.row_N
    real_N = row_N < B
    row_c_N = jnp.minimum(row_N, B - 1)
    offset_N = jnp.zeros_like(row_N)
    stop = jnp.asarray(spec.stop_ids if spec.stop_ids else (-1,), jnp.int32)
    seeds_N = batch.seeds_B[row_c_N]
    budget_N = jnp.where(real_N, batch.budget_B[row_c_N], 0)

    def body(carry):
        i, cache, cache_len_B, tokens_N, n_N, done_N, y_BxK, logp_BxK = carry
        pos_N = slot_positions(cache_len_B, row_N, offset_N)
        hidden_NxD, cache = forward_packed_hidden(config, params, tokens_N, row_N, offset_N,
                                                  cache, cache_len_B, width=1,
                                                  kv_len=spec.kv_len)
        logits_NxV = lm_head(config, params, hidden_NxD[None])[0]
        y_N, logp_N = sampling_lib.sample(logits_NxV, seeds_N, pos_N + 1, spec.sampling_key,
                                          config.contraction)
        live_N = ~done_N
        rows_N = jnp.where(live_N, row_N, B)          # stopped rows' outputs are dropped
        y_BxK = y_BxK.at[rows_N, i].set(y_N, mode="drop")
        logp_BxK = logp_BxK.at[rows_N, i].set(logp_N, mode="drop")
        n_N = n_N + live_N.astype(jnp.int32)
        cache_len_B = cache_len_B.at[rows_N].add(1, mode="drop")
        done_N = done_N | jnp.isin(y_N, stop) | (n_N >= budget_N)
        return i + 1, cache, cache_len_B, jnp.where(live_N, y_N, tokens_N), n_N, done_N, \
            y_BxK, logp_BxK

    def cond(carry):
        return (carry[0] < K) & ~jnp.all(carry[5])

    N = row_N.shape[0]
    init = (jnp.int32(0), cache, batch.cache_len_B, batch.tokens_N, jnp.zeros((N,), jnp.int32),
            ~real_N | (budget_N <= 0), jnp.zeros((B, K), jnp.int32),
            jnp.zeros((B, K), jnp.float32))
    _, cache, _, _, n_N, _, y_BxK, logp_BxK = jax.lax.while_loop(cond, body, init)
    n_emit_B = jnp.zeros((B,), jnp.int32).at[row_N].set(n_N, mode="drop")
    return cache, y_BxK, logp_BxK, n_emit_B


@jax.jit
def gather_rows(params: Params, cache: KVCache, batch: GatherBatch) -> KVCache:
    """A cache of `spec.new_batch` rows taken from `cache` (compaction into a smaller bucket);
    `batch.rows` may repeat (padding rows). `params` is not read."""
    del params
    return cache.gather_rows(batch.rows)
