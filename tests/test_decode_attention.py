"""`decode_attention.attend_cache` against a naive reference: per row, softmax over the row's
valid cached positions followed by its own valid new keys up to the query (causal)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.models.decode_attention import attend_cache
from das_jax.testing import tiny_model_config

CFG = tiny_model_config()   # H=4 query heads over KVH=2 KV heads (G=2)


def keys_view(k_BxKVHxAxK):
    """The cache's key layout `[B, KVH, K, A]` of position-major keys."""
    return np.swapaxes(k_BxKVHxAxK, -1, -2)


def reference(q, k_new, v_new, k_cache, v_cache, cache_len, valid):
    """float64 loops: q [B, T, H, K]; k/v_new [B, T, KVH, K]; k/v_cache [B, KVH, A, K]."""
    B, T, H, K = q.shape
    KVH = k_new.shape[2]
    G = H // KVH
    out = np.zeros((B, T, H, K))
    for b in range(B):
        for t in range(T):
            for h in range(H):
                n = h // G
                keys = [k_cache[b, n, s] for s in range(cache_len[b])]
                vals = [v_cache[b, n, s] for s in range(cache_len[b])]
                keys += [k_new[b, u, n] for u in range(t + 1) if valid[b, u]]
                vals += [v_new[b, u, n] for u in range(t + 1) if valid[b, u]]
                if not keys:
                    continue
                s = np.array([q[b, t, h] @ k for k in keys]) / np.sqrt(K)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ np.array(vals)
    return out


def case(seed, B, T, A, kv_len):
    rng = np.random.default_rng(seed)
    H, KVH, K = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((B, T, KVH, K)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (rng.standard_normal((B, KVH, A, K)).astype(np.float32) for _ in range(2))
    cache_len = rng.integers(0, kv_len + 1, B).astype(np.int32)
    valid = rng.random((B, T)) < 0.8
    valid[:, 0] = True     # every row has its pending token
    return q, k_new, v_new, k_cache, v_cache, cache_len, valid


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("B,T,A,kv_len", [(3, 1, 16, 16), (4, 5, 24, 20), (2, 8, 8, 8),
                                          (3, 4, 16, 0)])
def test_attend_cache_matches_reference(jit, B, T, A, kv_len):
    q, k_new, v_new, k_cache, v_cache, cache_len, valid = case(B * 7 + T, B, T, A, kv_len)
    if kv_len == 0:
        cache_len[:] = 0

    def f(q, k_new, v_new, k_cache, v_cache, cache_len, valid):
        return attend_cache(CFG, q, k_new, v_new, (keys_view(k_cache), v_cache), cache_len,
                            valid, kv_len)
    if jit:
        f = jax.jit(f)
    got = np.asarray(f(q, k_new, v_new, k_cache, v_cache, cache_len, valid))
    want = reference(q, k_new, v_new, k_cache, v_cache, cache_len, valid)
    # Only real queries are defined (a padding query's output is garbage the caller ignores).
    np.testing.assert_allclose(got[valid], want[valid], atol=2e-5, rtol=2e-5)


def test_attend_cache_ignores_garbage_past_cache_len():
    """Positions at or past a row's cache_len (rejected drafts, stale rows) never matter."""
    q, k_new, v_new, k_cache, v_cache, cache_len, valid = case(1, 3, 4, 32, 32)
    cache_len = np.array([0, 7, 32], np.int32)
    a = attend_cache(CFG, q, k_new, v_new, (keys_view(k_cache), v_cache), cache_len, valid, 32)
    k2, v2 = k_cache.copy(), v_cache.copy()
    for b, n in enumerate(cache_len):
        k2[b, :, n:] = 1e4
        v2[b, :, n:] = -1e4
    b_ = attend_cache(CFG, q, k_new, v_new, (keys_view(k2), v2), cache_len, valid, 32)
    np.testing.assert_array_equal(np.asarray(a)[valid], np.asarray(b_)[valid])


def test_attend_cache_bf16_cache_with_f32_queries():
    """A bf16 cache is read at the queries' dtype (float32 here), output float32."""
    q, k_new, v_new, k_cache, v_cache, cache_len, valid = case(2, 2, 3, 16, 16)
    out = attend_cache(CFG, q, k_new, v_new, (jnp.asarray(keys_view(k_cache), jnp.bfloat16),
                                              jnp.asarray(v_cache, jnp.bfloat16)),
                       cache_len, valid, 16)
    assert out.dtype == jnp.float32
    k_r = np.asarray(jnp.asarray(k_cache, jnp.bfloat16).astype(jnp.float32))
    v_r = np.asarray(jnp.asarray(v_cache, jnp.bfloat16).astype(jnp.float32))
    want = reference(q, k_new, v_new, k_r, v_r, cache_len, valid)
    np.testing.assert_allclose(np.asarray(out)[valid], want[valid], atol=2e-5, rtol=2e-5)
