"""Held-out evaluation (das_jax.rl.evaluate) and the arithmetic task's difficulty keys.

Tiny random model and a character-level tokenizer built in the test; the real reward functions.
"""
from __future__ import annotations

import json
import re

import jax
import pytest

from das_jax.config import ConfigError, config_from_dict
from das_jax.data import Problem
from das_jax.data.synthetic import DEFAULT_TEMPLATES, synthetic_arithmetic
from das_jax.models import ModelConfig, init_params
from das_jax.rl.evaluate import EvalError, eval_due, held_out_problems
from das_jax.rl.rewards import format_reward, math_accuracy_reward
from das_jax.rl.trainer import GRPOTrainer
from das_jax.testing import CharTokenizer

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def make_config(tmp_path, data=None, eval_=None, steps=3):
    return config_from_dict({
        "output_dir": str(tmp_path / "run"),
        "drafter": "none",
        "data": {"kind": "arithmetic", "chat": False, "instruction": "", "num_problems": 4,
                 **(data or {})},
        "rollout": {"max_new_tokens": 8, "temperature": 1.0, "max_slots": 4,
                    "max_cache_len": 512},
        "grpo": {"num_generations": 2, "prompts_per_step": 2, "micro_batch_size": 4,
                 "learning_rate": 1e-3, "reward_funcs": ["math_accuracy", "format"],
                 "reward_weights": [1.0, 0.5]},
        "train": {"steps": steps, "save_every": 100, "seed": 0},
        "eval": {"num_problems": 3, **(eval_ or {})},
    })


def make_trainer(config):
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    return GRPOTrainer(config, model=(CFG, params, CharTokenizer()),
                       reward_fns=[math_accuracy_reward, format_reward])


# ------------------------------------------------------------------ held-out problems
def test_held_out_problems_are_disjoint_from_training_and_deterministic(tmp_path):
    cfg = make_config(tmp_path, data={"num_problems": 20, "min_steps": 1, "max_steps": 1,
                                      "templates": ["counting"]}, eval_={"num_problems": 30})
    train = synthetic_arithmetic(20, 0, min_steps=1, max_steps=1, templates=["counting"])
    held = held_out_problems(cfg, train)
    assert len(held) == 30
    assert not {p.problem_id for p in held} & {p.problem_id for p in train}
    assert not {p.prompt for p in held} & {p.prompt for p in train}
    assert all(p.metadata["template"] == "counting" and p.metadata["num_steps"] == 1
               for p in held)
    assert [p.prompt for p in held_out_problems(cfg, train)] == [p.prompt for p in held]


def test_held_out_problems_drop_questions_seen_in_training(tmp_path):
    cfg = make_config(tmp_path, eval_={"num_problems": 5})
    pool = synthetic_arithmetic(4 + 10, 0)[4:]
    # a training set that happens to contain the first two candidates' questions
    train = synthetic_arithmetic(2, 0) + [Problem(f"x{i}", p.prompt, p.answer)
                                         for i, p in enumerate(pool[:2])]
    held = held_out_problems(cfg, train)
    assert [p.prompt for p in held] == [p.prompt for p in pool[2:7]]


def test_file_kinds_need_a_limit_to_hold_problems_out(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n"
                            for i in range(10)))
    raw = {"data": {"kind": "gsm8k", "path": str(path)}, "eval": {"num_problems": 3}}
    cfg = config_from_dict(raw)
    with pytest.raises(EvalError, match="data.limit"):
        held_out_problems(cfg, [])
    cfg = config_from_dict({**raw, "data": {**raw["data"], "limit": 6}})
    held = held_out_problems(cfg, [Problem(f"gsm8k-{i}", f"q{i}", str(i)) for i in range(6)])
    assert [p.prompt for p in held] == ["q6", "q7", "q8"]


def test_eval_schedule():
    assert [s for s in range(9) if eval_due(s, 8, 0)] == [0, 8]
    assert [s for s in range(8) if eval_due(s, 7, 3)] == [0, 3, 6, 7]


# ------------------------------------------------------------------ in the trainer
def test_trainer_evaluates_at_start_every_and_end(tmp_path, caplog):
    cfg = make_config(tmp_path, eval_={"every": 2, "max_new_tokens": 5})
    trainer = make_trainer(cfg)
    calls = []
    original = trainer.rollouts.engine.generate

    def spy(requests, sampling, **kw):
        calls.append((len(requests), sampling.temperature, sampling.max_new_tokens))
        return original(requests, sampling, **kw)

    trainer.rollouts.engine.generate = spy
    with caplog.at_level("INFO", logger="das_jax"):
        trainer.train(progress=False)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()
             if '"kind": "eval"' in line]
    assert [e["step"] for e in evals] == [0, 2, 3]
    for e in evals:
        assert e["eval_num_problems"] == 3 and 0 <= e["eval_accuracy"] <= 1
        assert e["eval_response_length_mean"] <= 5 and 0 <= e["eval_stopped"] <= 1
        assert e["eval_reward"] == pytest.approx(e["eval_accuracy"] + 0.5 * e["eval_format"])
    # evals are greedy with their own budget; rollouts sample with the rollout budget
    assert [c for c in calls if c[1] == 0.0] == [(3, 0.0, 5)] * 3
    assert all(c == (4, 1.0, 8) for c in calls if c[1] != 0.0)
    text = caplog.text
    assert "evaluating at step 0: 3 held-out problems, greedy: accuracy" in text
    assert "eval accuracy (greedy, held out), step 0 -> 3" in text


def test_eval_scores_the_params_it_is_given(tmp_path):
    from das_jax.rl.evaluate import Evaluator, evaluate
    trainer = make_trainer(make_config(tmp_path, eval_={"num_problems": 2}))
    held = Evaluator.for_trainer(trainer).problems
    run = lambda params: [s["completion"] for s in evaluate(  # noqa: E731
        trainer.rollouts.engine, trainer.tokenizer, held, trainer.reward_fn, max_new_tokens=6,
        params=params, instruction="", chat=False)["eval_samples"]]
    zeroed = jax.tree_util.tree_map(lambda x: x * 0, trainer.params)
    # all-zero weights give uniform logits: greedy picks token 0 (not printable) every time
    assert run(zeroed) == ["", ""]
    assert run(trainer.params) != ["", ""]


def test_eval_disabled_writes_no_eval_record(tmp_path):
    trainer = make_trainer(make_config(tmp_path, eval_={"num_problems": 0}, steps=1))
    trainer.train(progress=False)
    assert '"kind": "eval"' not in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_bad_eval_keys_are_rejected():
    with pytest.raises(ConfigError, match="eval.num_problems"):
        config_from_dict({"eval": {"num_problems": -1}})
    with pytest.raises(ConfigError, match="eval.every"):
        config_from_dict({"eval": {"every": -2}})
    with pytest.raises(ConfigError, match="eval.max_new_tokens"):
        config_from_dict({"rollout": {"max_new_tokens": 64, "max_cache_len": 256},
                          "eval": {"max_new_tokens": 256}})


# ------------------------------------------------------------------ difficulty keys
_STEP_RE = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_counting_template_is_small_and_correct():
    probs = synthetic_arithmetic(200, 5, min_steps=1, max_steps=2, templates=["counting"])
    assert {p.metadata["num_steps"] for p in probs} == {1, 2}
    for p in probs:
        assert all(int(n) <= 20 for n in re.findall(r"\d+", p.prompt)), p.prompt
        lines = p.metadata["solution"].splitlines()
        value = None
        for line in lines[:-1]:
            a, op, b, c = _STEP_RE.search(line).groups()
            assert value is None or int(a) == value
            assert {"+": int(a) + int(b), "-": int(a) - int(b)}[op] == int(c) > 0
            value = int(c)
        assert str(value) == p.answer and lines[-1] == f"#### {p.answer}"


def test_default_templates_leave_out_counting():
    assert "counting" not in DEFAULT_TEMPLATES
    assert {p.metadata["template"] for p in synthetic_arithmetic(100, 1)} <= set(DEFAULT_TEMPLATES)
    with pytest.raises(ValueError, match="no template"):
        synthetic_arithmetic(3, 0, min_steps=3, max_steps=3, templates=["counting"])


def test_difficulty_keys_reach_the_trainers_problems(tmp_path):
    cfg = make_config(tmp_path, data={"num_problems": 6, "min_steps": 2, "max_steps": 2,
                                      "templates": ["counting", "sharing"]})
    trainer = make_trainer(cfg)
    assert len(trainer.problems) == 6
    assert all(p.metadata["num_steps"] == 2 for p in trainer.problems)
    assert {p.metadata["template"] for p in trainer.problems} <= {"counting", "sharing"}


@pytest.mark.parametrize("data, match", [
    ({"min_steps": 4, "max_steps": 2}, "min_steps"),
    ({"max_steps": 6}, "max_steps"),
    ({"templates": ["shoping"]}, "data.templates"),
    ({"templates": []}, "data.templates"),
    ({"kind": "gsm8k", "path": "x.jsonl", "min_steps": 1}, "only apply to data.kind=arithmetic"),
])
def test_bad_difficulty_keys_are_rejected(data, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"data": data})
