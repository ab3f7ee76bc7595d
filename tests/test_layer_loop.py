"""The layer loop: `lax.scan`, unrolled, or per-layer params give the same forward, the same
packed verify step and the same rollouts. Tiny random models, float32, fixed seeds."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.engine import step as step_lib
from das_jax.engine.generate import Engine, EngineConfig, Request
from das_jax.engine.sampling import SamplingParams
from das_jax.engine.specs import VerifyBatch, VerifySpec
from das_jax.models.config import ModelConfigError
from das_jax.config import ConfigError, config_from_dict
from das_jax.engine.engine_config import GenerateError
from das_jax.rollout import rollout_from_config
from das_jax.models.layer_loop import layer, num_layers, run_layers, unrolled, unstack
from das_jax.models.transformer import ActivationConfig, forward
from das_jax.testing import (paged_kv_cache_like, random_kv_cache, tiny_model_config,
                             tiny_params)

CFG = tiny_model_config()
UNROLL = dataclasses.replace(CFG, layer_loop="unroll")


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG)


def _unstacked(params):
    return {**params, "layers": unstack(params["layers"])}


def test_run_layers_matches_scan_and_stacks_outputs():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 4, 4)), jnp.float32)
    extra = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)

    def body(x, inputs):
        lw, e = inputs
        x = jnp.tanh(x @ lw + e)
        return x, x.sum()
    x0 = jnp.ones((2, 4), jnp.float32)
    xs, ys = run_layers(body, x0, w, extra, "scan")
    xu, yu = run_layers(body, x0, w, extra, "unroll")
    xp, yp = run_layers(body, x0, tuple(w), extra, "scan")   # per-layer params: a Python loop
    for x, y in ((xu, yu), (xp, yp)):
        np.testing.assert_allclose(x, xs, atol=1e-6, rtol=0)
        assert y.shape == (3,)
        np.testing.assert_allclose(y, ys, atol=1e-5, rtol=0)
    assert run_layers(lambda x, i: (x + i[0].sum(), None), x0, w, loop="unroll")[1] is None
    assert num_layers(w) == num_layers(tuple(w)) == 3
    np.testing.assert_array_equal(layer(w, 2), w[2])
    with pytest.raises(ValueError, match="layer loop must be one of scan, unroll"):
        run_layers(body, x0, w, extra, "while")


def test_model_config_rejects_unknown_layer_loop():
    with pytest.raises(ModelConfigError, match="layer_loop must be one of scan, unroll"):
        dataclasses.replace(CFG, layer_loop="loop")


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_forward_unrolled_and_unstacked_equal_scan(params, jit):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(2, CFG.vocab_size, size=(2, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    run = (jax.jit(forward, static_argnums=0, static_argnames=("activation",)) if jit
           else forward)
    base, _ = run(CFG, params, tokens, pos)
    for config, p in ((UNROLL, params), (CFG, _unstacked(params))):
        logits, _ = run(config, p, tokens, pos)
        np.testing.assert_allclose(logits, base, atol=1e-5, rtol=0)
    if not jit:   # eager: the plain forward only (op by op, the rest is slow and the same code)
        return
    # the teacher-forced path (remat, chunked attention) and the KV-cache path
    act = ActivationConfig(remat="full", attention="xla", attention_chunk=4)
    base, _ = run(CFG, params, tokens, pos, activation=act)
    logits, _ = run(UNROLL, params, tokens, pos, activation=act)
    np.testing.assert_allclose(logits, base, atol=1e-5, rtol=0)
    cache = random_kv_cache(CFG, 2, 32, seed=2)
    cache_len = jnp.asarray([5, 11], jnp.int32)
    base, c0 = run(CFG, params, tokens, pos + cache_len[:, None], cache, cache_len)
    logits, c1 = run(UNROLL, params, tokens, pos + cache_len[:, None], cache, cache_len)
    np.testing.assert_allclose(logits, base, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree_util.tree_leaves(c0), jax.tree_util.tree_leaves(c1)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_packed_verify_unrolled_equals_scan(params):
    rng = np.random.default_rng(3)
    B, N, W, S, A = 3, 8, 4, 64, 32
    cache = random_kv_cache(CFG, B, S, seed=3)
    cache_len = jnp.asarray([3, 20, 9], jnp.int32)
    tokens = jnp.asarray(rng.integers(2, CFG.vocab_size, size=N), jnp.int32)
    rows = jnp.asarray([0, 0, 0, 1, 2, 2, 3, 3], jnp.int32)      # 3 = padding slots
    offsets = jnp.asarray([0, 1, 2, 0, 0, 1, 0, 0], jnp.int32)
    n_draft = jnp.asarray([2, 0, 1], jnp.int32)
    seeds = jnp.asarray(rng.integers(0, 2**31, size=B), jnp.int32)
    outs = []
    for config in (CFG, UNROLL):
        spec = VerifySpec(config, (0.8, 0, 1.0), B, N, W, S, A, "float32")
        c = jax.tree_util.tree_map(jnp.copy, cache)
        outs.append(step_lib.verify_packed(params, c, VerifyBatch(
            spec, cache_len, tokens, rows, offsets, n_draft, seeds)))
    (c0, y0, lp0, ne0), (c1, y1, lp1, ne1) = outs
    np.testing.assert_array_equal(y0, y1)
    np.testing.assert_array_equal(ne0, ne1)
    np.testing.assert_allclose(lp0, lp1, atol=1e-5, rtol=0)


def test_generate_unrolled_equals_scan(params):
    """`EngineConfig.layer_loop` sets the engine's model config; same rollouts (the unrolled
    programs read whole layers once the attended length is a third of the cache)."""
    rng = np.random.default_rng(4)
    reqs = [Request(tuple(int(t) for t in rng.integers(2, 64, size=int(rng.integers(3, 12)))),
                    problem_id=f"p{i // 2}", sample_index=i % 2) for i in range(4)]
    sampling = SamplingParams(temperature=0.8, max_new_tokens=8)
    runs = []
    for loop in ("scan", "unroll"):
        eng = Engine(CFG, params, eos_token_ids=[1], engine_config=EngineConfig(
            max_slots=4, max_cache_len=64, draft_widths=(1, 4), layer_loop=loop))
        assert eng.config.layer_loop == loop
        runs.append(eng.generate(reqs, sampling)[0])
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_read_len_reads_whole_dense_layers_only_when_unrolled():
    cache = random_kv_cache(CFG, 2, 64, seed=5)
    assert cache.read_len(32, in_place=True) == 64       # 3 x 32 >= 64: the whole layer
    assert cache.read_len(21, in_place=True) == 21       # 3 x 21 < 64: the slice
    assert cache.read_len(32, in_place=False) == 32      # a scan's dynamic slice: never
    assert cache.read_len(0, in_place=True) == 0         # a prefill into an empty scratch
    paged = paged_kv_cache_like(cache, 16, seed=0)
    assert paged.read_len(32, in_place=True) == 32       # pages are gathered, never sliced
    assert unrolled(tuple(range(3)), "scan") and unrolled({}, "unroll")
    assert not unrolled({}, "scan")


def test_layer_loop_settings():
    with pytest.raises(GenerateError, match="layer_loop must be one of scan, unroll"):
        EngineConfig(layer_loop="while")
    assert config_from_dict({}).rollout.layer_loop == "scan"
    with pytest.raises(ConfigError, match="rollout.layer_loop"):
        config_from_dict({"rollout": {"layer_loop": "while"}})
    # the key reaches the rollout's engine
    config = config_from_dict({"rollout": {"layer_loop": "unroll", "max_slots": 2,
                                           "max_new_tokens": 16, "max_cache_len": 64}})
    rollout = rollout_from_config(config, CFG, tiny_params(CFG), eos_token_ids=[1])
    assert rollout.engine.config.layer_loop == "unroll"
