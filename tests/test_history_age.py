"""Drafter histories tagged by policy version, and the DAS policy's acceptance calibration by the
age of the history a draft comes from (synchronous and asynchronous GRPO alike)."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.drafter import ProblemHistory, SuffixDrafter
from das_jax.engine.policy import RowView, StepRecord, packed_step_shape
from das_jax.speculation.acceptance import AGE_BUCKETS, age_bucket, support_prior
from das_jax.speculation.cost_model import CostModel
from das_jax.speculation.das_policy import DASConfig, DASPolicy


def _rollout(h, pid, tokens, version):
    h.set_policy_version(version)
    handle = h.start_rollout(pid, [1, 2, 3])
    h.extend_rollout(handle, tokens)
    h.finish_rollout(handle)


def test_rollouts_carry_their_policy_version_and_the_history_its_age():
    h = ProblemHistory(window=1)
    assert np.isnan(h.mean_version("p")) and np.isnan(h.age("p"))
    _rollout(h, "p", [5, 6, 7], 0)
    _rollout(h, "p", [5, 6, 8], 0)
    h.advance_epoch()
    h.set_policy_version(6)
    live = h.start_rollout("p", [1, 2, 3])
    assert h.versions("p") == [0, 0, 6]           # a live rollout counts, at its version
    assert h.mean_version("p") == pytest.approx(2.0)   # (0 + 0 + 6) / 3
    assert h.age("p") == pytest.approx(4.0)
    h.finish_rollout(live)
    h.set_policy_version(9)                          # the policy moved on: the history aged
    assert h.age("p") == pytest.approx(7.0)
    # the window slides past epoch 0: only the version-6 rollout is left
    h.advance_epoch()
    assert h.mean_version("p") == pytest.approx(6.0) and h.versions("p") == [6]
    # checkpoints keep the versions; a state written before versions loads as version 0
    other = ProblemHistory(window=1)
    other.load_state_dict(h.state_dict())
    assert other.policy_version == 9 and other.mean_version("p") == pytest.approx(6.0)
    old = h.state_dict()
    old.pop("policy_version")
    for p in old["problems"]:
        p[3] = [[ro[:4] + ro[5:] for ro in ep] for ep in p[3]]   # no version column
    other.load_state_dict(old)
    assert other.policy_version == 0 and other.mean_version("p") == 0.0
    with pytest.raises(ValueError, match="policy version must be >= 0"):
        h.set_policy_version(-1)


def test_drafts_report_the_age_of_their_history():
    d = SuffixDrafter(window=4)
    d.set_policy_version(0)
    for r in range(2):                               # epoch 0: problem a, version 0
        d.begin(r, "a", [1, 2, 3])
        d.append(r, [4, 5, 6, 7])
        d.end(r)
    d.advance_epoch()
    d.set_policy_version(3)
    d.begin(10, "a", [1, 2, 3])                      # a's history: 0, 0 and itself at 3
    d.begin(11, "b", [1, 2, 3])                      # b: only itself
    db = d.propose_batch(np.array([10, 11]), np.array([4, 4]))
    np.testing.assert_allclose(db.age_A, [3 - 1.0, 0.0])
    assert db.lens_A[0] > 0                          # a drafts from its history
    d.begin(12, "a", [1, 2, 3])                      # a sibling: the problem's history is younger
    db = d.propose_batch(np.array([10, 12, 11]), np.array([4, 4, 4]))
    np.testing.assert_allclose(db.age_A, [3 - 1.5, 3 - 1.5, 0.0])
    np.testing.assert_allclose(db.cut(np.array([1, 0, 2])).age_A, db.age_A)   # cut keeps ages
    # the state round trip keeps the ages
    other = SuffixDrafter(window=4)
    other.load_state_dict(d.state_dict())
    np.testing.assert_allclose(other.propose_batch(np.array([10, 12, 11]),
                                                   np.array([4, 4, 4])).age_A, db.age_A)


def test_age_buckets():
    assert age_bucket([np.nan, -2, 0, 0.9, 1, 1.9, 2, 3.5, 4, 7, 8, 15.9, 16, 1e6]).tolist() == \
        [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def _batch(age):
    from das_jax.drafter.base import DraftBatch
    A, K = len(age), 4
    return DraftBatch(np.ones((A, K), np.int32), np.ones((A, K), np.float32),
                      np.full((A, K), 40, np.int32), np.full(A, K, np.int32),
                      np.ones(A, bool), np.asarray(age, np.float32))


@pytest.mark.parametrize("on", [True, False], ids=["age-calibration", "off"])
def test_calibration_learns_that_drafts_from_an_older_policy_accept_less(on):
    # Epoch 0 of a problem: rows draft from a fresh history (age 0) and verification accepts
    # all 4 tokens. Later epochs: the same drafter ratios (1) and supports (40), but from a
    # history sampled 10 versions ago, and 1 of 4 tokens is accepted. The fresh factors must
    # not fall for the old history's sake, and the old bucket starts from the fresh factors.
    pol = DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0, acceptance_ema=1.0,
                                     age_calibration=on),
                    cost_model=CostModel(c_base=1.0, c_tok=1e-6))
    rows = [RowView(i, "p", 10, 100) for i in range(4)]

    def step(ages, accepted):
        n, t = pol.choose(rows, _batch(ages), packed_step_shape(np.full(4, 64)))
        assert n.tolist() == [4] * 4
        pol.observe(StepRecord(batch=4, active=4, width=8, kv_len=64, drafted=16,
                               accepted=sum(accepted), emitted=16, seconds=t,
                               accepted_per_row=accepted))
    step([0, 0, 0, 0], (4, 4, 4, 4))
    assert pol.support_by_age[0, 5] == pytest.approx(1.0)        # 16 of 16 accepted
    assert pol.ages_seen.tolist() == [True] + [False] * 5
    q = pol.calibrated(_batch([10]))
    if on:   # bucket 4 is new: it starts from bucket 0's factors
        np.testing.assert_array_equal(pol.support_by_age[4], pol.support_by_age[0])
    np.testing.assert_allclose(q[0], 1.0)
    step([10, 10, 10, 10], (1, 1, 1, 1))
    # each row verified 2 tokens after an accepted prefix (the accepted one and the first
    # rejected), 1 accepted: the old bucket's factor goes to 1/2
    if on:
        assert pol.support_by_age[4, 5] == pytest.approx(0.5)
        assert pol.support_by_age[0, 5] == pytest.approx(1.0)     # fresh drafts keep theirs
        q = pol.calibrated(_batch([0, 10, np.nan]))
        np.testing.assert_allclose(q[0], 1.0)
        np.testing.assert_allclose(q[1], 0.5 ** np.arange(1, 5))
        np.testing.assert_allclose(q[2], 1.0)        # no age known: as fresh
        # the budget now drafts the old rows shorter when drafts cost something
        pol.cost_model = CostModel(c_base=0.03, c_tok=0.004)
        n, _ = pol.choose(rows, _batch([0, 0, 10, 10]), packed_step_shape(np.full(4, 64)))
        assert n[0] == n[1] == 4 and n[2] == n[3] < 2
        report = pol.acceptance_by_age()
        assert report["drafted"] == [16, 0, 0, 0, 16, 0]
        assert report["accepted"] == [16, 0, 0, 0, 4, 0]
    else:    # one set of factors for every age: the old history pulls the fresh drafts down
        assert (pol.support_by_age[1:] == support_prior()).all()   # never used
        assert pol.support_scale[5] == pytest.approx(0.5)
        q = pol.calibrated(_batch([0, 10]))
        np.testing.assert_allclose(q[0], q[1])
    # the factors are state: checkpoints and forks carry them; an older checkpoint (support
    # factors only) gives every age its fresh factors
    other = DASPolicy(config=pol.config)
    other.load_state_dict(pol.state_dict())
    np.testing.assert_array_equal(other.support_by_age, pol.support_by_age)
    np.testing.assert_array_equal(other.ages_seen, pol.ages_seen)
    np.testing.assert_array_equal(other.drafts_by_age, pol.drafts_by_age)
    np.testing.assert_array_equal(pol.fork().support_by_age, pol.support_by_age)
    old = {k: v for k, v in pol.state_dict().items()
           if k not in ("acceptance_by_age_and_support", "acceptance_by_source_age_and_support",
                        "acceptance_ages_seen_by_source")}
    other.load_state_dict(old)
    np.testing.assert_array_equal(other.support_by_age,
                                  np.tile(pol.support_scale, (AGE_BUCKETS, 1)))


def test_a_das_rollout_hands_the_ages_to_the_policy_and_keeps_tokens():
    """Through `Rollout.generate`: the drafter tags rollouts with the version set on the
    rollout, the policy sees each row's history age, and the tokens equal `none`'s."""
    from das_jax.engine import Engine, EngineConfig, Request, SamplingParams
    from das_jax.rollout import Rollout
    from das_jax.testing import tiny_model_config, tiny_params
    cfg = tiny_model_config()
    params = tiny_params(cfg)
    engine = Engine(cfg, params, eos_token_ids=(), engine_config=EngineConfig(
        max_slots=4, max_cache_len=64, draft_widths=(1, 4)))
    reqs = [Request((1, 2, 3), problem_id=f"p{i % 2}", sample_index=i) for i in range(4)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12, seed=0)
    ref, _ = Rollout(engine, "none").generate(reqs, sampling=sampling)
    das = Rollout(engine, "das")
    seen = []
    choose = das.policy.choose

    def spy(rows, drafts, step_shape, draft_support=None):
        seen.append(None if drafts.age_A is None else drafts.age_A.copy())
        return choose(rows, drafts, step_shape, draft_support)
    das.policy.choose = spy
    for version, epoch in ((0, 0), (5, 1)):
        das.set_policy_version(version)
        out, _ = das.generate(reqs, sampling=sampling)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
        das.advance_epoch()
    history = das.drafter.history
    assert sorted(v for p in history.problems() for v in history.versions(p)) == \
        [0] * 4 + [5] * 4
    ages = np.concatenate([a for a in seen if a is not None and len(a)])
    assert ages.size and np.all(ages >= 0) and np.all(ages <= 5)
    assert np.any(ages > 0)          # epoch 1 drafted from the version-0 history
