"""Memory features: chunked head + remat + chunked attention exact against the
reference path, loss / advantage registries, mixed precision, KV budget, sharding rules, plan."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.config import GRPOSection
from das_jax.engine.generate import EngineConfig, GenerateError, size_slots
from das_jax.models import ModelConfig
from das_jax.models.kv_cache import DenseKVCache
from das_jax.models.transformer import ActivationConfig
from das_jax.rl import (compute_logprobs, losses, make_batch, make_loss_and_grad, make_optimizer,
                        make_train_step)
from das_jax.rl.batches import micro_batch_plan

from test_grpo_train_step import CFG, TEMP, _batch, _grpo, _tree_rel_err, tiny_params

# Small chunks so that every chunked path takes several chunks (T = 11).
ACT = ActivationConfig(remat="full", attention="xla", attention_chunk=4, logits_chunk=8)


@pytest.fixture(scope="module")
def params():
    return tiny_params(CFG)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_chunked_remat_path_matches_reference(params, loss_type):
    """Loss, metrics and gradient of the memory-bounded path (chunked lm_head + log-softmax,
    remat, chunked dot_product_attention, length-grouped micro-batches) equal the full-logits
    reference, with beta > 0."""
    b = _batch(params, seed=1)
    cfg = _grpo(loss_type=loss_type, beta=0.04, micro_batch_size=4)
    ref = make_loss_and_grad(CFG, cfg, temperature=TEMP, activation=None, group_by_length=False)
    new = make_loss_and_grad(CFG, cfg, temperature=TEMP, activation=ACT, group_by_length=True)
    (l0, g0, m0), (l1, g1, m1) = ref(params, b), new(params, b)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, atol=1e-7)
    for k in ("kl", "entropy", "clip_low", "clip_high", "clip_region", "num_completion_tokens"):
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, atol=1e-7)
    assert _tree_rel_err(g1, g0) <= 1e-5, _tree_rel_err(g1, g0)
    lp0 = compute_logprobs(CFG, params, b.tokens_BxT, b.positions_BxT, b.valid_BxT, TEMP,
                           activation=None)
    lp1 = compute_logprobs(CFG, params, b.tokens_BxT, b.positions_BxT, b.valid_BxT, TEMP, 4,
                           activation=ACT)
    np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp0), rtol=1e-5, atol=1e-5)


def test_micro_batch_plan_groups_by_length():
    plan = micro_batch_plan([10, 300, 20, 290, 15], 2, T=320)
    assert [list(r) for r, _ in plan] == [[1, 3], [2, 4], [0]]
    assert [t for _, t in plan] == [320, 64, 64]
    assert [t for _, t in micro_batch_plan([10, 300], 2, 320, group_by_length=False)] == [320]


@losses.register_loss("toy_reinforce")
class ToyReinforce(losses.Loss):
    """REINFORCE: loss_t = -A * logp_t, token mean over the batch."""

    def per_token(self, logp, old, adv, mask, ref, cfg):
        m = mask.astype(jnp.float32)
        z = jnp.zeros_like(logp)
        return losses.PerTokenTerms(-adv[:, None] * logp * m, z, z, z, jnp.ones_like(logp))

    def weights(self, mask, cfg, num_sequences=None):
        m = jnp.asarray(mask).astype(jnp.float32)
        return m / jnp.maximum(m.sum(), 1.0)


def test_registered_toy_loss_runs_through_train_step(params):
    b = _batch(params, seed=2)
    cfg = _grpo(loss_type="toy_reinforce", micro_batch_size=3, learning_rate=1e-2)
    step = make_train_step(CFG, cfg, make_optimizer(cfg, 5), temperature=TEMP, activation=ACT)
    _, grads, metrics = make_loss_and_grad(CFG, cfg, temperature=TEMP, activation=ACT)(params, b)
    # the loss is -sum_t A_b logp_bt / n_tokens, from independently computed log-probs
    logp = np.asarray(compute_logprobs(CFG, params, b.tokens_BxT, b.positions_BxT, b.valid_BxT,
                                       TEMP, activation=None))
    m = np.asarray(b.completion_mask_BxT, np.float32)
    m[:, 0] = 0
    want = -(np.asarray(b.advantages_B)[:, None] * logp * m).sum() / m.sum()
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
    p1, _, m1 = step(params, make_optimizer(cfg, 5).init(params), b)
    assert float(m1["grad_norm"]) > 0
    assert _tree_rel_err(p1, params) > 1e-4
    with pytest.raises(ValueError, match="toy_reinforce"):
        losses.get_loss("nope")


def test_advantage_registry():
    from das_jax.rl.advantages import get_advantage, group_advantages, register_advantage
    g = GRPOSection(num_generations=2, scale_rewards="none")
    r = jnp.array([1.0, 0.0, 0.5, 0.5])
    np.testing.assert_allclose(get_advantage("grpo")(r, g), group_advantages(r, 2, "none"))

    @register_advantage("toy_raw")
    def raw(rewards, grpo_config):
        return jnp.asarray(rewards)
    np.testing.assert_allclose(get_advantage("toy_raw")(r, g), r)
    with pytest.raises(ValueError, match="advantage_estimator"):
        get_advantage("missing")


def _run(params, b, cfg, compute_dtype, steps):
    opt = make_optimizer(cfg, steps)
    step = make_train_step(CFG, cfg, opt, temperature=TEMP, activation=ACT,
                           compute_dtype=compute_dtype)
    s, seen = opt.init(params), []
    p = params
    for _ in range(steps):
        p, s, m = step(p, s, b)
        seen.append(float(m["loss"]))
    return p, s, seen


def test_mixed_precision_master_weights(params):
    """bf16 compute with f32 master weights and moments: every weight moves (lr 1e-5, far below
    bf16's resolution of the weights), and the loss tracks the f32 run within 1% relative
    (bf16 rounding of the forward: ~0.3% here); pure bf16 params leave most weights unchanged (lossy)."""
    b = _batch(params, seed=3)
    cur = compute_logprobs(CFG, params, b.tokens_BxT, b.positions_BxT, b.valid_BxT, TEMP)
    b = b.replace(old_logprobs_BxT=cur * b.completion_mask_BxT)
    cfg = _grpo(loss_type="dapo", micro_batch_size=3, learning_rate=1e-5, max_grad_norm=None)
    p32, _, l32 = _run(params, b, cfg, None, 3)
    pmx, smx, lmx = _run(params, b, cfg, "bfloat16", 3)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves((pmx, smx))
               if hasattr(x, "dtype") and x.ndim > 0)
    np.testing.assert_allclose(lmx, l32, rtol=1e-2)
    assert lmx[-1] < lmx[0] and l32[-1] < l32[0]
    moved = [float(jnp.mean(a != c)) for a, c in zip(jax.tree_util.tree_leaves(pmx),
                                                    jax.tree_util.tree_leaves(params))]
    assert min(moved) > 0.95, moved  # (norm weights included)
    p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    pbf, _, _ = _run(p16, b, cfg, None, 3)
    unchanged = np.mean(np.concatenate([np.ravel(np.asarray(a == c)) for a, c in zip(
        jax.tree_util.tree_leaves(pbf), jax.tree_util.tree_leaves(p16))]))
    assert unchanged > 0.5, unchanged


def test_kv_budget_sizes_slots_and_refuses():
    per_row = DenseKVCache.nbytes_for(CFG, 1, 512, jnp.float32)
    assert per_row == 512 * 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4
    ec = EngineConfig(max_slots=16, max_cache_len=512, kv_memory_gb=3.5 * per_row / 1e9)
    assert size_slots(CFG, ec, jnp.float32).max_slots == 3
    assert size_slots(CFG, dataclasses.replace(ec, kv_memory_gb=1.0), jnp.float32).max_slots == 16
    with pytest.raises(GenerateError, match="rollout.kv_memory_gb"):
        size_slots(CFG, dataclasses.replace(ec, kv_memory_gb=0.5 * per_row / 1e9), jnp.float32)


def test_kv_cache_layout_ops():
    c = DenseKVCache.zeros(CFG, 3, 8)
    k_new = jnp.ones((CFG.num_layers, 3, 2, CFG.num_kv_heads, CFG.head_dim))
    c = c.write(k_new, 2 * k_new, jnp.array([0, 5, 7], jnp.int32))
    # Keys are stored [L, B, KVH, K, S], values [L, B, KVH, S, K].
    assert c.k.shape == (CFG.num_layers, 3, CFG.num_kv_heads, CFG.head_dim, 8)
    assert c.v.shape == (CFG.num_layers, 3, CFG.num_kv_heads, 8, CFG.head_dim)
    assert float(c.k[0, 1, 0, 0, 5]) == 1 and float(c.v[0, 2, 0, 7, 0]) == 2
    assert float(c.k[0, 2, 0, 0, 6]) == 0  # position 8 of row 2 dropped, 6 untouched
    assert float(c.k[0, 1, 0, 0, 4]) == 0 and float(c.k[0, 1, 0, 0, 6]) == 1
    slots = jnp.ones((CFG.num_layers, 3, CFG.num_kv_heads, CFG.head_dim))
    s = c.write_slots(3 * slots, 4 * slots, jnp.array([2, 0, 3], jnp.int32),
                      jnp.array([1, 2, 0], jnp.int32))   # row 3: a padding slot, dropped
    assert float(s.k[0, 2, 1, 5, 1]) == 3 and float(s.v[0, 0, 1, 2, 5]) == 4
    assert float(s.k[0, 0, 0, 0, 3]) == 0 and float(s.k[0, 0, 0, 0, 1]) == 1
    g = c.gather_rows(jnp.array([2, 2], jnp.int32))
    assert g.batch == 2 and float(g.v[0, 1, 0, 7, 0]) == 2
    d = DenseKVCache.zeros(CFG, 4, 8).insert_rows(jnp.array([3, 9], jnp.int32), g,
                                                  jnp.array([0, 1], jnp.int32))
    assert float(d.v[0, 3, 0, 7, 0]) == 2 and float(d.v[0, :3].sum()) == 0
    assert float(d.k[0, 3, 0, 0, 7]) == 1 and float(d.k[0, :3].sum()) == 0
    assert DenseKVCache.abstract(CFG, 3, 8).k.shape == c.k.shape


def test_sharding_rules_table():
    from das_jax.parallel import sharding as sh
    from das_jax.models import init_params
    cfg = dataclasses.replace(CFG, attention_bias=True, qk_norm=True, tie_word_embeddings=False)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    axes = sh.logical_axes(shapes)
    assert axes["layers"]["wq"] == ("layers", "embed", "heads", "head_dim")
    mesh = sh.make_mesh(fsdp=1)
    assert all(s.spec == jax.sharding.PartitionSpec(*([None] * len(a)))
               for s, a in zip(jax.tree_util.tree_leaves(sh.param_shardings(shapes, mesh)),
                               jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple))))

    class FakeMesh:
        shape = {"data": 1, "fsdp": 4, "tensor": 2}
    spec = sh.logical_to_spec(("layers", "embed", "heads", "head_dim"), (2, 16, 6, 8), FakeMesh())
    assert tuple(spec) == (None, "fsdp", "tensor", None)
    spec = sh.logical_to_spec(("vocab", "embed"), (37, 18), FakeMesh())  # nothing divides
    assert tuple(spec) == (None, None)


def test_plan_tiny_config_fits_and_refuses():
    """`plan_in_process` on a tiny model: sensible rows; too little memory gives the advice."""
    from das_jax.config import config_from_dict
    from das_jax.plan import plan_in_process
    config = config_from_dict({
        "rollout": {"max_new_tokens": 16, "max_slots": 4, "max_cache_len": 64,
                    "draft_widths": [1, 4]},
        "grpo": {"num_generations": 2, "prompts_per_step": 2, "micro_batch_size": 2}})
    p = plan_in_process(config, 1, int(1e9), model_config=CFG)
    n_params = CFG.num_params()
    assert p.rows["master"] == n_params * 4
    assert 0 <= p.rows["optimizer"] - 2 * n_params * 4 <= 64  # Adam moments + step counts
    assert p.rows["kv_cache"] == DenseKVCache.nbytes_for(CFG, 4, 64, jnp.float32)
    assert p.fits and 0 < p.peak < 1e8
    small = plan_in_process(config, 1, p.peak // 2, model_config=CFG)
    assert not small.fits
    assert "grpo.micro_batch_size" in small.advice(config) or "rollout" in small.advice(config)
    assert "DOES NOT FIT" in small.table()


def test_plan_of_a_fused_update_counts_its_programs_not_a_whole_gradient():
    """A one-device run whose whole batch is one micro-batch trains with the fused update: the
    plan compiles its programs (forward, one layer, finish) at the largest packed micro-batch,
    holds no whole gradient and has no separate train phase; any other run plans the gradient
    kernel and the optimizer update."""
    from das_jax.config import config_from_dict
    from das_jax.plan import fuses_update, packed_shape, plan_in_process
    base = {"rollout": {"max_new_tokens": 16, "max_slots": 4, "max_cache_len": 64,
                        "draft_widths": [1, 4]},
            "grpo": {"num_generations": 2, "prompts_per_step": 2, "micro_batch_size": 4}}
    config = config_from_dict(base)
    assert fuses_update(config, 1) and not fuses_update(config, 2)
    assert not fuses_update(config_from_dict(base, ["train.fused_update=false"]), 1)
    assert not fuses_update(config_from_dict(base, ["grpo.micro_batch_size=3"]), 1)
    # 4 completions, each alone in a row of at most 64 tokens in the worst case, window 32
    assert packed_shape(config) == (4, 64, 4, 32)
    fused = plan_in_process(config, 1, int(1e9), model_config=CFG)
    unfused = plan_in_process(config_from_dict(base, ["train.fused_update=false"]), 1, int(1e9),
                              model_config=CFG)
    assert fused.shapes["update"] == "fused" and unfused.shapes["update"] == "unfused"
    assert {"fused_forward", "fused_layer", "fused_finish"} <= set(fused.programs)
    assert "accumulate_grads" not in fused.programs and "accumulate_grads" in unfused.programs
    assert set(fused.phases) == {"rollout", "update"}
    assert set(unfused.phases) == {"rollout", "train", "update"}
    assert fused.rows["gradients"] == 0 < unfused.rows["gradients"]
    # the update holds at least the params, the moments and the forward's layer inputs
    x_in_L = CFG.num_layers * 4 * 64 * CFG.hidden_size * 4
    assert fused.phases["update"] >= fused.rows["master"] + fused.rows["optimizer"] + x_in_L
    assert fused.programs["fused_forward"]["output"] >= x_in_L
    assert "fused" in fused.table()
