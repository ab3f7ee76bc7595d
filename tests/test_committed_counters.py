"""Counters count what was committed: draft tokens past a stop token or max_new_tokens are not
accepted tokens (engine stats, per-request outputs, StepRecord, the DAS calibration)."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.speculation.cost_model import CostModel
from das_jax.speculation.das_policy import DASConfig, DASPolicy
from das_jax.engine.generate import Engine, EngineConfig, Request
from das_jax.engine.policy import FixedPolicy
from das_jax.engine.sampling import SamplingParams
from das_jax.testing import OracleDrafter, tiny_model_config, tiny_params

CFG = tiny_model_config()


@pytest.fixture(scope="module")
def engine_and_future():
    """A greedy rollout s (no stop tokens) whose token s[3] does not occur in s[:3]."""
    eng = Engine(CFG, tiny_params(CFG), eos_token_ids=[],
                 engine_config=EngineConfig(max_slots=1, max_cache_len=128, draft_widths=(1, 8),
                                            exact=True))
    rng = np.random.default_rng(0)
    for _ in range(20):
        req = Request(tuple(int(t) for t in rng.integers(2, 64, 6)))
        (out,), _ = eng.generate([req], SamplingParams(temperature=0.0, max_new_tokens=12))
        s = out.token_ids
        if s[3] not in s[:3]:
            return eng, req, s
    pytest.fail("no prompt gave a rollout with a fresh token at index 3")


def test_stop_token_at_draft_position_3_of_7_counts_2_accepted(engine_and_future):
    eng, req, s = engine_and_future
    # After the prefill token s[0], the oracle drafts s[1:8]: 7 tokens, all correct, with the
    # stop token s[3] at draft position 3. Committed: s[1], s[2], s[3] -> 2 accepted + 1.
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(s[3],))
    (out,), stats = eng.generate([req], sampling, drafter=OracleDrafter({0: s}),
                                 policy=FixedPolicy())
    assert out.token_ids == s[:4] and out.finish_reason == "stop"
    assert stats.forward_passes == 1 and stats.drafted_tokens == 7
    assert stats.accepted_draft_tokens == 2 and out.accepted_draft_tokens == 2
    (step,) = stats.steps
    assert step.accepted == 2 and step.accepted_per_row == (2,) and step.emitted == 3
    assert (step.num_tokens, step.attended_kv) == (8, step.kv_len)
    assert stats.to_dict()["accepted_draft_tokens"] == 2


def test_max_new_tokens_inside_a_draft_counts_only_committed(engine_and_future):
    eng, req, s = engine_and_future
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3)
    (out,), stats = eng.generate([req], sampling, drafter=OracleDrafter({0: s}),
                                 policy=FixedPolicy())
    assert out.token_ids == s[:3] and out.finish_reason == "length"
    assert stats.accepted_draft_tokens == 1 and stats.steps[0].accepted_per_row == (1,)


def test_das_calibration_sees_committed_tokens_only(engine_and_future):
    eng, req, s = engine_and_future
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0, acceptance_ema=1.0),
                    cost_model=CostModel(c_base=1.0, c_tok=1e-6))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(s[3],))
    (out,), stats = eng.generate([req], sampling, drafter=OracleDrafter({0: s}), policy=pol)
    assert stats.steps[0].drafted == 7 and stats.accepted_draft_tokens == 2
    # Depths 1-2 were accepted (factor 1 with EMA weight 1); depths 3-7 count as not accepted.
    assert pol.depth_scale[:2].tolist() == [1.0, 1.0]
    assert (pol.depth_scale[2:7] <= 0.02 + 1e-12).all()
