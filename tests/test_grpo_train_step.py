"""GRPO train step on a tiny random model: micro-batching exactness, optimisation, schedules."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from das_jax.config import GRPOSection
from das_jax.models import ModelConfig, forward, init_params
from das_jax.rl import (compute_logprobs, make_batch, make_loss_and_grad,
                        make_lr_schedule, make_optimizer, make_train_step)

CFG = ModelConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8)
TEMP = 0.7


def tiny_params(config, seed=0, scale=0.2):
    """`init_params`' tree (via eval_shape: no compile) filled from numpy: fast on 2 cores."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda k: init_params(config, k), jax.random.PRNGKey(0))

    def fill(path, s):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(s.shape, s.dtype)
        return jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype)
    return jax.tree_util.tree_map_with_path(fill, shapes)


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG)


def _batch(params, seed=0, B=6, T=11, beta_noise=True):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 4, size=B)
    comp = rng.integers(0, 7, size=B)  # one row may have no completion token at all
    comp[0] = 7
    tokens = rng.integers(0, CFG.vocab_size, size=(B, T))
    base = make_batch(tokens, prompt, comp)
    cur = np.asarray(compute_logprobs(CFG, params, base.tokens_BxT, base.positions_BxT,
                                      base.valid_BxT, TEMP))
    # old / ref log-probs: current ones perturbed so that ratios leave the clip region both ways.
    old = cur + rng.normal(0, 0.35, size=cur.shape)
    ref = cur + rng.normal(0, 0.2, size=cur.shape)
    adv = rng.normal(0, 1, size=B)
    return make_batch(tokens, prompt, comp, old_logprobs_BxT=old, ref_logprobs_BxT=ref,
                      advantages_B=adv)


def _grpo(**kw):
    base = dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, micro_batch_size=6,
                max_completion_length=8, learning_rate=1e-2, max_grad_norm=1.0)
    base.update(kw)
    return GRPOSection(**base)


def test_compute_logprobs_matches_forward(params):
    b = _batch(params)
    logits, _ = forward(CFG, params, b.tokens_BxT, b.positions_BxT, valid_BxT=b.valid_BxT)
    logp_all = jax.nn.log_softmax(np.asarray(logits) / TEMP, axis=-1)
    tok = np.asarray(b.tokens_BxT)
    valid = np.asarray(b.valid_BxT)
    want = np.zeros(tok.shape, np.float32)
    for i in range(tok.shape[0]):
        for t in range(1, tok.shape[1]):
            if valid[i, t]:
                want[i, t] = logp_all[i, t - 1, tok[i, t]]
    for mb in (None, 4):
        got = compute_logprobs(CFG, params, b.tokens_BxT, b.positions_BxT, b.valid_BxT, TEMP, mb)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _tree_rel_err(g, g_ref):
    num = sum(float(jnp.sum((a - c) ** 2)) for a, c in
              zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)))
    den = sum(float(jnp.sum(c ** 2)) for c in jax.tree_util.tree_leaves(g_ref))
    return (num / den) ** 0.5


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batched_gradient_equals_full_batch(params, loss_type):
    """Micro-batched accumulation == full batch; also == `grpo_loss` on teacher-forced log-probs."""
    from das_jax.rl import grpo_loss
    b = _batch(params, seed=1)
    results = {}
    sizes = (6, 4)  # 4 does not divide 6: two micro-batches, the second one padded
    for mb in sizes:
        # not wrapped in jit: the jitted `accumulate_grads` kernel is then shared by loss types
        fn = make_loss_and_grad(CFG, _grpo(loss_type=loss_type, beta=0.04, micro_batch_size=mb),
                                temperature=TEMP)
        results[mb] = fn(params, b)
    loss_full, g_full, m_full = results[6]
    assert float(m_full["clip_low"]) > 0 and float(m_full["clip_high"]) > 0  # both sides active
    for mb in sizes[1:]:
        loss, g, m = results[mb]
        np.testing.assert_allclose(float(loss), float(loss_full), rtol=1e-6)
        for name in ("kl", "entropy", "clip_low", "clip_high", "clip_region"):
            np.testing.assert_allclose(float(m[name]), float(m_full[name]), rtol=1e-5)
        # float32: different micro-batch shapes take different matmul kernels (DESIGN.md), so
        # the sums differ at rounding level; the whole gradient agrees to 1e-6 relative.
        assert _tree_rel_err(g, g_full) <= 1e-6, (loss_type, mb, _tree_rel_err(g, g_full))
    # independent path: full-batch loss function on teacher-forced log-probs
    logp = compute_logprobs(CFG, params, b.tokens_BxT, b.positions_BxT, b.valid_BxT, TEMP)
    want, _ = grpo_loss(logp, b.old_logprobs_BxT, b.advantages_B, b.completion_mask_BxT,
                        loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=0.04,
                        ref_logp_BxT=b.ref_logprobs_BxT, max_completion_length=8)
    np.testing.assert_allclose(float(loss_full), float(want), rtol=1e-5)


@pytest.mark.parametrize("loss_type", ["dr_grpo", "dapo"])
def test_skip_zero_advantage_rows_same_loss_and_gradient(params, loss_type):
    """Rows with advantage 0 add nothing to the loss or gradient at beta 0: skipping them
    (train.skip_zero_advantage) keeps both; with every advantage 0 the gradient is exactly 0."""
    b = _batch(params, seed=2)
    adv = np.asarray(b.advantages_B).copy()
    adv[[1, 2, 4]] = 0.0
    b = dataclasses.replace(b, advantages_B=jnp.asarray(adv))
    cfg = _grpo(loss_type=loss_type, micro_batch_size=2)
    loss_a, g_a, m_a = make_loss_and_grad(CFG, cfg, temperature=TEMP)(params, b)
    loss_b, g_b, m_b = make_loss_and_grad(CFG, cfg, temperature=TEMP,
                                          skip_zero_advantage=True)(params, b)
    assert float(loss_a) != 0.0
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-6)
    # fewer micro-batch rows, so other float32 summation orders: ~10 ulps of the gradient
    assert _tree_rel_err(g_b, g_a) <= 2e-6, _tree_rel_err(g_b, g_a)
    assert float(m_b["num_completion_tokens"]) < float(m_a["num_completion_tokens"])  # fewer rows
    zero = dataclasses.replace(b, advantages_B=jnp.zeros_like(b.advantages_B))
    loss_z, g_z, _ = make_loss_and_grad(CFG, cfg, temperature=TEMP,
                                        skip_zero_advantage=True)(params, zero)
    assert float(loss_z) == 0.0
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree_util.tree_leaves(g_z))
    # with a KL term the zero-advantage rows do contribute: the option is ignored
    kl = _grpo(loss_type=loss_type, beta=0.04, micro_batch_size=2)
    loss_k, _, _ = make_loss_and_grad(CFG, kl, temperature=TEMP, skip_zero_advantage=True)(params, b)
    want_k, _, _ = make_loss_and_grad(CFG, kl, temperature=TEMP)(params, b)
    np.testing.assert_allclose(float(loss_k), float(want_k), rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_decoupled_objective_is_the_recomputed_loss_with_truncated_weights(params, loss_type):
    """The decoupled objective (old log-probs = the behaviour policy's; the ratio's proximal
    policy = the params trained, detached) equals the plain loss with old log-probs recomputed
    from the params and each token weighted by min(exp(logp - behaviour), cap): loss, gradient
    (one and two micro-batches: the max metric combines across them) and the importance-weight
    metrics against numpy."""
    cap = 1.3
    b = _batch(params, seed=4)        # old log-probs: the current ones perturbed (behaviour)
    cur = np.asarray(compute_logprobs(CFG, params, b.tokens_BxT, b.positions_BxT, b.valid_BxT,
                                      TEMP))
    T = cur.shape[1]
    cm = (np.asarray(b.completion_mask_BxT).astype(bool) & np.asarray(b.valid_BxT)
          & (np.arange(T) > 0))
    behaviour = np.asarray(b.old_logprobs_BxT)
    raw = np.exp(np.where(cm, cur - behaviour, 0.0))
    w = np.where(cm, np.minimum(raw, cap), 0.0).astype(np.float32)
    assert 0 < (raw[cm] > cap).mean() < 1
    cfg = _grpo(loss_type=loss_type, beta=0.04, micro_batch_size=6)
    recomputed = b.replace(old_logprobs_BxT=jnp.asarray(cur * cm), is_weights_BxT=jnp.asarray(w))
    want_loss, want_g, _ = make_loss_and_grad(CFG, cfg, temperature=TEMP)(params, recomputed)
    for mb in (6, 4):
        fn = make_loss_and_grad(CFG, dataclasses.replace(cfg, micro_batch_size=mb),
                                temperature=TEMP, decoupled_is_cap=cap)
        loss, g, m = fn(params, b)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
        assert _tree_rel_err(g, want_g) <= 1e-5, (mb, _tree_rel_err(g, want_g))
        np.testing.assert_allclose(float(m["is_weight_mean"]), w[cm].mean(), rtol=1e-5)
        np.testing.assert_allclose(float(m["is_weight_max"]), raw[cm].max(), rtol=1e-5)
        np.testing.assert_allclose(float(m["is_truncated_fraction"]), (raw[cm] > cap).mean(),
                                   rtol=1e-6)
        np.testing.assert_allclose(float(m["logprob_gap"]),
                                   np.abs(cur - behaviour)[cm].mean(), rtol=1e-4)
        assert float(m["clip_region"]) == 0.0      # the ratio is 1 in value
    # without the cap the same batch is the plain loss against the behaviour policy
    plain, _, m = make_loss_and_grad(CFG, cfg, temperature=TEMP)(params, b)
    assert abs(float(plain) - float(want_loss)) > 1e-3 and "is_weight_mean" not in m


def test_train_step_jit_and_eager_decrease_loss_and_move_params(params):
    b = _batch(params, seed=3)
    # on-policy old log-probs (as with num_iterations == 1): ratio 1 at the first step
    cur = compute_logprobs(CFG, params, b.tokens_BxT, b.positions_BxT, b.valid_BxT, TEMP)
    b = b.replace(old_logprobs_BxT=cur * b.completion_mask_BxT)
    cfg = _grpo(loss_type="grpo", micro_batch_size=3, learning_rate=3e-3, beta=0.04)
    opt = make_optimizer(cfg, total_steps=10)
    step = make_train_step(CFG, cfg, opt, temperature=TEMP)
    s0 = opt.init(params)
    p, s = params, s0
    losses_seen = []
    for i in range(4):
        p, s, metrics = step(p, s, b)
        losses_seen.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"]))
        if i == 0:
            p_first, loss_first = p, float(metrics["loss"])
    assert losses_seen[-1] < losses_seen[0] - 1e-3, losses_seen
    moved = jax.tree_util.tree_map(lambda a, c: float(jnp.max(jnp.abs(a - c))), p, params)
    assert max(jax.tree_util.tree_leaves(moved)) > 1e-4
    assert set(metrics) >= {"loss", "grad_norm", "update_norm", "entropy", "clip_low",
                            "clip_high", "clip_region", "num_completion_tokens", "kl"}
    # the same step without jit gives the same first update
    p_e, _, m_e = make_train_step(CFG, cfg, opt, temperature=TEMP, jit=False)(params, s0, b)
    np.testing.assert_allclose(float(m_e["loss"]), loss_first, rtol=1e-5)
    for a, c in zip(jax.tree_util.tree_leaves(p_e), jax.tree_util.tree_leaves(p_first)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)


def test_lr_schedules():
    cfg = GRPOSection(learning_rate=1e-3, warmup_steps=4)
    sched = make_lr_schedule(cfg, total_steps=12)
    np.testing.assert_allclose([float(sched(i)) for i in range(7)],
                               [0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-6, atol=1e-12)
    cos = make_lr_schedule(dataclasses.replace(cfg, lr_schedule="cosine"), total_steps=12)
    np.testing.assert_allclose(float(cos(4)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(cos(8)), 0.5e-3, rtol=1e-5)  # half-way through decay
    np.testing.assert_allclose(float(cos(12)), 0.0, atol=1e-9)
    lin = make_lr_schedule(dataclasses.replace(cfg, lr_schedule="linear", warmup_steps=0), 10)
    np.testing.assert_allclose(float(lin(5)), 0.5e-3, rtol=1e-6)
    assert float(make_lr_schedule(GRPOSection(learning_rate=2e-6), 5)(0)) == pytest.approx(2e-6)


def test_optimizer_warmup_and_clipping():
    """lr = 0 at update 0 leaves params unchanged; grads are clipped to max_grad_norm first."""
    p = {"w": jnp.array([1.0, -2.0, 3.0])}
    g = {"w": jnp.array([300.0, -400.0, 0.0])}  # global norm 500
    cfg = _grpo(warmup_steps=2, learning_rate=1e-2, max_grad_norm=1.0, weight_decay=0.1)
    opt = make_optimizer(cfg, total_steps=10)
    s = opt.init(p)
    u0, s = opt.update(g, s, p)
    np.testing.assert_array_equal(np.asarray(u0["w"]), 0.0)
    u1, s = opt.update(g, s, p)
    assert float(jnp.abs(u1["w"]).max()) > 0
    # same as AdamW (lr 5e-3 at update 1) fed the gradient clipped to norm 1
    ref = optax.adamw(make_lr_schedule(cfg, 10), weight_decay=0.1)
    rs = ref.init(p)
    gc = {"w": g["w"] / 500.0}
    _, rs = ref.update(gc, rs, p)
    r1, _ = ref.update(gc, rs, p)
    np.testing.assert_allclose(np.asarray(u1["w"]), np.asarray(r1["w"]), rtol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="temperature"):
        make_loss_and_grad(CFG, _grpo(), temperature=0.0)
    with pytest.raises(ValueError, match="loss_type"):
        make_loss_and_grad(CFG, dataclasses.replace(_grpo(), loss_type="bnpo"))
