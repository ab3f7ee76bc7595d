"""Old log-probs under the trainer's distribution.

The engine reports each sampled token's log-prob under the policy -- the temperature-scaled full
softmax the trainer scores (TRL / verl) -- also when top-k / top-p shape the draw. So with
``grpo.old_logprobs: rollout`` and ``top_p: 0.7`` the importance ratio of an on-policy first step
is 1 up to float rounding (no token clipped; it was 42% when the engine reported the truncated
distribution's log-probs), and ``rollout_logprob_gap`` is reported in both modes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from das_jax.config import config_from_dict
from das_jax.data import Problem
from das_jax.engine.generate import Engine, EngineConfig, Request
from das_jax.engine.sampling import SamplingParams
from das_jax.models import ModelConfig, init_params
from das_jax.rl.logprobs import compute_logprobs
from das_jax.rl.trainer import GRPOTrainer
from das_jax.testing import CharTokenizer

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def vowel_reward(prompts, completions, **kw):
    return [sum(c in "aeiouAEIOU" for c in t) / max(len(t), 1) for t in completions]


PROBLEMS = [Problem(f"p{i}", f"what is {i} plus {i}", str(2 * i)) for i in range(4)]


def _trainer(tmp_path, mode, top_p=0.7, top_k=0, temperature=0.9):
    cfg = config_from_dict({
        "output_dir": str(tmp_path / f"run-{mode}"), "drafter": "none",
        "data": {"kind": "arithmetic", "chat": False, "instruction": ""},
        "rollout": {"max_new_tokens": 16, "temperature": temperature, "top_p": top_p,
                    "top_k": top_k, "max_slots": 8, "max_cache_len": 128},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "micro_batch_size": 8,
                 "learning_rate": 1e-3, "loss_type": "dapo", "beta": 0.0, "old_logprobs": mode,
                 "epsilon": 0.2},
        "train": {"steps": 1, "seed": 0},
    })
    params = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    return GRPOTrainer(cfg, model=(CFG, params, CharTokenizer()), problems=PROBLEMS,
                       reward_fns=[vowel_reward])


@pytest.mark.parametrize("mode", ["rollout", "recompute"])
def test_on_policy_step_top_p_no_clipping_and_gap_reported(tmp_path, mode):
    trainer = _trainer(tmp_path, mode)
    record = trainer.train_one_step()
    assert record["clip_fraction"] is not None and record["clip_fraction"] <= 1e-3, record
    gap = record["rollout_logprob_gap"]
    assert gap is not None and 0.0 <= gap < 1e-3, record
    assert record["response_length_mean"] > 1  # there was something to score


def test_engine_logprobs_are_the_trainers_under_top_k_top_p():
    """Token by token, the engine's reported log-probs equal the trainer's teacher-forced
    log_softmax(logits / T) (not the truncated distribution's, which are larger by -log(mass))."""
    params = init_params(CFG, jax.random.PRNGKey(1), scale=0.5)
    eng = Engine(CFG, params, eos_token_ids=(1,),
                 engine_config=EngineConfig(max_slots=4, max_cache_len=64, draft_widths=(1,)))
    reqs = [Request(tuple(range(2, 2 + n)), problem_id=n) for n in (3, 5, 7)]
    out, _ = eng.generate(reqs, SamplingParams(temperature=0.8, top_k=10, top_p=0.7, max_new_tokens=12))
    for o in out:
        seq = list(o.request.prompt_ids) + o.token_ids
        T = len(seq)
        tokens = jnp.asarray([seq], jnp.int32)
        positions = jnp.arange(T, dtype=jnp.int32)[None]
        valid = jnp.ones((1, T), bool)
        lp = np.asarray(compute_logprobs(CFG, params, tokens, positions, valid, 0.8, 1))[0]
        P = len(o.request.prompt_ids)
        np.testing.assert_allclose(o.logprobs, lp[P:], atol=1e-4)
        assert np.all(np.asarray(o.logprobs) <= 0.0)
