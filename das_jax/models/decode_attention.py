"""Attention of new tokens over a row's KV cache (decode, verify, prefill into a scratch cache).

`attend_cache(config, q, k_new, v_new, layer, cache_len_B, valid_BxT, kv_len)` computes, for T
new tokens per row, attention over the row's first `cache_len[b]` cached positions plus its own
new tokens up to and including itself (causal), the new tokens' K/V not yet in the cache.

Design (issue 12, "attention that reads each cached position once"):

* Write first, then attend. The attended view is the cache prefix `[0, A)` with
  `A = min(kv_len + T, S)` (one slice of the layer), and the new keys are scattered into that
  view at their absolute positions `cache_len[b] + t`; queries then attend over the one view with
  the mask `position <= own position` and `key written`. The previous code concatenated the
  attended cache with the new keys in every layer (a second copy of the whole attended cache per
  layer per step); the view here is the only copy, and XLA fuses the scatter into it. The cache
  itself is updated once per step after the layer loop (`KVCache.write` / `write_slots`), so no
  loop-carried cache buffer is needed (a scatter into a scanned-over cache slice would copy the
  full `[B, S]` layer every layer). A two-part softmax (cache part and new part merged by their
  log-sum-exp) would avoid even the scatter, but not the slice, and rules out
  `jax.nn.dot_product_attention`, which returns no log-sum-exp.
* The attention itself is `jax.nn.dot_product_attention` (implementation "xla": grouped-query
  einsums, f32 softmax; the cuDNN kernel takes no per-query mask of this form, and the engine's
  query blocks are small). The attended length is a static bucket (`engine.schedule.kv_len_bucket`:
  multiples of 128 up to 512, then quarter octaves), so a row reads close to the longest row's
  length, not the next power of two.
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
    keys_BxAxKVHxK = k_l.astype(dtype).at[rows_Bx1, cols_BxT].set(
        k_BxTxKVHxK.astype(dtype), mode="drop")
    values_BxAxKVHxK = v_l.astype(dtype).at[rows_Bx1, cols_BxT].set(
        v_BxTxKVHxK.astype(dtype), mode="drop")
    pos_A = jnp.arange(A, dtype=jnp.int32)
    key_ok_BxA = (pos_A[None, :] < cache_len_B[:, None]).at[rows_Bx1, cols_BxT].set(
        valid_BxT, mode="drop")
    mask_BxTxA = key_ok_BxA[:, None, :] & (pos_A[None, None, :] <= cols_BxT[:, :, None])
    return jax.nn.dot_product_attention(q_BxTxHxK, keys_BxAxKVHxK, values_BxAxKVHxK,
                                        mask=mask_BxTxA[:, None], implementation="xla")
