"""Sampling numerics for every T > 0.

The kind of fault: ``logits / T`` overflows as T -> 0+ (the jitted sampler emitted token 0 with
infinite log-probs at T = 1e-10). For every T > 0: once T is below float range the token equals
greedy's (unique argmax), every returned log-prob is finite and <= 0, and jitted == eager. Also
top-k / top-p, huge logits, masked (-inf) vocab entries and very large T.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.engine import sampling as S

V = 64
N = 6
TINY_TS = [1e-10, 1e-30, 1e-45, 5e-324]
ALL_TS = [1e-38, 1e-3, 1.0, 1e6, 3e38]
CUTS = [(0, 1.0), (5, 1.0), (0, 0.7), (5, 0.7), (1, 1.0), (0, 1e-6)]
FEW_CUTS = [(0, 1.0), (5, 0.7)]


def _logits(seed=0, scale=3.0):
    return jax.random.normal(jax.random.PRNGKey(seed), (N, V), jnp.float32) * scale


def _seeds():
    return jnp.arange(N, dtype=jnp.int32) + 11, jnp.arange(N, dtype=jnp.int32) * 7 + 3


@functools.partial(jax.jit, static_argnums=(3,))
def _sample_jit(logits, seeds, index, key):
    return S.sample(logits, seeds, index, key)


def _both(logits, key):
    seeds, index = _seeds()
    eager = S.sample(logits, seeds, index, key)
    jitted = _sample_jit(logits, seeds, index, key)
    return [np.asarray(x) for x in eager], [np.asarray(x) for x in jitted]


def _check(logits, key, expect_tokens=None, jit=True):
    if jit:
        (te, le), (tj, lj) = _both(logits, key)
    else:
        te, le = (np.asarray(x) for x in S.sample(logits, *_seeds(), key))
        tj, lj = te, le
    for t, lp in ((te, le), (tj, lj)):
        assert np.all(np.isfinite(lp)) and np.all(lp <= 0.0), (key, lp)
        assert np.all((t >= 0) & (t < logits.shape[-1]))
        lx = np.asarray(logits, np.float32)
        chosen = lx[np.arange(len(t)), t]
        live = ~np.all(lx == -np.inf, axis=-1)  # a fully masked row has no allowed token
        assert np.all(chosen[live] > -np.inf)
    np.testing.assert_array_equal(te, tj)
    np.testing.assert_allclose(le, lj, rtol=1e-5, atol=1e-5)
    if expect_tokens is not None:
        np.testing.assert_array_equal(te, expect_tokens)
    return te, le


@pytest.mark.parametrize("T", TINY_TS)
def test_tiny_temperature_equals_greedy(T):
    logits = _logits()
    greedy, _ = S.sample(logits, *_seeds(), (0.0, 0, 1.0))
    for top_k, top_p in CUTS if T == 1e-10 else FEW_CUTS:
        t, lp = _check(logits, (T, top_k, top_p), expect_tokens=np.asarray(greedy))
        np.testing.assert_array_equal(lp, 0.0)  # a point mass


@pytest.mark.parametrize("T", ALL_TS)
def test_every_temperature_finite_nonpositive_and_jit_equals_eager(T):
    for top_k, top_p in FEW_CUTS:
        _check(_logits(1), (T, top_k, top_p))


@pytest.mark.parametrize("T", [1e-10, 0.7, 1e30])
def test_masked_vocab_never_sampled(T):
    logits = np.array(_logits(2))
    masked = np.zeros((N, V), bool)
    masked[:, ::2] = True                      # half the vocab masked, including each row's id 0
    masked[0, :] = True
    masked[0, 37] = False                      # row 0: a single allowed token
    logits = np.where(masked, -np.inf, logits).astype(np.float32)
    for top_k, top_p in FEW_CUTS:
        t, _ = _check(jnp.asarray(logits), (T, top_k, top_p))
        assert not masked[np.arange(N), t].any(), (T, top_k, top_p, t)
        assert t[0] == 37


@pytest.mark.parametrize("T", [1e-10, 1.0, 3e38])
def test_huge_logits(T):
    logits = np.array(_logits(3))
    logits[:, 10] = 3.0e38
    logits[:, 20] = -3.0e38
    logits[1, :] = -3.0e38
    logits[1, 5] = 3.0e38                       # a gap of 6e38 overflows x - m
    logits[2, 30] = np.inf                      # +inf takes all the mass
    for top_k, top_p in FEW_CUTS:
        t, _ = _check(jnp.asarray(logits), (T, top_k, top_p))
        assert t[2] == 30
        if T <= 1.0:
            assert t[0] == 10 and t[1] == 5


def test_all_masked_row_stays_finite():
    logits = jnp.full((N, V), -jnp.inf, jnp.float32)
    for T in (1e-10, 1.0):
        _check(logits, (T, 3, 0.5))


def test_large_temperature_tends_to_uniform():
    logits = _logits(4, scale=10.0)
    lp = np.asarray(S.processed_logprobs(logits, 1e30, 0, 1.0))
    np.testing.assert_allclose(lp, -np.log(V), rtol=1e-5)
    # a finite gap of 6e38 at T = 1e38 / 3e38 is 6 / 2, not -inf (nor 0 from a flushed 1 / T)
    lx = jnp.asarray([[3.0e38, -3.0e38]], jnp.float32)
    for T, gap in ((1e38, 6.0), (3e38, 2.0)):
        expected = np.log(np.array([1.0, np.exp(-gap)]) / (1.0 + np.exp(-gap)))
        np.testing.assert_allclose(np.asarray(S.tempered_log_softmax(lx, T))[0], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(jax.jit(S.tempered_log_softmax, static_argnums=1)(lx, T))[0],
                                   expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [0.25, 0.7, 1.0, 2.0])
def test_tempered_log_softmax_matches_reference(T):
    logits = _logits(5)
    ref = jax.nn.log_softmax(logits / T, axis=-1)
    np.testing.assert_allclose(np.asarray(S.tempered_log_softmax(logits, T)), np.asarray(ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(S.SamplingError, match="temperature"):
        S.tempered_log_softmax(logits, 0.0)


def test_tokens_converge_to_greedy_as_temperature_falls():
    """Between 'ordinary' and 'below float range': once every gap / T < log(float32 tiny),
    the distribution is exactly the point mass (no T in between emits garbage)."""
    logits = _logits(6)
    greedy = np.asarray(jnp.argmax(logits, axis=-1))
    for T in np.geomspace(1e-2, 1e-40, 40):
        t, lp = _check(logits, (float(T), 0, 1.0), jit=False)
        if T < 1e-4:  # gaps here are > 1e-3, so gap / T > 10 -> (nearly) a point mass
            np.testing.assert_array_equal(t, greedy)
