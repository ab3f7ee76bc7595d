"""Counters count what was committed: draft tokens past a stop token or max_new_tokens are not
accepted tokens (engine stats, per-request outputs, StepRecord, the DAS calibration)."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.speculation.cost_model import CostModel
from das_jax.speculation.das_policy import DASConfig, DASPolicy
from das_jax.engine.generate import Engine, EngineConfig, GenerateStats, Request
from das_jax.engine.policy import FixedPolicy
from das_jax.engine.sampling import SamplingParams
from das_jax.rl.split_rollout import _stats_of, _stats_vector
from das_jax.rollout import DataParallelStats
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
    # per draft position: 7 drafted, positions 1-2 accepted; the oracle names no source
    assert stats.drafted_by_position == [1] * 7
    assert stats.accepted_by_position == [1, 1, 0, 0, 0, 0, 0]
    assert stats.acceptance_by_position() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert stats.drafted_by_source == {"other": 7} and stats.accepted_by_source == {"other": 2}


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


def test_acceptance_counts_per_position_and_source_add_up_and_travel():
    """`GenerateStats.count_acceptance` over steps, `merge_acceptance` (data-parallel replicas)
    and the vector other processes send (`split_rollout`) keep the same counts."""
    st = GenerateStats(drafted_tokens=9, accepted_draft_tokens=4)
    st.count_acceptance(np.array([3, 0, 2, 1]), np.array([1, 0, 2, 0]),
                        np.array([0, -1, 2, 1], np.int8))
    st.count_acceptance(np.array([3]), np.array([1]))           # no sources: "other"
    assert st.drafted_by_position == [4, 3, 2] and st.accepted_by_position == [3, 1, 0]
    assert sum(st.drafted_by_position) == 9 and sum(st.accepted_by_position) == 4
    assert st.drafted_by_source == {"problem": 3, "request": 1, "global": 2, "other": 3}
    assert st.accepted_by_source == {"problem": 1, "request": 0, "global": 2, "other": 1}
    assert st.acceptance_by_source()["global"] == 1.0
    back = _stats_of(_stats_vector(st))
    for f in ("drafted_by_position", "accepted_by_position", "drafted_by_source",
              "accepted_by_source", "drafted_tokens", "accepted_draft_tokens"):
        assert getattr(back, f) == getattr(st, f), f
    both = DataParallelStats.combine([st, None, back])
    assert both.drafted_by_position == [8, 6, 4]
    assert both.accepted_by_source["problem"] == 2 and both.drafted_by_source["other"] == 6
