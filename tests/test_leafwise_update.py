"""The leaf-by-leaf optimizer update (`Optimizer.apply_leafwise`) equals optax's whole-tree update,
and a checkpoint written with bounded write buffers restores exactly."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from das_jax.rl.checkpoint import CheckpointManager, largest_array_bytes
from das_jax.rl.optimizer import make_optimizer


def _grpo(max_grad_norm):
    return types.SimpleNamespace(learning_rate=1e-2, warmup_steps=1, lr_schedule="linear",
                                 weight_decay=0.01, max_grad_norm=max_grad_norm)


def _params():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return {"w": jax.random.normal(k[0], (3, 8, 4)),
            "b": [jax.random.normal(k[1], (5,)), jax.random.normal(k[2], (2, 3))]}


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0, 1e6])  # clipping, no clip, clip never hit
def test_leafwise_apply_matches_optax(max_grad_norm):
    g = _grpo(max_grad_norm)
    opt = make_optimizer(g, 10)

    @jax.jit
    def whole(p, s, grads):
        u, s = opt.update(grads, s, p)
        return optax.apply_updates(p, u), s, optax.tree.norm(grads), optax.tree.norm(u)

    leafwise = make_optimizer(g, 10).apply_leafwise
    p1 = _params()
    s1 = opt.init(p1)
    p2, s2 = jax.tree.map(jnp.copy, (p1, s1))
    for step in range(3):
        grads = jax.tree.map(lambda x: 2.0 * jax.random.normal(jax.random.PRNGKey(step), x.shape),
                             p1)
        p1, s1, gn, un = whole(p1, s1, grads)
        p2, s2, m = leafwise(p2, s2, jax.tree.map(jnp.copy, grads))
        assert jax.tree.structure(s2) == jax.tree.structure(s1)
        for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(float(m["grad_norm"]), float(gn), rtol=1e-6)
        np.testing.assert_allclose(float(m["update_norm"]), float(un), rtol=1e-5)
    assert float(jnp.abs(p2["w"] - _params()["w"]).max()) > 0  # it did update


def test_checkpoint_with_bounded_write_buffers_restores(tmp_path):
    params = _params()
    opt_state = make_optimizer(_grpo(1.0), 10).init(params)
    limit = largest_array_bytes(params, opt_state)
    assert limit == 3 * 8 * 4 * 4
    m = CheckpointManager(tmp_path, save_concurrent_bytes=limit)
    m.save(1, params, opt_state, {"x": 1})
    p, s, meta, _ = m.restore(1, params_like=params, opt_state_like=opt_state)
    m.close()
    for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((p, s))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert meta["x"] == 1
