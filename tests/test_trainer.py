"""The GRPO trainer loop: lossless with DAS, exact resume, failing rewards, bad checkpoints.

Tiny random model, a character-level tokenizer and a token-parity reward built in the test.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import jax
import numpy as np
import pytest

from das_jax.config import config_from_dict
from das_jax.data import Problem
from das_jax.models import init_params
from das_jax.rl.run_dir import RunDirError
from das_jax.rl.trainer import GRPOTrainer, TrainError
from das_jax.testing import tiny_model_config, tiny_params
from das_jax.testing import CharTokenizer

CFG = tiny_model_config(rope_theta=100000.0)   # the config these runs were tuned with


def even_char_reward(prompts, completions, **kw):
    """Fraction of characters of the completion that sit at even alphabet positions."""
    alpha = CharTokenizer.alphabet
    return [sum(alpha.index(c) % 2 == 0 for c in t) / max(len(t), 1) for t in completions]


PROBLEMS = [Problem(f"p{i}", f"what is {i} plus {i}", str(2 * i)) for i in range(4)]


def make_config(tmp_path, drafter="none", das=None, **train):
    raw = {
        "output_dir": str(tmp_path / f"run-{drafter}"),
        "drafter": drafter,
        "data": {"kind": "arithmetic", "chat": False, "instruction": ""},
        "rollout": {"max_new_tokens": 12, "temperature": 1.0, "max_slots": 4,
                    "max_cache_len": 128},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "micro_batch_size": 4,
                 "learning_rate": 3e-3, "loss_type": "dapo", "beta": 0.0},
        "train": {"steps": 3, "save_every": 2, "seed": 0, **train},
    }
    if das is not None:
        raw["das"] = das
    return config_from_dict(raw)


def make_trainer(config, reward=even_char_reward):
    params = tiny_params(CFG)
    return GRPOTrainer(config, model=(CFG, params, CharTokenizer()), problems=PROBLEMS,
                       reward_fns=[reward])


def flat(params):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(params)])


def test_training_is_lossless_with_das(tmp_path):
    runs = {}
    for drafter in ("none", "das"):
        # Every draft verified (the budget's choices follow the measured step times, and on a
        # loaded machine it may draft nothing in 3 steps: then the identity would be vacuous).
        das = {"policy": {"unlimited": True}} if drafter == "das" else None
        trainer = make_trainer(make_config(tmp_path, drafter, das))
        tokens = []
        original = trainer.rollout

        def recording_rollout(step, _orig=original, _tokens=tokens):
            rb = _orig(step)
            _tokens.append([o.token_ids for o in rb.outputs])
            return rb
        trainer.rollout = recording_rollout
        records = trainer.train(progress=False)
        runs[drafter] = (tokens, records, flat(trainer.params))
    (t0, r0, p0), (t1, r1, p1) = runs["none"], runs["das"]
    assert t0 == t1                                  # identical rollouts, every step
    assert [r["reward_mean"] for r in r0] == [r["reward_mean"] for r in r1]
    assert [r["loss"] for r in r0] == [r["loss"] for r in r1]
    assert all(r["rollout_logprob_gap"] < 1e-4 for r in r0 + r1)  # sampler agrees with trainer
    np.testing.assert_array_equal(p0, p1)            # identical parameters, bit for bit
    assert any(r["loss"] != 0 for r in r0)           # the updates were real
    assert sum(r["accepted_draft_tokens"] for r in r1) > 0   # and DAS did speculate
    assert r1[-1]["epoch"] == 1                       # 2 steps per epoch over 4 problems
    # Run directory artefacts.
    run_dir = tmp_path / "run-das"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert (run_dir / "config.yaml").exists() and list((run_dir / "tb").iterdir())
    assert (run_dir / "plots" / "reward.png").exists()
    assert (run_dir / "plots" / "rollout_time.png").exists()


def test_resume_equals_uninterrupted(tmp_path):
    full = make_trainer(make_config(tmp_path / "a", steps=4, save_every=2))
    full.train(progress=False)
    cfg = make_config(tmp_path / "b", steps=4, save_every=2)
    first = make_trainer(cfg)
    first.train(progress=False, stop_after=2)        # "killed" after step 2's checkpoint
    # the Adam moments go once the run is complete (after its last checkpoint), not before
    assert full.opt_state is None and first.opt_state is not None
    with pytest.raises(RunDirError, match="--resume"):
        make_trainer(cfg).train(progress=False)      # refuses to overwrite a run
    resumed = make_trainer(cfg)
    records = resumed.train(resume=True, progress=False)
    assert [r["step"] for r in records] == [3, 4]
    np.testing.assert_allclose(flat(resumed.params), flat(full.params), atol=1e-6)
    lines = (tmp_path / "b" / "run-none" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


def test_a_raising_reward_scores_zero_and_the_run_continues(tmp_path, caplog):
    def broken(prompts, completions, **kw):
        raise RuntimeError("reward server down")

    trainer = make_trainer(make_config(tmp_path, steps=1), reward=broken)
    with caplog.at_level(logging.ERROR):
        records = trainer.train(progress=False)
    assert records[0]["reward_mean"] == 0.0
    assert "reward server down" in caplog.text


def test_checkpoint_of_another_model_is_rejected(tmp_path):
    cfg = make_config(tmp_path, steps=2, save_every=2)
    make_trainer(cfg).train(progress=False)
    other = dataclasses.replace(CFG, intermediate_size=48)
    trainer = GRPOTrainer(cfg, model=(other, init_params(other, jax.random.PRNGKey(0)),
                                      CharTokenizer()), problems=PROBLEMS,
                          reward_fns=[even_char_reward])
    with pytest.raises(Exception, match="checkpoint"):
        trainer.train(resume=True, progress=False)
