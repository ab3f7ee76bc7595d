"""The tiny random model the tests run: a few thousand parameters, float32, seconds to compile."""
from __future__ import annotations

import dataclasses

import numpy as np

from das_jax.models.config import ModelConfig

# vocab 64 (id 1 is the tests' eos), D=32, F=64, 2 layers, 4 query / 2 key-value heads of 8.
_TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0)


def tiny_model_config(**overrides) -> ModelConfig:
    """The tests' tiny `ModelConfig` (Llama layout), with `overrides` replacing fields.

    Raises:
      TypeError: an unknown field; ModelConfigError: an invalid combination.
    """
    return dataclasses.replace(_TINY, **overrides) if overrides else _TINY


def tiny_params(config: ModelConfig | None = None, seed: int = 0, scale: float = 0.5):
    """float32 params of `config` (default: `tiny_model_config()`), normal(0, scale) weights
    from `jax.random.PRNGKey(seed)` (norm weights 1). The large scale gives peaked, varied
    next-token distributions, so sampling tests see both likely and unlikely tokens."""
    # deferred import: jax (not loaded by importing this module)
    import jax

    from das_jax.models.transformer import init_params
    return init_params(config or _TINY, jax.random.PRNGKey(seed), scale=scale)


def random_kv_cache(config: ModelConfig, batch: int, cache_len: int, seed: int):
    """A float32 `KVCache` of `batch` rows x `cache_len` positions filled with standard-normal
    K and V from `numpy.random.default_rng(seed)` (drawn position-major, `[L, batch, KVH,
    cache_len, K]`, then stored in the cache's layout): a cache that already holds (random)
    history, for tests that attend over it."""
    # deferred import: jax (not loaded by importing this module)
    import jax.numpy as jnp

    from das_jax.models.transformer import KVCache
    rng = np.random.default_rng(seed)
    shape = (config.num_layers, batch, config.num_kv_heads, cache_len, config.head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    return KVCache(k=jnp.asarray(np.swapaxes(k, -1, -2), jnp.float32),
                   v=jnp.asarray(v, jnp.float32))


def kv_by_position(cache):
    """(k, v) of a `KVCache` as numpy arrays `[L, B, KVH, S, K]` each (keys are stored
    `[L, B, KVH, K, S]`), so tests index positions the same way in both."""
    return np.swapaxes(np.asarray(cache.k), -1, -2), np.asarray(cache.v)


def random_requests(problems: int = 3, samples: int = 3, seed: int = 0):
    """`problems` random prompts of 4-19 token ids in [2, 64), each sampled `samples` times
    (`Request`s with problem ids "p0", "p1", ... and sample indices 0..samples-1)."""

    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine.generate import Request
    rng = np.random.default_rng(seed)
    prompts = [tuple(int(t) for t in rng.integers(2, 64, size=int(rng.integers(4, 20))))
               for _ in range(problems)]
    return [Request(p, problem_id=f"p{i}", sample_index=g)
            for i, p in enumerate(prompts) for g in range(samples)]


def tiny_engine(params, config: ModelConfig | None = None, eos_token_id: int = 1,
                **engine_config):
    """An `Engine` of `config` (default: `tiny_model_config()`) with `params`, one eos id,
    and an `EngineConfig` of 4 slots, 256 cache positions and widths (1, 4), `engine_config`
    replacing fields (e.g. `decode_steps=8`)."""
    # deferred import: jax (not loaded by importing this module)
    from das_jax.engine.generate import Engine, EngineConfig
    ec = {"max_slots": 4, "max_cache_len": 256, "draft_widths": (1, 4), **engine_config}
    return Engine(config or _TINY, params, eos_token_ids=[eos_token_id],
                  engine_config=EngineConfig(**ec))


def paged_kv_cache_like(dense, page: int, seed: int):
    """A float32 `PagedKVCache` holding a dense cache's positions (`random_kv_cache`) on
    randomly permuted pages of `page` positions, plus 3 spare pages of noise (so a wrong page id
    shows), from `numpy.random.default_rng(seed)`. Its attended views equal the dense cache's."""
    # deferred import: jax (not loaded by importing this module)
    import jax.numpy as jnp

    from das_jax.models.paged_kv_cache import PagedKVCache
    L, B, KVH, K, S = dense.k.shape
    mp = -(-S // page)
    num_pages = B * mp + 3
    rng = np.random.default_rng(seed)
    ids = rng.permutation(num_pages)[:B * mp].reshape(B, mp).astype(np.int32)
    k = rng.standard_normal((L, num_pages, KVH, K, page)).astype(np.float32)
    v = rng.standard_normal((L, num_pages, KVH, page, K)).astype(np.float32)
    dk = np.pad(np.asarray(dense.k), [(0, 0)] * 4 + [(0, mp * page - S)])
    dv = np.pad(np.asarray(dense.v), [(0, 0)] * 3 + [(0, mp * page - S), (0, 0)])
    for b in range(B):
        for j in range(mp):
            k[:, ids[b, j]] = dk[:, b, :, :, j * page:(j + 1) * page]
            v[:, ids[b, j]] = dv[:, b, :, j * page:(j + 1) * page]
    return PagedKVCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray(ids))


def paged_case(seed, B, KVH, M, K, page, kv_len, *, dtype=np.float32, spare=3):
    """Queries, a pool of pages with noise everywhere, a table whose entries past a row's
    length are unallocated (P) or random pages, and ragged lengths covering 0, a page boundary
    and the bound (paged attention's inputs: q `[B, KVH, M, K]`, k pages `[P, KVH, K, page]`, v pages
    `[P, KVH, page, K]`, the table `[B, MP]` int32, lengths `[B]` int32)."""
    rng = np.random.default_rng(seed)
    mp = -(-kv_len // page) + 1
    P = B * mp + spare
    q = rng.standard_normal((B, KVH, M, K)).astype(dtype) * K ** -0.5
    k = rng.standard_normal((P, KVH, K, page)).astype(dtype)
    v = rng.standard_normal((P, KVH, page, K)).astype(dtype)
    lens = rng.integers(0, kv_len + 1, B)
    lens[: min(B, 3)] = [0, min(page, kv_len), kv_len][: min(B, 3)]
    table = rng.permutation(P)[: B * mp].reshape(B, mp)
    if B > 1:
        table[1, 0] = table[0, 0]                         # a page two rows share
    for b in range(B):
        held = -(-int(lens[b]) // page)
        tail = table[b, held:]
        table[b, held:] = np.where(rng.random(tail.shape) < 0.5, P, tail)  # unallocated / stale
    # deferred import: jax (not loaded by importing this module)
    import jax.numpy as jnp

    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table, jnp.int32),
            jnp.asarray(lens, jnp.int32))
