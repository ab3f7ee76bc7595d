"""The fused update (`das_jax.rl.fused_update`: AdamW applied layer by layer inside a hand-run
backward pass, two passes for the global-norm clip) equals the unfused train step -- the whole
gradient, then AdamW leaf by leaf -- in params, Adam moments, step counts, loss and metrics."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.models.transformer import ActivationConfig
from das_jax.rl import make_optimizer, make_train_step

from test_grpo_train_step import CFG, TEMP, _grpo, tiny_params
from test_train_window import _group_batch

ACT = ActivationConfig(remat="full", attention="xla", attention_chunk=16, logits_chunk=16)
STEPS = 5


def _run(config, grpo, batches, fused, **kw):
    """`batches` through the train step (fused or not) from the same params; (params, opt
    state, per-step metrics)."""
    params = tiny_params(config, seed=3)
    opt = make_optimizer(grpo, STEPS)
    state = opt.init(params)
    step = make_train_step(config, grpo, opt, temperature=TEMP, donate=True, activation=ACT,
                           leafwise=True, fused=fused, **kw)
    metrics = []
    for b in batches:
        params, state, m = step(params, state, b)
        assert step.fused == fused
        metrics.append({k: float(v) for k, v in m.items()})
    return params, state, metrics


# Max error relative to each leaf's largest entry, after two AdamW steps at lr 3e-2 (one step
# moves a weight by up to ~3e-2 of the largest): the fused and unfused updates sum the same
# gradient in different orders, and AdamW's normalisation amplifies that rounding where |g| is
# small. Measured 2.7e-5 and 4.9e-5 on an AMX Xeon whose XLA dots accumulate differently (below
# 1e-5 on the earlier machines); a missed term is far off (dropping the KL term of the
# grpo_kl_unclipped case: 0.15; the second step on another batch: 0.08).
PARAM_TOL = 1e-4


def _max_rel(a, b):
    errs = [float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-12))
            for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]
    return max(errs)


@pytest.mark.parametrize("case", ["dapo_clipped", "grpo_kl_unclipped", "no_clip_untied",
                                  "dapo_clipped_untied", "grpo_kl_decoupled"])
def test_fused_update_equals_unfused(case):
    config = CFG
    # adam_epsilon 1e-4: AdamW's first step is lr * g / (|g| + eps), so for an element with |g|
    # near eps a float-order difference of the gradient becomes a large difference of the update
    # (the tied head's tiniest entries, ~1e-8 after the clip, otherwise); a larger eps keeps the
    # comparison of the two summation orders well conditioned, the math is the same
    kw = dict(micro_batch_size=9, learning_rate=3e-2, adam_epsilon=1e-4)
    step_kw = {}
    if case == "grpo_kl_decoupled":   # the decoupled objective's truncated weights (cap 1.3)
        kw.update(loss_type="grpo", beta=0.04, max_grad_norm=0.05)
        step_kw = dict(decoupled_is_cap=1.3)
    elif case == "dapo_clipped":
        kw.update(loss_type="dapo", max_grad_norm=0.05)  # the clip triggers
    elif case == "grpo_kl_unclipped":
        kw.update(loss_type="grpo", beta=0.04, max_grad_norm=1e3)  # it does not
    elif case == "no_clip_untied":
        kw.update(loss_type="dr_grpo", max_grad_norm=None)
        config = dataclasses.replace(CFG, tie_word_embeddings=False)
    else:  # the norm without the tied head's term: the lm_head's and the embedding's apart
        kw.update(loss_type="dapo", max_grad_norm=0.05)
        config = dataclasses.replace(CFG, tie_word_embeddings=False)
    grpo = _grpo(**kw)
    params0 = tiny_params(config, seed=3)
    batches = [_group_batch(params0, seed=s) for s in (7, 8)]
    # repeated tokens: the embedding's gradient sums rows of the same token (the norm's
    # segment sum in the fused update must group them)
    for b in batches:
        real = np.asarray(b.tokens_BxT)[np.asarray(b.valid_BxT)]
        assert len(np.unique(real)) < len(real)
    p_ref, s_ref, m_ref = _run(config, grpo, batches, fused=False, **step_kw)
    p_new, s_new, m_new = _run(config, grpo, batches, fused=True, **step_kw)
    if step_kw:   # some weights truncated, some not
        assert all(0 < m["is_truncated_fraction"] < 1 for m in m_ref), m_ref
    assert _max_rel(p_new, p_ref) < PARAM_TOL
    assert _max_rel(s_new, s_ref) < PARAM_TOL  # moments and step counts
    assert jax.tree_util.tree_structure(s_new) == jax.tree_util.tree_structure(s_ref)
    for a, b in zip(m_new, m_ref):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # the params moved (not a no-op update)
    assert _max_rel(p_new, params0) > 1e-3


def test_fused_update_adamw_in_row_blocks_equals_unfused(monkeypatch):
    """The non-layer leaves' AdamW in row blocks (blocks of 4 rows here: 9 of them and a last
    one of 1 row for the 37-row embedding, as the [V, D] embedding runs in ~16 MB blocks)
    gives the unfused step's params and moments."""
    from das_jax.rl import fused_update
    monkeypatch.setattr(fused_update, "_BLOCK_BYTES", 4 * CFG.hidden_size * 4)
    blocks = fused_update._row_blocks(np.zeros((CFG.vocab_size, CFG.hidden_size), np.float32))
    assert blocks[:2] == [(0, 4), (4, 4)] and blocks[-1] == (36, 1) and len(blocks) == 10
    config = dataclasses.replace(CFG, tie_word_embeddings=False)  # embed and lm_head in blocks
    grpo = _grpo(micro_batch_size=9, learning_rate=3e-2, adam_epsilon=1e-4, loss_type="dapo",
                 max_grad_norm=0.05, weight_decay=0.1)
    params0 = tiny_params(config, seed=3)
    batches = [_group_batch(params0, seed=s) for s in (7, 8)]
    p_ref, s_ref, m_ref = _run(config, grpo, batches, fused=False)
    p_new, s_new, m_new = _run(config, grpo, batches, fused=True)
    assert _max_rel(p_new, p_ref) < PARAM_TOL
    assert _max_rel(s_new, s_ref) < PARAM_TOL
    for a, b in zip(m_new, m_ref):
        np.testing.assert_allclose(a["update_norm"], b["update_norm"], rtol=1e-5)


def test_fused_update_mixed_precision_tracks_unfused():
    """bf16 compute, float32 master weights and moments: both paths run the same bf16 forward
    and backward; they agree to bf16 rounding and move every weight."""
    grpo = _grpo(micro_batch_size=9, learning_rate=1e-3, loss_type="dapo", max_grad_norm=1.0)
    params0 = tiny_params(CFG, seed=3)
    batches = [_group_batch(params0, seed=7)]
    p_ref, _, m_ref = _run(CFG, grpo, batches, fused=False, compute_dtype="bfloat16")
    p_new, s_new, m_new = _run(CFG, grpo, batches, fused=True, compute_dtype="bfloat16")
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves((p_new, s_new))
               if x.ndim)
    assert _max_rel(p_new, p_ref) < 1e-3
    np.testing.assert_allclose(m_new[0]["loss"], m_ref[0]["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_new[0]["grad_norm"], m_ref[0]["grad_norm"], rtol=2e-2)
    moved = [float(jnp.mean(a != b)) for a, b in
             zip(jax.tree_util.tree_leaves(p_new), jax.tree_util.tree_leaves(params0))]
    assert min(moved) > 0.99  # f32 master weights: every weight moves


def test_configure_allocator_leaves_user_settings_alone():
    import subprocess
    import sys
    code = "from das_jax.malloc import configure_allocator as c; print(','.join(c()))"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["MALLOC_MMAP_THRESHOLD_,MALLOC_TRIM_THRESHOLD_,MALLOC_ARENA_MAX"]
    env["MALLOC_ARENA_MAX"] = "4"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["MALLOC_MMAP_THRESHOLD_,MALLOC_TRIM_THRESHOLD_"]


def test_fused_update_of_a_step_with_nothing_to_train_on():
    """skip_zero_advantage and every advantage 0: no forward / backward, but the AdamW step (its
    momentum still moves the weights) equals the unfused one's zero-gradient step."""
    grpo = _grpo(micro_batch_size=9, learning_rate=3e-2, loss_type="dapo", max_grad_norm=1.0)
    params0 = tiny_params(CFG, seed=3)
    b1 = _group_batch(params0, seed=7)
    b0 = dataclasses.replace(b1, advantages_B=jnp.zeros_like(b1.advantages_B))
    out = {fused: _run(CFG, grpo, (b1, b0), fused, skip_zero_advantage=True)
           for fused in (False, True)}
    assert _max_rel(out[True][0], out[False][0]) < PARAM_TOL
    assert _max_rel(out[True][1], out[False][1]) < PARAM_TOL
    assert out[True][2][1] == pytest.approx(out[False][2][1], rel=1e-5, abs=1e-7)
    assert out[True][2][1]["grad_norm"] == 0.0 and out[True][2][1]["update_norm"] > 0
