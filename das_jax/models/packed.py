"""The packed forward over the KV cache: N token slots of ragged rows in one flat buffer.

A packed step holds, for each live cache row b, its `w_b` new tokens (the pending token and its
own draft tokens) as consecutive slots of a flat buffer of N slots, with per-slot row index and
offset in the row (0 = the pending token, at absolute position `cache_len[b]`). N is a bucket of
`sum_b w_b`, never `B * max_b w_b`.

Design:

* Dense work on `[N, D]`: embedding, q/k/v and output projections, MLP, final norm (and the
  caller's lm_head and sampling) run on the N slots only, so a row that speculates does not tax
  the rows that do not.
* Attention per row: the slots' queries, keys and values are scattered into a `[B, W]` query
  block (W = the step's widest row, a small compiled set) and attend with
  `decode_attention.attend_cache`, which reads each row's attended cache view once (one read per
  row for all of its queries, which is what matters while attention is memory-bound: decode on a
  GPU, long contexts) and writes no concatenation. The block costs `B * W` query rows of
  attention arithmetic; the alternative, attention on the flat slots with each slot gathering its
  row's cache, would read a row's cache once per slot (`N * kv` bytes instead of `B * kv`), the
  wrong trade for memory-bound attention. Results are gathered back to the N slots.
* Split query block (`wide_rows` R, 0 < R < B): when only a few rows draft, the block is two:
  `[B, 1]` for every row's pending token and `[R, W]` for the R drafting rows (their cache
  views gathered), so the arithmetic is `B + R * W` query rows instead of `B * W`; the
  drafting rows' caches are read twice. Where attention is compute-bound (long contexts on a
  CPU: at 768 cached positions a B = 16 step with one row drafting 7 costs 1.5x the step
  without drafts in one block, 1.2x split) this is much of a narrow step's price; on a GPU
  decode it costs the R rows' extra reads.
* Two-branch token tree (`branch_rows` R2 > 0): a row may hold a second draft (branch B) after
  its first (branch A): slots 0 (the pending token, the root), 1..a_b (branch A) and
  a_b + 1..a_b + m_b (branch B, depths 1..m_b), branch B's slot at depth d sitting at absolute
  position `cache_len[b] + d` like branch A's. The `[B, W]` block holds the root and branch A
  (causal, as a one-branch row); an `[R2, W]` block holds, for each of the (at most R2) rows
  with a branch B, the root's K/V at column 0 and branch B at columns 1..m_b, over the row's
  gathered cache view: each branch sees the cache, the root and its own earlier tokens, never
  the other branch, and each block is the one a row with only that draft would compute (so
  exact mode gives each branch the bits of a one-branch step). The caller writes the K/V
  (`defer_write`): the two branches share positions, so only the branch the step accepts may
  be stored (`engine.step.verify_packed`).
* The cache is written once per step after the layer loop: slot i's K/V at
  `(row_N[i], cache_len[row] + offset_N[i])` (`KVCache.write_slots`; with a tree: the slot's
  depth in place of its offset).
* Exact mode: every dense contraction is a `contraction.einsum` over the N slot rows (row-count
  invariant) and the attention is the same exact blocked attention as the padded path, so a
  packed step gives a row the same bits as a padded one.

Tensor names carry shapes: N slots, B cache rows, W query-block width, D model width.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from das_jax.models.config import ModelConfig
from das_jax.models.decode_attention import attend_cache
from das_jax.models.kv_cache import KVCache
from das_jax.models.layer_loop import run_layers, unrolled
from das_jax.models.paged_attention import PagedView
from das_jax.models.transformer import Params, decoder_layer, rms_norm


def slot_positions(cache_len_B: jax.Array, row_N: jax.Array, offset_N: jax.Array) -> jax.Array:
    """int32 `[N]` absolute position of each slot: `cache_len[row] + offset` (padding slots, row
    index >= B, get row B-1's length: they are never written or read)."""
    B = cache_len_B.shape[0]
    return cache_len_B[jnp.minimum(row_N, B - 1)] + offset_N


def to_rows(a_NxE: jax.Array, row_N: jax.Array, offset_N: jax.Array, batch: int, width: int,
            fill=0) -> jax.Array:
    """Scatters slot values `[N, ...]` into a `[B, W, ...]` block at (row, offset); positions
    without a slot hold `fill`; padding slots (row >= B or offset >= W) are dropped."""
    out = jnp.full((batch, width) + a_NxE.shape[1:], fill, a_NxE.dtype)
    return out.at[row_N, offset_N].set(a_NxE, mode="drop")


def to_slots(a_BxWxE: jax.Array, row_N: jax.Array, offset_N: jax.Array) -> jax.Array:
    """Gathers `[B, W, ...]` back to the slots `[N, ...]` (padding slots read a clipped cell)."""
    B, W = a_BxWxE.shape[:2]
    return a_BxWxE[jnp.minimum(row_N, B - 1), jnp.minimum(offset_N, W - 1)]


def view_rows(view, rows_R: jax.Array):
    """The attended cache view (`KVCache.attended`) of cache rows `rows_R` (int32 `[R]`, each
    `< B`): a dense view's rows gathered (a copy of R rows), a paged view's page-table rows."""
    if isinstance(view, PagedView):
        return dataclasses.replace(view, table_BxMP=view.table_BxMP[rows_R])
    k, v = view
    return k[rows_R], v[rows_R]


def tree_slots(row_N: jax.Array, offset_N: jax.Array, branch_at_B: jax.Array, n_alt_B: jax.Array,
               branch_rows: int):
    """The two-branch layout (module docstring): (depth_N int32 `[N]`, each slot's depth in its
    branch (the root 0); alt_N bool `[N]`, the slot is on branch B; rows_R int32 `[R2]`, the
    rows with a branch B (`n_alt_B > 0`) in ascending order, padded with B; arow_N int32 `[N]`,
    the slot's row in the `[R2, W]` block for a branch-B slot or the root of a row with one,
    R2 otherwise). `branch_at_B`: int32 `[B]` branch A's length a_b (branch B starts after
    it). More than R2 rows with a branch B is the caller's error."""
    B = branch_at_B.shape[0]
    rowc_N = jnp.minimum(row_N, B - 1)
    at_N = branch_at_B[rowc_N]
    alt_N = (row_N < B) & (offset_N > at_N)
    depth_N = jnp.where(alt_N, offset_N - at_N, offset_N)
    has_B = n_alt_B > 0
    rows_R = jnp.nonzero(has_B, size=branch_rows, fill_value=B)[0].astype(jnp.int32)
    pos_B = jnp.full((B,), branch_rows, jnp.int32).at[rows_R].set(
        jnp.arange(branch_rows, dtype=jnp.int32), mode="drop")
    in_N = (row_N < B) & (alt_N | (offset_N == 0))
    arow_N = jnp.where(in_N, pos_B[rowc_N], branch_rows)
    return depth_N, alt_N, rows_R, arow_N


def wide_slots(row_N: jax.Array, offset_N: jax.Array, batch: int, wide_rows: int):
    """The split query block's layout: (rows_R int32 `[R]`, the drafting rows -- rows with a
    slot at offset >= 1 -- in ascending order, padded with B; wrow_N int32 `[N]`, each slot's
    row in the `[R, W]` block, R for a slot of a row without drafts or a padding slot). More
    than R drafting rows is the caller's error: the rest would be computed as rows without
    drafts."""
    B, R = batch, wide_rows
    drafting_B = jnp.zeros((B,), jnp.int32).at[row_N].max(
        (offset_N > 0).astype(jnp.int32), mode="drop") > 0
    rows_R = jnp.nonzero(drafting_B, size=R, fill_value=B)[0].astype(jnp.int32)
    pos_B = jnp.full((B,), R, jnp.int32).at[rows_R].set(jnp.arange(R, dtype=jnp.int32),
                                                         mode="drop")
    wrow_N = jnp.where(row_N < B, pos_B[jnp.minimum(row_N, B - 1)], R)
    return rows_R, wrow_N


def forward_packed_hidden(
    config: ModelConfig,
    params: Params,
    tokens_N: jax.Array,
    row_N: jax.Array,
    offset_N: jax.Array,
    kv_cache: KVCache,
    cache_len_B: jax.Array,
    *,
    width: int,
    kv_len: int,
    feature_layers: tuple = (),
    wide_rows: int = 0,
    branch_rows: int = 0,
    branch_at_B: jax.Array | None = None,
    n_alt_B: jax.Array | None = None,
    defer_write: bool = False,
):
    """Runs the decoder stack on packed token slots against the KV cache.

    Args:
      config: static model config.
      params: params pytree (`das_jax.models.transformer`).
      tokens_N: int32 token of each slot.
      row_N: int32 cache row of each slot; a value >= B marks a padding slot (computed on, never
        written, its outputs meaningless).
      offset_N: int32 offset of the slot within its row's new tokens, in [0, width); a row's
        offsets must be 0..w_b-1 (each once). Slot i sits at absolute position
        `cache_len_B[row] + offset` and attends to the row's cached positions `< cache_len` and
        to the row's slots with offset `<= ` its own.
      kv_cache: the cache (`KVCache`), B rows.
      cache_len_B: int32 valid cached positions per row (<= kv_len).
      width: static query-block width W (>= every row's slot count).
      kv_len: static attended-length bucket (>= every live row's cache_len).
      feature_layers: optional static 0-based block indices whose outputs are also returned
        (a draft head's features, `das_jax.draft_head`; a block may be named more than once).
      wide_rows: static R; with 0 < R < B and width > 1 the attention runs as a `[B, 1]` block
        of the rows without drafts and a `[R, W]` block of the rows with drafts (at most R of
        them: rows with a slot at offset >= 1); 0 (or >= B): one `[B, W]` block.
      branch_rows: static R2 > 0: rows may hold a second draft (a two-branch token tree, module
        docstring): `branch_at_B` int32 `[B]` is each row's branch-A length a_b (its slots at
        offsets a_b + 1.. are branch B, at depths 1..), `n_alt_B` int32 `[B]` its branch-B
        length m_b (rows with m_b > 0: at most R2); width W >= 1 + a_b and >= 1 + m_b. Not
        combined with `wide_rows`.
      defer_write: return the new K/V instead of writing them: the second item is then
        `(k_LxNxKVHxK, v_LxNxKVHxK, pos_N)` for `kv_cache.write_slots` (a tree's caller writes
        only the accepted branch).

    Returns:
      (final-normed hidden `[N, D]` in the param dtype, the cache with every real slot's K/V
      written), and with `feature_layers` (F of them) a third item: float32 `[N, F * D]`, the
      named blocks' outputs concatenated in that order.

    Raises:
      ValueError: a block of `feature_layers` outside the model's; `branch_rows` with
        `wide_rows`, or without `branch_at_B` / `n_alt_B`.
    """
    B = kv_cache.batch
    R2 = int(branch_rows)
    if R2 and (wide_rows or branch_at_B is None or n_alt_B is None):
        raise ValueError("branch_rows needs branch_at_B and n_alt_B and excludes wide_rows")
    ones_N = jnp.ones(tokens_N.shape, bool)
    if R2:
        depth_N, alt_N, rows2_R, arow_N = tree_slots(row_N, offset_N, branch_at_B, n_alt_B, R2)
        pos_N = slot_positions(cache_len_B, row_N, depth_N)
        rows2c_R = jnp.minimum(rows2_R, B - 1)
        cache_len2_R = jnp.where(rows2_R < B, cache_len_B[rows2c_R], 0)
        mrow_N = jnp.where(alt_N, B, row_N)          # branch B is not in the [B, W] block
        brow_N = jnp.where(alt_N, arow_N, R2)         # branch-B slots of the [R2, W] block
        rrow_N = jnp.where(alt_N, R2, arow_N)         # roots placed at its column 0
        valid_BxW = to_rows(ones_N, mrow_N, offset_N, B, width, False)
        valid2_RxW = to_rows(ones_N, arow_N, depth_N, R2, width, False)
    else:
        pos_N = slot_positions(cache_len_B, row_N, offset_N)
        valid_BxW = to_rows(ones_N, row_N, offset_N, B, width, False)
    R = int(wide_rows) if 0 < wide_rows < B and width > 1 else 0
    if R:
        rows_R, wrow_N = wide_slots(row_N, offset_N, B, R)
        rows_c_R = jnp.minimum(rows_R, B - 1)
        cache_len_R = jnp.where(rows_R < B, cache_len_B[rows_c_R], 0)
        wide_N = wrow_N < R
        zero_N = jnp.zeros_like(offset_N)
        nrow_N = jnp.where(wide_N | (offset_N > 0), B, row_N)   # rows without drafts
        valid_Bx1 = to_rows(ones_N, nrow_N, zero_N, B, 1, False)
        valid_RxW = to_rows(ones_N, wrow_N, offset_N, R, width, False)
    x_1xNxD = params["embed"][tokens_N][None]
    inv_freq = config.rope_inv_freq()
    A = kv_cache.read_len(min(kv_len, kv_cache.max_len),
                          in_place=unrolled(params["layers"], config.layer_loop))

    hit_LxF = feature_hits(config.num_layers, feature_layers)

    def body(carry, inputs):
        x, feats_FxNxD = carry
        lp, (layer, hit_F) = inputs
        view = kv_cache.attended(layer, A)

        def attend(q_1xN, k_1xN, v_1xN):
            if R2:
                q, k, v = (to_rows(a[0], mrow_N, offset_N, B, width)
                           for a in (q_1xN, k_1xN, v_1xN))
                out_BxWxHxK = attend_cache(config, q, k, v, view, cache_len_B, valid_BxW, A)
                q2, k2, v2 = (to_rows(a[0], brow_N, depth_N, R2, width).at[rrow_N, 0].set(
                    a[0], mode="drop") for a in (q_1xN, k_1xN, v_1xN))
                out_RxWxHxK = attend_cache(config, q2, k2, v2, view_rows(view, rows2c_R),
                                           cache_len2_R, valid2_RxW, A)
                return jnp.where(alt_N[:, None, None],
                                 to_slots(out_RxWxHxK, arow_N, depth_N),
                                 to_slots(out_BxWxHxK, mrow_N, offset_N))[None]
            if not R:
                q, k, v = (to_rows(a[0], row_N, offset_N, B, width)
                           for a in (q_1xN, k_1xN, v_1xN))
                out_BxWxHxK = attend_cache(config, q, k, v, view, cache_len_B, valid_BxW, A)
                return to_slots(out_BxWxHxK, row_N, offset_N)[None]
            q, k, v = (to_rows(a[0], nrow_N, zero_N, B, 1) for a in (q_1xN, k_1xN, v_1xN))
            out_Bx1xHxK = attend_cache(config, q, k, v, view, cache_len_B, valid_Bx1, A)
            q, k, v = (to_rows(a[0], wrow_N, offset_N, R, width)
                       for a in (q_1xN, k_1xN, v_1xN))
            out_RxWxHxK = attend_cache(config, q, k, v, view_rows(view, rows_c_R),
                                       cache_len_R, valid_RxW, A)
            return jnp.where(wide_N[:, None, None], to_slots(out_RxWxHxK, wrow_N, offset_N),
                             to_slots(out_Bx1xHxK, nrow_N, zero_N))[None]
        x, k, v = decoder_layer(config, inv_freq, x, lp, pos_N[None], attend=attend)
        if feats_FxNxD is not None:
            feats_FxNxD = jnp.where(hit_F[:, None, None], x[0].astype(jnp.float32)[None],
                                    feats_FxNxD)
        return (x, feats_FxNxD), (k[0], v[0])

    F = len(feature_layers)
    feats0 = jnp.zeros((F,) + x_1xNxD.shape[1:], jnp.float32) if F else None
    (x_1xNxD, feats_FxNxD), (k_LxN, v_LxN) = run_layers(
        body, (x_1xNxD, feats0), params["layers"], (kv_cache.layers(), hit_LxF),
        config.layer_loop)
    new_cache = (k_LxN, v_LxN, pos_N) if defer_write else kv_cache.write_slots(
        k_LxN, v_LxN, row_N, pos_N)
    h = rms_norm(x_1xNxD, params["final_norm"], config.rms_norm_eps, config.contraction)
    if not F:
        return h[0], new_cache
    return h[0], new_cache, jnp.concatenate(list(feats_FxNxD), axis=-1)


def feature_hits(num_layers: int, feature_layers: tuple) -> jax.Array:
    """bool `[L, F]`: block l's output fills feature slot i (`forward_packed_hidden`).

    Raises:
      ValueError: a block outside 0..L-1."""
    hit = np.zeros((num_layers, len(feature_layers)), bool)
    for i, layer in enumerate(feature_layers):
        if not 0 <= layer < num_layers:
            raise ValueError(f"feature_layers {tuple(feature_layers)}: block {layer} is outside "
                             f"the model's {num_layers} blocks")
        hit[layer, i] = True
    return jnp.asarray(hit)


def prefill_packed_hidden(
    config: ModelConfig,
    params: Params,
    tokens_N: jax.Array,
    row_N: jax.Array,
    offset_N: jax.Array,
    *,
    rows: int,
    width: int,
    cache_dtype,
    feature_layers: tuple = (),
):
    """Packed prefill: runs the decoder stack on prompts concatenated into N flat slots.

    Prompt u's tokens are consecutive slots with row index u and offsets 0..len_u-1 (absolute
    positions: prompts start at position 0, no cached prefix). The dense work runs on `[N, D]`
    (N a bucket of `sum_u len_u`, not `rows x width`); attention is causal within a prompt only:
    the slots' q/k/v are scattered into a `[rows, width]` block and attend as in
    `forward_packed_hidden` with an empty cache (the same trade: attention arithmetic on the
    block, every prompt's keys read once). Exact mode gives the bits of the padded prefill
    (`forward_hidden` on `[U, T]`), since every dense contraction is row-count invariant and the
    attention is the same blocked attention at the same absolute positions.

    Args:
      config, params: the model.
      tokens_N: int32 token of each slot.
      row_N: int32 prompt (block row) of each slot, in [0, rows); a value >= rows marks a
        padding slot.
      offset_N: int32 position of the slot in its prompt, in [0, width).
      rows: static block rows (>= the number of prompts).
      width: static block width (>= the longest prompt).
      cache_dtype: dtype of the returned scratch cache.
      feature_layers: as `forward_packed_hidden`'s.

    Returns:
      (final-normed hidden `[N, D]`, a scratch `KVCache` of `rows` x `width` positions holding
      prompt u's K/V at row u, positions 0..len_u-1; other positions are zero), and with
      `feature_layers` the blocks' outputs float32 `[N, F * D]`.
    """
    scratch = KVCache.zeros(config, rows, width, cache_dtype)
    return forward_packed_hidden(config, params, tokens_N, row_N, offset_N, scratch,
                                 jnp.zeros((rows,), jnp.int32), width=width, kv_len=0,
                                 feature_layers=feature_layers)
