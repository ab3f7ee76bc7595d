"""The draft head trained online during GRPO (`train.draft_loss_weight`): the policy's run is
unchanged (same rollouts, metrics and params as the run without a head), the head's loss is
EAGLE-3's draft loss over the batch's completions, its weights reach the rollout after each
update, and they are checkpointed, resumed and exported with the run.

Tiny random models built in the test, a character-level tokenizer, float32.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.config import ConfigError, config_from_dict
from das_jax.data import Problem
from das_jax.draft_head.features import block_features
from das_jax.draft_head.head import MATRICES, HeadConfig, draft_loss, init_head
from das_jax.draft_head.online import OnlineConfig, OnlineHeadTrainer
from das_jax.draft_head.store import DraftHead, load_head, policy_fingerprint, save_head
from das_jax.rl.trainer import GRPOTrainer
from das_jax.testing import CharTokenizer, tiny_model_config, tiny_params

CFG = tiny_model_config(rope_theta=100000.0)
VD = 24
PROBLEMS = [Problem(f"p{i}", f"what is {i} plus {i}", str(2 * i)) for i in range(4)]
# (not rollout_logprob_gap: the engine's log-probs round with the verify width, which the
# drafts change)
POLICY_METRICS = ("reward_mean", "loss", "grad_norm", "entropy", "clip_fraction",
                  "response_length_mean")


def even_char_reward(prompts, completions, **kw):
    alpha = CharTokenizer.alphabet
    return [sum(alpha.index(c) % 2 == 0 for c in t) / max(len(t), 1) for t in completions]


def _head(model_config=CFG, seed=0, name=None):
    hc = HeadConfig.for_policy(model_config, VD)
    params = init_head(hc, jax.random.PRNGKey(seed), scale=0.3)
    d2t = (np.arange(VD, dtype=np.int32) * 3 + 1) % model_config.vocab_size
    meta = policy_fingerprint(name, model_config) if name else {}
    return DraftHead(hc, {k: np.asarray(v) for k, v in params.items()}, d2t, meta)


def _config(tmp_path, run, head_path=None, **train):
    raw = {
        "output_dir": str(tmp_path / run),
        # every row verifies its whole draft: whether a step drafts does not follow measured
        # step times (with `das` a loaded machine could leave a step without head drafts)
        "drafter": "das-unlimited",
        "data": {"kind": "arithmetic", "chat": False, "instruction": ""},
        "rollout": {"max_new_tokens": 12, "temperature": 1.0, "max_slots": 4,
                    "max_cache_len": 128, "draft_widths": [1, 4]},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "micro_batch_size": 4,
                 "learning_rate": 3e-3, "loss_type": "dapo", "beta": 0.0},
        "train": {"steps": 3, "save_every": 2, "seed": 0, **train},
    }
    if head_path is not None:
        raw["draft_head"] = {"path": str(head_path), "steps": 2}
    return config_from_dict(raw)


def _head_file(tmp_path):
    name = config_from_dict({}).model.source
    path = tmp_path / "head.safetensors"
    save_head(str(path), _head(name=name))
    return path


def _trainer(config):
    return GRPOTrainer(config, model=(CFG, tiny_params(CFG), CharTokenizer()),
                       problems=PROBLEMS, reward_fns=[even_char_reward])


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


def _run(config, **kw):
    trainer = _trainer(config)
    tokens = []
    original = trainer.rollout

    def recording(step):
        rb = original(step)
        tokens.append([list(o.token_ids) for o in rb.outputs])
        return rb
    trainer.rollout = recording
    return trainer, trainer.train(progress=False, **kw), tokens


def test_online_head_leaves_the_policy_run_unchanged_and_reaches_the_rollout(tmp_path,
                                                                            caplog):
    """Policy metrics, rollouts and params equal the run without a head (bit for bit: the
    head's loss runs in its own programs); the head's params move, its loss is logged, the
    rollout drafts with the trained weights, and the run directory holds them."""
    head_path = _head_file(tmp_path)
    base, base_rec, base_tok = _run(_config(tmp_path, "plain"))
    frozen, frozen_rec, _ = _run(_config(tmp_path, "frozen", head_path))
    caplog.clear()  # the two runs above logged epoch lines of their own
    with caplog.at_level(logging.INFO, logger="das_jax.train"):
        online, rec, tok = _run(_config(tmp_path, "online", head_path, draft_loss_weight=0.5,
                                        draft_learning_rate=1e-2))
    epoch_lines = [r.getMessage() for r in caplog.records
                   if r.getMessage().startswith("epoch 0 acceptance")
                   and "online draft head" in r.getMessage()]
    want = (sum(r["draft_loss"] for r in rec[:2]) / 2)
    assert len(epoch_lines) == 1 and f"online draft head: loss {want:.3f}" in epoch_lines[0]
    assert tok == base_tok
    for a, b in zip(base_rec, rec):
        for k in POLICY_METRICS:
            assert a[k] == b[k], (k, a[k], b[k])
    np.testing.assert_array_equal(_flat(online.params), _flat(base.params))
    assert all(np.isfinite(r["draft_loss"]) and r["draft_loss"] > 0 for r in rec)
    assert all(0 <= r["draft_top1"] <= 1 and r["draft_grad_norm"] > 0 for r in rec)
    assert all(0 < r["draft_train_s"] < r["train_s"] for r in rec)
    assert "draft_loss" not in frozen_rec[0]
    assert online.draft_trainer.updates == 3
    start = _head().params
    trained = online.draft_trainer.params
    assert max(float(np.abs(np.asarray(trained[k]) - start[k]).max()) for k in start) > 1e-3
    # the rollout's head holds the trained weights
    pushed = online.rollouts.draft_head.params
    for k in start:
        np.testing.assert_array_equal(np.asarray(pushed[k]), np.asarray(trained[k]))
    # the head drafted in every step, frozen or trained
    assert all(r["drafted_by_source"].get("head", 0) > 0 for r in rec + frozen_rec)
    # exported at the last checkpoint (step 3), loadable as draft_head.path
    saved = load_head(str(tmp_path / "online" / "draft_head.safetensors"))
    assert saved.meta["online_updates"] == 3 and saved.meta["online_step"] == 3
    for k in start:
        np.testing.assert_array_equal(saved.params[k], np.asarray(trained[k]))
    metrics = [json.loads(x) for x in
               (tmp_path / "online" / "metrics.jsonl").read_text().splitlines()]
    assert [m["draft_loss"] for m in metrics] == [r["draft_loss"] for r in rec]


def test_online_head_resumes_where_it_stopped(tmp_path):
    """Killed after step 2's checkpoint and resumed: the head's params, optimizer state and
    losses equal the uninterrupted run's."""
    head_path = _head_file(tmp_path)
    kw = dict(steps=4, save_every=2, draft_loss_weight=1.0, draft_learning_rate=1e-2)
    full, full_rec, _ = _run(_config(tmp_path, "full", head_path, **kw))
    first = _trainer(_config(tmp_path, "cut", head_path, **kw))
    first.train(progress=False, stop_after=2)
    resumed = _trainer(_config(tmp_path, "cut", head_path, **kw))
    rec = resumed.train(resume=True, progress=False)
    assert [r["step"] for r in rec] == [3, 4]
    assert resumed.draft_trainer.updates == 4
    np.testing.assert_allclose([r["draft_loss"] for r in rec],
                               [r["draft_loss"] for r in full_rec[2:]], rtol=1e-5)
    np.testing.assert_allclose(_flat(resumed.draft_trainer.params),
                               _flat(full.draft_trainer.params), atol=1e-6)
    np.testing.assert_allclose(_flat(resumed.draft_trainer.opt_state),
                               _flat(full.draft_trainer.opt_state), atol=1e-6)


def test_online_loss_is_the_draft_loss_of_the_policys_features():
    """One micro-batch: the loss is weight x `head.draft_loss` over the policy's teacher-forced
    features and top-M teacher (completion positions only); the update moves the head the way
    AdamW's first step does (lr x sign of the clipped gradient); repeated updates on one batch
    lower the loss."""
    head = _head(seed=1)
    params = tiny_params(CFG)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, CFG.vocab_size, 5)) for _ in range(3)]
    outs = [list(rng.integers(3, CFG.vocab_size, n)) for n in (7, 4, 9)]
    cfg = OnlineConfig(weight=0.5, learning_rate=1e-2, max_grad_norm=1e9, steps=2, top_m=4,
                       micro_batch_size=4)
    online = OnlineHeadTrainer(head, CFG, cfg)
    m = online.update(params, prompts, outs)

    T = 64
    tok = np.zeros((4, T), np.int32)
    valid = np.zeros((4, T), bool)
    target = np.zeros((4, T), bool)
    for r, (p, o) in enumerate(zip(prompts, outs)):
        s = p + o
        tok[r, :len(s)], valid[r, :len(s)] = s, True
        target[r, len(p) - 1:len(s) - 1] = True
    tok[3], valid[3] = tok[0], valid[0]
    d2t = jnp.asarray(head.draft_to_target)
    feats, tid, tp = block_features(CFG, params, tok, valid, head.config.feature_layers, 4,
                                    vocab_ids=d2t)
    embed = jnp.asarray(params["embed"], jnp.float32)
    start = {k: jnp.asarray(v) for k, v in head.params.items()}
    (want, wm), g = jax.value_and_grad(
        lambda hp: draft_loss(head.config, hp, embed, feats, tok, valid, target, tid, tp, 2),
        has_aux=True)(start)
    np.testing.assert_allclose(m["draft_loss"], 0.5 * float(want), rtol=1e-5)
    np.testing.assert_allclose(m["draft_top1"], float(wm["top1_step1"]), rtol=1e-6)
    gnorm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(g))))
    np.testing.assert_allclose(m["draft_grad_norm"], 0.5 * gnorm, rtol=1e-4)
    # AdamW's first step: -lr * g / (|g| + eps) elementwise (no decay)
    k = "fc"
    step = np.asarray(online.params[k]) - np.asarray(start[k])
    big = np.abs(np.asarray(g[k])) > 1e-4
    np.testing.assert_allclose(step[big], -1e-2 * np.sign(np.asarray(g[k]))[big], rtol=1e-3)
    losses = [m["draft_loss"]] + [online.update(params, prompts, outs)["draft_loss"]
                                  for _ in range(5)]
    assert losses[-1] < losses[0]
    assert online.update(params, prompts, [[], [], [1]]) == {}   # nothing to train on
    assert online.updates == 6


def test_online_head_config_errors(tmp_path):
    """A weight without a head, a negative weight, a bad rate or clip: one-line config errors;
    a state of another head is refused."""
    with pytest.raises(ConfigError, match="draft_head.path is null"):
        _config(tmp_path, "x", draft_loss_weight=0.1)
    head_path = _head_file(tmp_path)
    with pytest.raises(ConfigError, match="train.draft_loss_weight must be >= 0"):
        _config(tmp_path, "x", head_path, draft_loss_weight=-1.0)
    with pytest.raises(ConfigError, match="train.draft_learning_rate must be > 0"):
        _config(tmp_path, "x", head_path, draft_loss_weight=1.0, draft_learning_rate=0.0)
    with pytest.raises(ConfigError, match="train.draft_max_grad_norm must be > 0"):
        _config(tmp_path, "x", head_path, draft_loss_weight=1.0, draft_max_grad_norm=-1.0)
    online = OnlineHeadTrainer(_head(), CFG, OnlineConfig())
    other = OnlineHeadTrainer(dataclasses.replace(
        _head(), config=dataclasses.replace(_head().config, draft_vocab_size=VD + 1),
        params={**_head().params, "lm_head": np.zeros((VD + 1, CFG.hidden_size), np.float32)}),
        CFG, OnlineConfig())
    with pytest.raises(ValueError, match="other params or shapes"):
        online.load_state_dict(other.state_dict())


def test_online_head_in_an_asynchronous_run(tmp_path):
    """`train.async_steps: 1`: the head trains each step from the current params while the next
    step's rollouts are generated; each update reaches the rollout's head."""
    head_path = _head_file(tmp_path)
    trainer, rec, _ = _run(_config(tmp_path, "async", head_path, async_steps=1,
                                   draft_loss_weight=1.0, draft_learning_rate=1e-2))
    assert [r["step"] for r in rec] == [1, 2, 3]
    assert all(np.isfinite(r["draft_loss"]) for r in rec)
    assert trainer.draft_trainer.updates == 3
    pushed = trainer.rollouts.draft_head.params
    for k, v in trainer.draft_trainer.params.items():
        np.testing.assert_array_equal(np.asarray(pushed[k]), np.asarray(v))


def test_memory_plan_counts_the_head_and_its_online_update(tmp_path):
    """`draft_head.path` adds the head's weights, cache and prompt features to the rollout
    phase; online training adds its AdamW state and a phase for its gradient program."""
    from das_jax.plan import plan_in_process
    head_path = _head_file(tmp_path)
    base = {"rollout": {"max_new_tokens": 16, "max_slots": 4, "max_cache_len": 64,
                        "draft_widths": [1, 4]},
            "grpo": {"num_generations": 2, "prompts_per_step": 2, "micro_batch_size": 2}}
    plain = plan_in_process(config_from_dict(base), 1, int(1e9), model_config=CFG)
    frozen = plan_in_process(config_from_dict({**base, "draft_head": {"path": str(head_path)}}),
                             1, int(1e9), model_config=CFG)
    hc = _head().config
    head_b = 4 * sum(int(np.prod(np.shape(v))) for v in _head().params.values())
    cache_b = 2 * 4 * 64 * hc.num_kv_heads * hc.head_dim * 4 + 16
    feats_b = 2 * 64 * 3 * CFG.hidden_size * 4
    assert frozen.rows["draft_head"] == head_b + cache_b + feats_b
    assert frozen.phases["rollout"] == plain.phases["rollout"] + frozen.rows["draft_head"]
    assert "draft_head_optimizer" not in frozen.rows
    online = plan_in_process(config_from_dict(
        {**base, "draft_head": {"path": str(head_path)}, "train": {"draft_loss_weight": 1.0}}),
        1, int(1e9), model_config=CFG)
    assert online.rows["draft_head_optimizer"] == 3 * head_b
    assert online.programs["draft_head_grad"]["output"] >= head_b
    assert online.phases["draft_head_update"] > online.rows["draft_head_optimizer"]
    assert online.phases["rollout"] == frozen.phases["rollout"] + 3 * head_b
    # a head drafting in bfloat16: its matrices at half the bytes on the rollout side; online,
    # the trainer's float32 weights beside the moments
    mats = 2 * sum(int(np.prod(np.shape(v))) for k, v in _head().params.items()
                   if k in MATRICES)
    bf16 = {**base, "draft_head": {"path": str(head_path), "dtype": "bfloat16"}}
    half = plan_in_process(config_from_dict(bf16), 1, int(1e9), model_config=CFG)
    assert half.rows["draft_head"] == frozen.rows["draft_head"] - mats
    half_online = plan_in_process(config_from_dict({**bf16, "train": {"draft_loss_weight": 1.0}}),
                                  1, int(1e9), model_config=CFG)
    assert half_online.rows["draft_head_optimizer"] == 4 * head_b


def test_prequential_replay_scores_each_batch_before_training_on_it(tmp_path):
    """Learning rate 0 scores the frozen head (every epoch's loss is the frozen head's on that
    epoch); a positive rate trains: the same rollouts replayed as a second epoch score better
    than the first time. The CLI's bad inputs are one-line errors."""
    import subprocess
    import sys

    from das_jax.bench.drafter_trace import TraceRollout
    from das_jax.draft_head.online import prequential_replay

    head = _head(seed=2)
    params = tiny_params(CFG)
    rng = np.random.default_rng(1)
    base = [TraceRollout(0, f"q{i % 2}", list(rng.integers(3, CFG.vocab_size, 4)),
                         list(rng.integers(3, CFG.vocab_size, 10))) for i in range(8)]
    rollouts = base + [dataclasses.replace(r, epoch=1) for r in base]
    res = prequential_replay(CFG, params, head, rollouts, [0.0, 3e-2], batch=8, micro_batch=4,
                             steps=2, top_m=4)
    frozen, trained = res[0.0], res[3e-2]
    assert [r["epoch"] for r in frozen] == [0, 1] and all(r["batches"] == 1 for r in frozen)
    assert frozen[0]["loss"] == pytest.approx(frozen[1]["loss"], rel=1e-6)   # same rollouts
    assert trained[0]["loss"] == pytest.approx(frozen[0]["loss"], rel=1e-6)  # scored first
    assert trained[1]["loss"] < frozen[1]["loss"]

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "das_jax.cli", "draft-head", "replay",
                               *argv], capture_output=True, text=True)
    out = run("trace.jsonl", "--head", str(tmp_path / "missing.safetensors"))
    assert out.returncode == 2 and "no such file" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = run("trace.jsonl", "--head", "h", "--learning-rates", "1e-4,-1")
    assert out.returncode == 2 and "--learning-rates" in out.stderr
