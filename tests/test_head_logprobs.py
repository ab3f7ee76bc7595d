"""`vocab_chunked_logprobs` (the lm_head + log-softmax in vocabulary slices, hand-written backward
pass) equals the full-logits reference in values, entropies and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.rl import losses
from das_jax.rl.head_logprobs import (vocab_chunk_width, vocab_chunked_forward,
                                      vocab_chunked_grad_stats, vocab_chunked_logprobs)


def _reference(w, h, targets, temperature):
    logits = jnp.einsum("vd,nd->nv", w, h, preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return (jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0],
            losses.entropy_from_logits(jax.lax.stop_gradient(logits), temperature))


@pytest.mark.parametrize("V,C", [(96, 32), (100, 32), (100, 100), (37, 128)])
@pytest.mark.parametrize("jit", [False, True])
def test_values_and_gradients_equal_full_logits(V, C, jit):
    rng = np.random.default_rng(V + C)
    N, D, temperature = 11, 8, 0.7
    w = jnp.asarray(rng.normal(0, 1, (V, D)), jnp.float32)
    h = jnp.asarray(rng.normal(0, 1, (N, D)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, N), jnp.int32)
    targets = targets.at[0].set(V - 1).at[1].set(0)  # the last slice's overlap and column 0
    g = jnp.asarray(rng.normal(0, 1, N), jnp.float32)
    ent_weight = jnp.asarray(rng.normal(0, 1, N), jnp.float32)

    def loss(fn):
        def f(w, h):
            logp, ent = fn(w, h)
            # the entropy term must get no gradient (a stop-gradient metric) in both
            return jnp.sum(g * logp) + jnp.sum(ent_weight * jax.lax.stop_gradient(ent))
        return f

    new = lambda w, h: vocab_chunked_logprobs(w, h, targets, temperature, C)
    ref = lambda w, h: _reference(w, h, targets, temperature)
    wrap = jax.jit if jit else (lambda f: f)
    logp, ent = wrap(new)(w, h)
    logp_r, ent_r = ref(w, h)
    np.testing.assert_allclose(logp, logp_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ent_r, rtol=1e-5, atol=1e-5)
    gw, gh = wrap(jax.grad(loss(new), argnums=(0, 1)))(w, h)
    gw_r, gh_r = jax.grad(loss(ref), argnums=(0, 1))(w, h)
    # Each gradient element sums N terms of size up to max|grad|: a float32 sum in another order
    # (the vocabulary slices, another CPU's vector width) differs by ~eps * that scale, so the
    # tolerance is relative to the largest element, not to each (a cancelled 0.028 missed 1e-6).
    for got, want in ((gw, gw_r), (gh, gh_r)):
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * scale)


@pytest.mark.parametrize("V,C", [(96, 32), (100, 32), (37, 128)])
def test_grad_stats_reduce_the_gradient_it_never_builds(V, C):
    """The stats mode's dh, |dW|^2 and dW[rows] equal those of the full gradient."""
    rng = np.random.default_rng(V * C)
    N, D, temperature = 9, 8, 0.6
    w = jnp.asarray(rng.normal(0, 1, (V, D)), jnp.float32)
    h = jnp.asarray(rng.normal(0, 1, (N, D)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, N), jnp.int32)
    g = jnp.asarray(rng.normal(0, 1, N), jnp.float32)
    rows = jnp.asarray([[0, V - 1, 5], [V - 2, 5, 1]], jnp.int32)  # repeats, both ends
    gw, gh = jax.grad(lambda w, h: jnp.sum(g * _reference(w, h, targets, temperature)[0]),
                      argnums=(0, 1))(w, h)
    logp, _, lse = vocab_chunked_forward(w, h, targets, temperature, C)
    np.testing.assert_allclose(logp, _reference(w, h, targets, temperature)[0], rtol=1e-5,
                               atol=1e-5)
    dh, w_sq, got = jax.jit(vocab_chunked_grad_stats, static_argnums=(5, 6))(
        w, h, targets, lse, g, temperature, C, rows)
    np.testing.assert_allclose(dh, gh, rtol=1e-5, atol=2e-6 * float(np.max(np.abs(gh))))
    np.testing.assert_allclose(w_sq, jnp.sum(jnp.square(gw)), rtol=1e-5)
    np.testing.assert_allclose(got, gw[rows], rtol=1e-5, atol=2e-6 * float(np.max(np.abs(gw))))
    assert vocab_chunked_grad_stats(w, h, targets, lse, g, temperature, C)[2] is None


def test_entropy_gets_no_gradient():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(0, 1, (50, 4)), jnp.float32)
    h = jnp.asarray(rng.normal(0, 1, (3, 4)), jnp.float32)
    t = jnp.asarray([1, 2, 49], jnp.int32)
    gw, gh = jax.grad(lambda w, h: jnp.sum(vocab_chunked_logprobs(w, h, t, 1.0, 16)[1]),
                      argnums=(0, 1))(w, h)
    assert not np.any(np.asarray(gw)) and not np.any(np.asarray(gh))


def test_chunk_width_budget():
    # as many values as `chunk_tokens` rows of full logits, at least 128 columns, at most V
    assert vocab_chunk_width(49152, 1024, 64) == 3072
    assert vocab_chunk_width(49152, 1_000_000, 64) == 128
    assert vocab_chunk_width(1000, 2, 64) == 1000
