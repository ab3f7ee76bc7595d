"""GRPO advantages and losses against independent numpy / hand-computed references."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.rl import advantages as adv_lib
from das_jax.rl import losses


# ----- advantages ---------------------------------------------------------------------------------

def test_group_advantages_hand_values():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]  # group 2 is degenerate
    a = np.asarray(adv_lib.group_advantages(rewards, 4, "group"))
    std1 = math.sqrt(1.0 / 3.0)  # ddof=1 std of [1,0,0,1]: mean .5, sum sq dev 1, / 3
    np.testing.assert_allclose(a[:4], np.array([0.5, -0.5, -0.5, 0.5]) / (std1 + 1e-4), rtol=1e-6)
    assert np.all(a[4:] == 0.0)
    assert not np.any(np.isnan(a))


def test_group_advantages_batch_and_none():
    rewards = np.array([3.0, 1.0, 0.0, 0.0, 5.0, 5.0], np.float32)
    centred = np.array([1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(adv_lib.group_advantages(rewards, 2, "none"), centred, atol=1e-7)
    batch_std = np.std(rewards, ddof=1)
    np.testing.assert_allclose(adv_lib.group_advantages(rewards, 2, "batch"),
                               centred / (batch_std + 1e-4), rtol=1e-6)
    np.testing.assert_allclose(adv_lib.group_advantages(rewards, 2, "group"),
                               centred / (np.sqrt(2.0) + 1e-4), rtol=1e-6)


def test_all_degenerate_and_single_generation_give_zero_not_nan():
    for scale in adv_lib.SCALE_REWARDS:
        a = np.asarray(adv_lib.group_advantages([1.0] * 6, 3, scale))
        assert np.all(a == 0.0), scale
        a1 = np.asarray(adv_lib.group_advantages([0.3, 0.7], 1, scale))
        assert np.all(a1 == 0.0) and not np.any(np.isnan(a1)), scale


def test_advantage_errors_and_metrics():
    with pytest.raises(ValueError, match="scale_rewards"):
        adv_lib.group_advantages([1.0, 0.0], 2, "std")
    with pytest.raises(ValueError, match="groups"):
        adv_lib.group_advantages([1.0, 0.0, 1.0], 2)
    m = adv_lib.advantage_metrics([1.0, 1.0, 0.0, 1.0], 2)
    assert m["frac_reward_zero_std"] == 0.5 and m["reward"] == 0.75


# ----- losses: an independent, loop-based numpy reference ----------------------------------------

def _reference_loss(logp, old, ref, adv, mask, loss_type, eps_lo, eps_hi, beta, max_len):
    B, T = logp.shape
    per_tok = np.zeros((B, T))
    kl = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            r = math.exp(logp[b, t] - old[b, t])
            rc = min(max(r, 1 - eps_lo), 1 + eps_hi)
            loss = -min(r * adv[b], rc * adv[b])
            if beta:
                d = ref[b, t] - logp[b, t]
                kl[b, t] = math.exp(d) - d - 1
                loss += beta * kl[b, t]
            per_tok[b, t] = loss
    n_b = mask.sum(1)
    if loss_type == "grpo":
        total = np.mean([per_tok[b].sum() / max(n_b[b], 1) for b in range(B)])
    elif loss_type == "dr_grpo":
        total = per_tok.sum() / (B * max_len)
    else:
        total = per_tok.sum() / max(mask.sum(), 1)
    return total, kl[mask].mean()


def _case():
    # Ratios chosen so both clip sides are active: exp(0.5)=1.65 > 1.28 (high clip, A>0) and
    # exp(-0.7)=0.50 < 0.8 (low clip, A<0); others inside the region or on the "wrong" side.
    logp = np.array([[-1.0, -0.5, -2.0, -1.2, 0.0],
                     [-0.3, -1.7, -0.9, -3.0, -0.2],
                     [-2.0, -0.1, -0.4, -1.1, -1.5]], np.float64)
    old = logp - np.array([[0.5, 0.1, -0.05, 0.0, 9.0],
                           [-0.7, 0.05, 0.3, -0.4, 0.0],
                           [0.2, -0.3, 0.0, 0.0, 0.0]])
    ref = logp + np.array([[0.2, -0.1, 0.3, 0.0, 0.0],
                           [0.1, 0.4, -0.2, 0.05, 0.0],
                           [-0.3, 0.0, 0.1, 0.2, 0.0]])
    adv = np.array([1.5, -0.8, 0.6])
    mask = np.array([[1, 1, 1, 1, 0],
                     [1, 1, 1, 1, 0],
                     [1, 1, 0, 0, 0]], bool)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_reference(loss_type, beta):
    logp, old, ref, adv, mask = _case()
    want, want_kl = _reference_loss(logp, old, ref, adv, mask, loss_type, 0.2, 0.28, beta, 6)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    loss, metrics = losses.grpo_loss(f32(logp), f32(old), f32(adv), jnp.asarray(mask),
                                     loss_type=loss_type, epsilon=0.2, epsilon_high=0.28,
                                     beta=beta, ref_logp_BxT=f32(ref), max_completion_length=6)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    if beta:
        np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=1e-5)
    else:
        assert "kl" not in metrics
    # clip metrics: token (0,0) high-clipped (r=1.65, A>0); token (1,0) low-clipped (r=0.50, A<0);
    # token (1,3) has r=0.67 < 0.8 with A<0 as well -> 2 low; 10 completion tokens in total.
    assert float(metrics["num_completion_tokens"]) == 10
    np.testing.assert_allclose(float(metrics["clip_high"]), 1 / 10, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_low"]), 2 / 10, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_region"]), 3 / 10, rtol=1e-6)


def test_hand_computed_single_token_values():
    """Two one-token sequences, computed on paper."""
    logp = jnp.array([[0.0, math.log(2.0)], [0.0, math.log(0.5)]], jnp.float32)
    old = jnp.zeros((2, 2), jnp.float32)
    mask = jnp.array([[False, True], [False, True]])
    advs = jnp.array([1.0, -1.0])
    # row 0: r=2, clip to 1.28 -> -min(2, 1.28) = -1.28;  row 1: r=0.5, clip to 0.8, A=-1:
    # -min(-0.5, -0.8) = 0.8.  grpo/dapo: mean = (-1.28 + 0.8)/2 = -0.24; dr_grpo: sum/(2*4).
    for lt, want in (("grpo", -0.24), ("dapo", -0.24), ("dr_grpo", -0.48 / 8)):
        loss, _ = losses.grpo_loss(logp, old, advs, mask, loss_type=lt, epsilon=0.2,
                                   epsilon_high=0.28, max_completion_length=4)
        np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    # k3 KL with ref = log 1 = 0 on row 0: exp(-log 2) + log 2 - 1 = 0.5 + 0.6931 - 1.
    kl = losses.per_token_terms(logp, old, advs, mask, epsilon=0.2, beta=1.0,
                                ref_logp_BxT=jnp.zeros((2, 2))).kl_BxT
    np.testing.assert_allclose(float(kl[0, 1]), 0.5 + math.log(2.0) - 1.0, rtol=1e-6)


def test_masked_garbage_does_not_leak():
    """Huge log-prob differences off the mask give no inf/NaN in loss or gradient."""
    logp = jnp.array([[-1.0, 50.0, -1e30]], jnp.float32)
    old = jnp.array([[-1.1, -80.0, 0.0]], jnp.float32)
    mask = jnp.array([[True, False, False]])

    def f(lp):
        return losses.grpo_loss(lp, old, jnp.array([1.0]), mask, loss_type="dapo", beta=0.1,
                                ref_logp_BxT=jnp.zeros_like(lp))[0]

    loss, g = jax.value_and_grad(f)(logp)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
    assert float(g[0, 1]) == 0.0 and float(g[0, 2]) == 0.0


def test_token_loss_weights_sum_and_errors():
    mask = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
    np.testing.assert_allclose(float(losses.token_loss_weights(mask, "dapo").sum()), 1.0)
    np.testing.assert_allclose(float(losses.token_loss_weights(mask, "grpo").sum()), 1.0)
    np.testing.assert_allclose(float(losses.token_loss_weights(mask, "dr_grpo", 3).sum()), 3 / 6)
    with pytest.raises(ValueError, match="max_completion_length"):
        losses.token_loss_weights(mask, "dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        losses.token_loss_weights(mask, "bnpo2")


def test_entropy_from_logits():
    logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]]]))
    want = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    np.testing.assert_allclose(float(losses.entropy_from_logits(logits)[0, 0]), want, rtol=1e-6)
    # temperature -> infinity gives the uniform distribution
    np.testing.assert_allclose(float(losses.entropy_from_logits(logits, 1e6)[0, 0]), math.log(3),
                               rtol=1e-5)


def test_skips_zero_advantage_only_where_such_rows_add_nothing():
    """The train step leaves out rows with advantage 0 only for a loss whose per-token terms are
    the clipped surrogate without the KL term: there such a row's loss and gradient are exactly
    0; with beta > 0 (the KL term) or another per-token loss they are not."""
    cfg = losses.LossConfig(loss_type="dapo", beta=0.0)
    for name in losses.registered_losses():
        loss = losses.get_loss(name)
        if type(loss).per_token is losses.Loss.per_token:
            assert loss.skips_zero_advantage(cfg), name
            assert not loss.skips_zero_advantage(losses.LossConfig(beta=0.04)), name

    class Reinforce(losses.Loss):
        def per_token(self, logp, old, adv, mask, ref, cfg):
            z = jnp.zeros_like(logp)
            return losses.PerTokenTerms(-adv[:, None] * logp, z, z, z, jnp.ones_like(logp))

    assert not Reinforce().skips_zero_advantage(cfg)
    # the premise, for the clipped surrogate: a zero-advantage row's loss and gradient are 0
    logp = jnp.array([[-1.0, -2.0, -0.5]])
    terms = lambda lp: losses.per_token_terms(  # noqa: E731
        lp, jnp.array([[-1.3, -1.0, -0.4]]), jnp.zeros(1), jnp.ones((1, 3), bool), epsilon=0.2)
    assert float(jnp.abs(terms(logp).loss_BxT).sum()) == 0.0
    g = jax.grad(lambda lp: terms(lp).loss_BxT.sum())(logp)
    assert float(jnp.abs(g).sum()) == 0.0
