"""Attention of new tokens over a row's KV cache (decode, verify, prefill into a scratch cache).

`attend_cache(config, q, k_new, v_new, view, cache_len_B, valid_BxT, kv_len)` computes, for T
new tokens per row, attention over the row's first `cache_len[b]` cached positions plus its own
new tokens up to and including itself (causal), the new tokens' K/V not yet in the cache.

Design (attention that reads each cached position once):

* Two key blocks, one softmax. The scores of the queries against the cached prefix
  (`[B, KVH, G*T, A]`, A = the attended-length bucket) and against the row's own new keys
  (`[B, KVH, G*T, T]`) are computed separately and normalised together (one max and one
  denominator over both blocks, as in blockwise / flash attention: Milakov & Gimelshein 2018,
  Dao et al. 2022). The cached view is read once, by the two contractions, and never copied:
  the previous code placed the new keys into a copy of the attended view (a write and a second
  read of every cached position, per layer per step), and before that concatenated them. The
  cache itself is updated once per step after the layer loop (`KVCache.write` /
  `write_slots`), so no loop-carried cache buffer is needed.
* Head-major cache (`KVCache`: keys `[B, KVH, K, S]`, values `[B, KVH, S, K]` per layer):
  both contractions are batched matrix products over (row, KV head) with the G query heads of a
  KV head and the T new tokens as one M = G*T axis, `q [M, K] @ k [K, A]` and
  `p [M, A] @ v [A, K]`, so K/V are never repeated per query head and neither operand is
  contracted on a transposed axis (a transposed-key layout is slower on XLA CPU: the side-by-side
  comparison is in docs/results/engine.md). `jax.nn.dot_product_attention` computes the same but
  is slower for the whole step on XLA CPU (same page), and its cuDNN kernel takes no per-query
  mask of this form.
  The attended length is a static bucket (`engine.schedule.kv_len_bucket`: quarter octaves,
  multiples of 128 up to 1024), so a row reads close to the longest row's length, not the next
  power of two.
* Paged caches (`paged_attention.PagedView`): on TPU and CUDA a Pallas kernel reads each row's
  own pages and returns the cached block's flash-attention partial state (max, denominator,
  unnormalised output), merged here with the new keys' block; on other platforms the row's
  pages are gathered into the dense view above (the same step as on a dense cache).
* Exact mode (`config.contraction.exact`) keeps its shape-invariant blocked attention
  (`contraction.cached_attention`, which places new keys at absolute positions in its own
  padded copy of the view).

Tensor names carry shapes: B rows, T new tokens per row, A attended cache positions, H query
heads, KVH key/value heads, G = H / KVH, M = G * T, K head width.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from das_jax.models import contraction as cx
from das_jax.models.config import ModelConfig
from das_jax.models.paged_attention import PagedView

_MASK_VALUE = -1e30


def attend_cache(config: ModelConfig, q_BxTxHxK: jax.Array, k_BxTxKVHxK: jax.Array,
                 v_BxTxKVHxK: jax.Array, view, cache_len_B: jax.Array, valid_BxT: jax.Array,
                 kv_len: int) -> jax.Array:
    """Attention of T new tokens per row over the row's cache and its own earlier new tokens.

    Args:
      config: model config (GQA groups; `contraction` selects fast or exact mode).
      q_BxTxHxK: post-RoPE queries; k_BxTxKVHxK, v_BxTxKVHxK: the new tokens' post-RoPE keys and
        values (token t of row b sits at absolute position `cache_len_B[b] + t`).
      view: this layer's attended cache (`KVCache.attended(layer, A)`, `A = min(kv_len, S)`):
        a dense view `(k [B, KVH, K, A], v [B, KVH, A, K])`, or a paged cache's
        `paged_attention.PagedView`, read by its kernel ("auto": the Pallas kernel of the TPU
        or CUDA lowering, the gathered dense view elsewhere; exact mode always gathers;
        "pallas_gpu" / "pallas_tpu" by name: that kernel when lowered for its platform or
        interpreted, the gather elsewhere). Ignored
        when kv_len is 0.
      cache_len_B: int32 valid cached positions per row (all `<= kv_len`).
      valid_BxT: bool, real new tokens (padding keys are never attended; padding queries give
        garbage the caller ignores).
      kv_len: static attended-length bucket (>= every `cache_len_B[b]`); 0 for a prefill into
        an empty scratch cache (the new tokens attend to each other only).

    Returns:
      `[B, T, H, K]` attention output in q's dtype (before the output projection).
    """
    args = (q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK, cache_len_B, valid_BxT)
    if isinstance(view, PagedView):
        if kv_len == 0 or config.contraction.exact or view.kernel == "gather":
            return _attend_view(config, *args, view.dense(), kv_len)
        if view.kernel != "auto":   # a kernel by name: on its platform (or interpreted)
            if view.interpret:
                return _attend_pages(config, *args, view, view.kernel)
            platform = {"pallas_gpu": "cuda", "pallas_tpu": "tpu"}[view.kernel]
            return jax.lax.platform_dependent(
                *args, default=lambda *a: _attend_view(config, *a, view.dense(), kv_len),
                **{platform: lambda *a: _attend_pages(config, *a, view, view.kernel)})
        # The kernel of the platform the program is lowered for (only that branch is lowered).
        return jax.lax.platform_dependent(
            *args,
            default=lambda *a: _attend_view(config, *a, view.dense(), kv_len),
            tpu=lambda *a: _attend_pages(config, *a, view, "pallas_tpu"),
            cuda=lambda *a: _attend_pages(config, *a, view, "pallas_gpu"))
    return _attend_view(config, *args, view, kv_len)


def _new_block(q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK, valid_BxT):
    """Queries as `[B, KVH, M, K]` (M = T * G, token-major: row m is token m // G, head m % G)
    scaled by 1/sqrt(K), the masked scores against the row's own new keys
    `s_new [B, KVH, M, T]` (float32, causal) and the new values `[B, KVH, T, K]`."""
    B, T, H, K = q_BxTxHxK.shape
    KVH = k_BxTxKVHxK.shape[2]
    G = H // KVH
    dtype = q_BxTxHxK.dtype
    q_BxNxMxK = (q_BxTxHxK.reshape(B, T, KVH, G, K).transpose(0, 2, 1, 3, 4)
                 .reshape(B, KVH, T * G, K)) * jnp.asarray(K ** -0.5, dtype)
    k_new_BxNxTxK = k_BxTxKVHxK.astype(dtype).transpose(0, 2, 1, 3)
    v_new_BxNxTxK = v_BxTxKVHxK.astype(dtype).transpose(0, 2, 1, 3)
    tok_M = jnp.arange(T * G, dtype=jnp.int32) // G
    new_ok_BxMxT = ((jnp.arange(T, dtype=jnp.int32)[None, :] <= tok_M[:, None])[None]
                    & valid_BxT[:, None, :])
    s_new = jnp.einsum("bnmk,bnuk->bnmu", q_BxNxMxK, k_new_BxNxTxK,
                       preferred_element_type=jnp.float32)
    return q_BxNxMxK, jnp.where(new_ok_BxMxT[:, None], s_new, _MASK_VALUE), v_new_BxNxTxK


def _to_heads(out_BxNxMxK, T: int, dtype):
    B, KVH, M, K = out_BxNxMxK.shape
    G = M // T
    return (out_BxNxMxK.reshape(B, KVH, T, G, K).transpose(0, 2, 1, 3, 4)
            .reshape(B, T, KVH * G, K).astype(dtype))


def _attend_pages(config, q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK, cache_len_B, valid_BxT,
                  view: PagedView, kernel: str):
    """`attend_cache` on a paged view by a kernel's partial state of the cached block
    (`paged_attention.prefix_partials`), merged with the new keys' block: one max and one
    denominator over both (FlashAttention's rescaling, Dao et al. 2022, Alg. 1)."""
    dtype = q_BxTxHxK.dtype
    q_BxNxMxK, s_new, v_new_BxNxTxK = _new_block(q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK,
                                                 valid_BxT)
    o_old, m_old, l_old = view.partials(kernel, q_BxNxMxK, cache_len_B)
    m = jnp.maximum(m_old, s_new.max(-1))
    corr = jnp.exp(m_old - m)
    e_new = jnp.exp(s_new - m[..., None])
    den = corr * l_old + e_new.sum(-1)
    out = (corr[..., None] * o_old
           + jnp.einsum("bnmu,bnuk->bnmk", e_new.astype(dtype), v_new_BxNxTxK,
                        preferred_element_type=jnp.float32)) / den[..., None]
    return _to_heads(out, q_BxTxHxK.shape[1], dtype)


def _attend_view(config, q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK, cache_len_B, valid_BxT, view,
                 kv_len: int):
    """`attend_cache` on a dense view `(k [B, KVH, K, A], v [B, KVH, A, K])`."""
    k_l, v_l = view
    B, T, H, K = q_BxTxHxK.shape
    A = min(kv_len, v_l.shape[2])
    cp = config.contraction
    if cp.exact:
        new_mask_BxTxT = jnp.tril(jnp.ones((T, T), bool))[None] & valid_BxT[:, None, :]
        old_mask_BxA = jnp.arange(A)[None, :] < cache_len_B[:, None]
        mask_BxTxA = jnp.concatenate(
            [jnp.broadcast_to(old_mask_BxA[:, None, :], (B, T, A)), new_mask_BxTxT], axis=-1)
        cache_k = k_l[..., :A].transpose(0, 3, 1, 2)
        cache_v = v_l[:, :, :A].transpose(0, 2, 1, 3)
        return cx.cached_attention(cp, q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK, cache_k, cache_v,
                                   mask_BxTxA)
    dtype = q_BxTxHxK.dtype
    q_BxNxMxK, s_new, v_new_BxNxTxK = _new_block(q_BxTxHxK, k_BxTxKVHxK, v_BxTxKVHxK,
                                                 valid_BxT)
    if A == 0:
        probs = jax.nn.softmax(s_new, axis=-1).astype(dtype)
        out = jnp.einsum("bnmu,bnuk->bnmk", probs, v_new_BxNxTxK)
    else:
        k_BxNxKxA, v_BxNxAxK = k_l[..., :A].astype(dtype), v_l[:, :, :A].astype(dtype)
        s_old = jnp.einsum("bnmk,bnks->bnms", q_BxNxMxK, k_BxNxKxA,
                           preferred_element_type=jnp.float32)
        old_ok_BxA = jnp.arange(A, dtype=jnp.int32)[None, :] < cache_len_B[:, None]
        s_old = jnp.where(old_ok_BxA[:, None, None, :], s_old, _MASK_VALUE)
        # One softmax over both key blocks: a shared max and denominator.
        m = jnp.maximum(s_old.max(-1), s_new.max(-1))[..., None]
        e_old, e_new = jnp.exp(s_old - m), jnp.exp(s_new - m)
        inv_den = 1.0 / (e_old.sum(-1) + e_new.sum(-1))[..., None]
        out = (jnp.einsum("bnms,bnsk->bnmk", (e_old * inv_den).astype(dtype), v_BxNxAxK)
               + jnp.einsum("bnmu,bnuk->bnmk", (e_new * inv_den).astype(dtype), v_new_BxNxTxK))
    return _to_heads(out, T, dtype)
