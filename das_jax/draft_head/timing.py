"""The head's draft call against the policy's verify step, timed side by side (the head's
cost per rollout step)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np


def head_vs_verify(model_config, params, head, batch: int = 16, width: int = 4,
                   steps: int = 3, cached: int = 384, repeats: int = 20,
                   dtypes: tuple = ("float32",)) -> dict:
    """Median seconds of `extend_and_draft` (B rows, `width` anchors committed each, `steps`
    draft tokens, `cached` anchors already in the head's cache of `max_len` = the power of two
    >= cached + 2 * width, at least 128), once per weight dtype in `dtypes`
    (`head.cast_weights`), and of the engine's packed verify step at the same (B, width)
    attending `max_len` positions; compile excluded.

    Returns {"head_s": {dtype: s}, "verify_s": s, "ratio": {dtype: head_s / verify_s},
    "batch", "width", "steps", "cached"}; the head calls alternate between the dtypes so a
    drifting machine load weighs on each alike."""
    # deferred import: jax (not loaded by importing this module)
    import jax
    import jax.numpy as jnp

    from das_jax.draft_head.head import HeadCache, cast_weights, extend_and_draft
    from das_jax.engine import Engine, EngineConfig, pow2_at_least

    max_len = pow2_at_least(cached + 2 * width, 128)
    embed = jnp.asarray(params["embed"], jnp.float32)
    d2t = jnp.asarray(head.draft_to_target)
    hidden = head.config.hidden_size
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.normal(size=(batch, width, 3 * hidden)).astype(np.float32))
    nxt = jnp.asarray(rng.integers(0, model_config.vocab_size, (batch, width)).astype(np.int32))
    n = jnp.full((batch,), width, jnp.int32)
    # the cache donated, as a rollout loop holds it: updated in place, not copied
    step = jax.jit(extend_and_draft, static_argnums=(0, 8), donate_argnums=(4,))
    runs = {}
    for dt in dtypes:
        hc = dataclasses.replace(head.config, dtype=dt)
        hp = jax.tree_util.tree_map(jnp.asarray, cast_weights(dict(head.params), dt))
        cache = HeadCache.zeros(hc, batch, max_len)
        runs[dt] = [hc, hp, HeadCache(cache.k, cache.v, jnp.full((batch,), cached, jnp.int32))]

    def once(dt):
        hc, hp, cache = runs[dt]
        t0 = time.perf_counter()
        out = step(hc, hp, embed, d2t, cache, feats, nxt, n, steps)
        jax.block_until_ready(out)
        took = time.perf_counter() - t0
        runs[dt][2] = HeadCache(out[0].k, out[0].v, jnp.full((batch,), cached, jnp.int32))
        return took
    times = {dt: [] for dt in dtypes}
    for dt in dtypes:
        once(dt)                                     # compiles
    for _ in range(repeats):
        for dt in dtypes:
            times[dt].append(once(dt))
    head_s = {dt: float(np.median(t)) for dt, t in times.items()}
    engine = Engine(model_config, params, eos_token_ids=(0,),
                    engine_config=EngineConfig(max_slots=batch, max_cache_len=max_len,
                                               draft_widths=tuple(sorted({1, width}))))
    verify_s = engine.time_verify_step(batch, width, max_len, max_len, max(3, repeats // 4))
    return {"head_s": head_s, "verify_s": verify_s,
            "ratio": {dt: s / verify_s for dt, s in head_s.items()},
            "batch": batch, "width": width, "steps": steps, "cached": cached}
