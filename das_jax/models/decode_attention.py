"""Attention of new tokens over a row's KV cache (decode, verify, prefill into a scratch cache).

`attend_cache(config, q, k_new, v_new, layer, cache_len_B, valid_BxT, kv_len)` computes, for T
new tokens per row, attention over the row's first `cache_len[b]` cached positions plus its own
new tokens up to and including itself (causal), the new tokens' K/V not yet in the cache.

Design (issue 12, "attention that reads each cached position once"):

* Write first, then attend. The attended view is the cache prefix `[0, A)` with
  `A = min(kv_len + T, S)` (one slice of the layer), and the new keys are placed into that
  view at their absolute positions `cache_len[b] + t`; queries then attend over the one view with
  the mask `position <= own position` and `key written`. The previous code concatenated the
  attended cache with the new keys in every layer (a second copy of the whole attended cache per
  layer per step). The placement is one elementwise select per new token (T is a draft width),
  which XLA fuses into the single pass that materialises the view; a scatter there was measured
  ~3x slower on XLA CPU. The cache itself is updated once per step after the layer loop
  (`KVCache.write` / `write_slots`), so no loop-carried cache buffer is needed (a scatter into a
  scanned-over cache slice would copy the full `[B, S]` layer every layer). Prefill into an
  empty scratch cache (`kv_len == 0`) attends over the new keys alone.
* The attention is a grouped-query einsum with an f32 softmax (`_grouped_attention`, the
  query heads of one KV head as an axis, so K/V are never repeated).
  `jax.nn.dot_product_attention(implementation="xla")` computes the same but vmaps over the
  query groups, and was measured ~5x slower for the whole SmolLM2-shaped step on XLA CPU; its
  cuDNN kernel takes no per-query mask of this form. The attended length is a static bucket
  (`engine.schedule.kv_len_bucket`: quarter octaves, multiples of 128 up to 1024), so a row
  reads close to the longest row's length, not the next power of two.
* Exact mode (`config.contraction.exact`) keeps its shape-invariant blocked attention
  (`contraction.cached_attention`, which places new keys at absolute positions the same way).

Tensor names carry shapes: B rows, T new tokens per row, S cache length, A attended length,
H query heads, KVH key/value heads, K head width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from das_jax.models import contraction as cx
from das_jax.models.config import ModelConfig

_MAX_SELECTS = 16   # new tokens placed by selects; more (a long prefix-extending T) by a scatter


def attended_length(kv_len: int, new_tokens: int, cache_max_len: int) -> int:
    """Positions of the write-first attended view: the `kv_len` bucket plus the new tokens,
    capped at the cache length (a real token's position is always below it)."""
    return min(kv_len + new_tokens, cache_max_len)


def attend_cache(config: ModelConfig, q_BxTxHxK: jax.Array, k_BxTxKVHxK: jax.Array,
                 v_BxTxKVHxK: jax.Array, view, cache_len_B: jax.Array, valid_BxT: jax.Array,
                 kv_len: int) -> jax.Array:
    """Attention of T new tokens per row over the row's cache and its own earlier new tokens.

    Args:
      config: model config (GQA groups; `contraction` selects fast or exact mode).
      q_BxTxHxK: post-RoPE queries; k_BxTxKVHxK, v_BxTxKVHxK: the new tokens' post-RoPE keys and
        values (token t of row b sits at absolute position `cache_len_B[b] + t`).
      view: this layer's attended cache view `(k, v)`, each `[B, A, KVH, K]` with
        `A = attended_length(kv_len, T, S)` (`KVCache.attended(layer, A)`).
      cache_len_B: int32 valid cached positions per row (all `< kv_len`).
      valid_BxT: bool, real new tokens (padding keys are never attended; padding queries give
        garbage the caller ignores).
      kv_len: static attended-length bucket (>= every `cache_len_B[b]`).

    Returns:
      `[B, T, H, K]` attention output in q's dtype (before the output projection).
    """
    k_l, v_l = view
    B, T = q_BxTxHxK.shape[:2]
    A = k_l.shape[1]
    cp = config.contraction
    if cp.exact:
        kv = min(kv_len, A)
        new_mask_BxTxT = jnp.tril(jnp.ones((T, T), bool))[None] & valid_BxT[:, None, :]
        old_mask_BxS = jnp.arange(kv)[None, :] < cache_len_B[:, None]
        mask_BxTxA = jnp.concatenate(
            [jnp.broadcast_to(old_mask_BxS[:, None, :], (B, T, kv)), new_mask_BxTxT], axis=-1)
        return cx.cached_attention(cp, q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK, k_l[:, :kv],
                                   v_l[:, :kv], mask_BxTxA)
    rows_Bx1 = jnp.arange(B)[:, None]
    cols_BxT = cache_len_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    dtype = q_BxTxHxK.dtype
    pos_A = jnp.arange(A, dtype=jnp.int32)
    if kv_len == 0:  # no cached prefix (prefill into a scratch cache): the view is the new keys
        keys_BxAxKVHxK, values_BxAxKVHxK = k_BxTxKVHxK.astype(dtype), v_BxTxKVHxK.astype(dtype)
        pos_T = jnp.arange(T, dtype=jnp.int32)
        mask_BxTxT = valid_BxT[:, None, :] & (pos_T[None, None, :] <= pos_T[None, :, None])
        return _grouped_attention(q_BxTxHxK, keys_BxAxKVHxK, values_BxAxKVHxK, mask_BxTxT)
    key_ok_BxA = pos_A[None, :] < cache_len_B[:, None]
    keys_BxAxKVHxK, values_BxAxKVHxK = k_l.astype(dtype), v_l.astype(dtype)
    if T > _MAX_SELECTS:
        keys_BxAxKVHxK = keys_BxAxKVHxK.at[rows_Bx1, cols_BxT].set(k_BxTxKVHxK.astype(dtype),
                                                                  mode="drop")
        values_BxAxKVHxK = values_BxAxKVHxK.at[rows_Bx1, cols_BxT].set(
            v_BxTxKVHxK.astype(dtype), mode="drop")
        key_ok_BxA = key_ok_BxA.at[rows_Bx1, cols_BxT].set(valid_BxT, mode="drop")
    for t in range(T if T <= _MAX_SELECTS else 0):
        # One select per new token (T is a draft width here): elementwise, fused by XLA into
        # one pass over the view; a scatter into the view was measured ~3x slower on XLA CPU.
        at_BxA = pos_A[None, :] == cols_BxT[:, t:t + 1]
        keys_BxAxKVHxK = jnp.where(at_BxA[:, :, None, None], k_BxTxKVHxK[:, t:t + 1].astype(dtype),
                                   keys_BxAxKVHxK)
        values_BxAxKVHxK = jnp.where(at_BxA[:, :, None, None],
                                     v_BxTxKVHxK[:, t:t + 1].astype(dtype), values_BxAxKVHxK)
        key_ok_BxA = jnp.where(at_BxA, valid_BxT[:, t:t + 1], key_ok_BxA)
    mask_BxTxA = key_ok_BxA[:, None, :] & (pos_A[None, None, :] <= cols_BxT[:, :, None])
    return _grouped_attention(q_BxTxHxK, keys_BxAxKVHxK, values_BxAxKVHxK, mask_BxTxA)


def _grouped_attention(q_BxTxHxK, k_BxAxKVHxK, v_BxAxKVHxK, mask_BxTxA):
    """Grouped-query attention `[B, T, H, K]` over keys `[B, A, KVH, K]` under a bool mask
    `[B, T, A]`: f32 scores and softmax, the query heads of a key/value head as one axis."""
    B, T, H, K = q_BxTxHxK.shape
    KVH = k_BxAxKVHxK.shape[2]
    q = q_BxTxHxK.reshape(B, T, KVH, H // KVH, K)
    scores = jnp.einsum("btngk,bsnk->bngts", q, k_BxAxKVHxK,
                        preferred_element_type=jnp.float32) * (K ** -0.5)
    scores = jnp.where(mask_BxTxA[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxAxKVHxK.dtype)
    out = jnp.einsum("bngts,bsnk->btngk", probs, v_BxAxKVHxK)
    return out.reshape(B, T, H, K)
