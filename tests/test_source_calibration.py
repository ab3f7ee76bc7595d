"""The DAS policy's acceptance calibration per draft source: the history's problem, request and
global tries and a draft head each learn their own factors from their own rows' trials."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.drafter.base import DRAFT_SOURCES, DraftBatch
from das_jax.engine.policy import RowView, StepRecord, packed_step_shape
from das_jax.speculation.acceptance import AGE_BUCKETS, support_prior
from das_jax.speculation.cost_model import CostModel
from das_jax.speculation.das_policy import DASConfig, DASPolicy

PROBLEM, REQUEST, GLOBAL, HEAD, OTHER = range(5)
assert DRAFT_SOURCES == ("problem", "request", "global", "head", "other")
K = 4


def _batch(sources, support=True):
    """Drafts of K tokens, ratio 1 at every token (probabilities 1), support 40 (bucket 5) or
    none, fresh histories (age 0), from `sources` (indices into DRAFT_SOURCES)."""
    A = len(sources)
    return DraftBatch(np.ones((A, K), np.int32), np.ones((A, K), np.float32),
                      np.full((A, K), 40 if support else 0, np.int32), np.full(A, K, np.int32),
                      np.full(A, support), np.zeros(A, np.float32),
                      np.asarray(sources, np.int8))


def _policy(source_calibration=True):
    return DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0, acceptance_ema=1.0,
                                      explore_every=0, source_calibration=source_calibration),
                     cost_model=CostModel(c_base=1.0, c_tok=1e-6))


def _step(pol, db, accepted):
    rows = [RowView(i, "p", 10, 100) for i in range(len(db))]
    n, t = pol.choose(rows, db, packed_step_shape(np.full(len(db), 64)))
    assert n.tolist() == [K] * len(db)           # drafts are nearly free: all verified
    pol.observe(StepRecord(batch=len(db), active=len(db), width=8, kv_len=64,
                           drafted=int(n.sum()), accepted=sum(accepted),
                           emitted=int(n.sum()), seconds=t, accepted_per_row=accepted))


def test_history_scopes_learn_their_own_support_factors():
    """Problem-trie drafts are all accepted, global-trie drafts with the same ratios and
    supports only their first token: each scope's factor follows its own trials, so the same
    draft is worth more from the problem's trie; off, they share one factor."""
    pol = _policy()
    _step(pol, _batch([PROBLEM, PROBLEM]), (4, 4))
    assert pol.ages_seen_by_source[PROBLEM, 0] and not pol.ages_seen_by_source[GLOBAL].any()
    # a source seen for the first time starts from the problem trie's factors
    q = pol.calibrated(_batch([GLOBAL]))
    np.testing.assert_array_equal(pol.support_by_source[GLOBAL, 0],
                                  pol.support_by_source[PROBLEM, 0])
    np.testing.assert_allclose(q[0], 1.0)
    _step(pol, _batch([PROBLEM, GLOBAL]), (4, 1))
    # the global row verified 2 tokens after an accepted prefix, 1 accepted: its factor 1/2
    assert pol.support_by_source[GLOBAL, 0, 5] == pytest.approx(0.5)
    assert pol.support_by_source[PROBLEM, 0, 5] == pytest.approx(1.0)
    assert (pol.support_by_source[REQUEST] == support_prior()).all()    # never used
    q = pol.calibrated(_batch([PROBLEM, GLOBAL, -1]))
    np.testing.assert_allclose(q[0], 1.0)
    np.testing.assert_allclose(q[1], 0.5 ** np.arange(1, K + 1))
    np.testing.assert_allclose(q[2], 1.0)        # no source said: the problem trie's
    # the budget drafts the global rows shorter once drafts cost something
    pol.cost_model = CostModel(c_base=0.03, c_tok=0.004)
    rows = [RowView(i, "p", 10, 100) for i in range(4)]
    n, _ = pol.choose(rows, _batch([PROBLEM, PROBLEM, GLOBAL, GLOBAL]),
                      packed_step_shape(np.full(4, 64)))
    assert n[0] == n[1] == K and n[2] == n[3] < 2

    off = _policy(source_calibration=False)
    _step(off, _batch([PROBLEM, PROBLEM]), (4, 4))
    _step(off, _batch([PROBLEM, GLOBAL]), (4, 1))
    q = off.calibrated(_batch([PROBLEM, GLOBAL]))
    np.testing.assert_array_equal(q[0], q[1])      # one factor for both scopes
    assert (off.support_by_source[1:] == support_prior()).all()


def test_a_head_and_another_drafter_without_support_learn_their_own_depth_factors():
    pol = _policy()
    for _ in range(3):
        _step(pol, _batch([HEAD, HEAD, OTHER, OTHER], support=False), (4, 4, 0, 0))
    np.testing.assert_allclose(pol.depth_by_source[HEAD], 1.0)
    assert (pol.depth_by_source[OTHER] <= 0.02 + 1e-12).all()
    np.testing.assert_array_equal(pol.depth_scale, pol.depth_by_source[OTHER])
    q = pol.calibrated(_batch([HEAD, OTHER, -1], support=False))
    np.testing.assert_allclose(q[0], 1.0)
    assert q[1].max() <= 0.02 + 1e-12
    np.testing.assert_array_equal(q[2], q[1])      # no source said: "other"
    # support-less factors leave the support tables alone, and the other way round
    assert (pol.support_by_source == support_prior()).all()

    off = _policy(source_calibration=False)
    for _ in range(3):
        _step(off, _batch([HEAD, HEAD, OTHER, OTHER], support=False), (4, 4, 0, 0))
    assert list(off.depth_by_source) == [OTHER]      # one set of factors for every source


def test_factors_per_source_are_state_and_older_checkpoints_load():
    pol = _policy()
    _step(pol, _batch([PROBLEM, GLOBAL]), (4, 1))
    _step(pol, _batch([HEAD, OTHER], support=False), (4, 0))
    state = pol.state_dict()
    assert set(state["acceptance_by_source_and_depth"]) == {"head", "other"}
    other = _policy()
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.support_by_source, pol.support_by_source)
    np.testing.assert_array_equal(other.ages_seen_by_source, pol.ages_seen_by_source)
    assert set(other.depth_by_source) == {HEAD, OTHER}
    for k in (HEAD, OTHER):
        np.testing.assert_array_equal(other.depth_by_source[k], pol.depth_by_source[k])
    fork = pol.fork()
    np.testing.assert_array_equal(fork.support_by_source, pol.support_by_source)
    fork.depth_by_source[HEAD][:] = 0.5                 # a copy, not shared
    assert pol.depth_by_source[HEAD][0] == pytest.approx(1.0)
    # a checkpoint from before sources: one support table (the problem trie's) for every
    # source, one set of depth factors for the head and for "other"
    old = {k: v for k, v in state.items()
           if k not in ("acceptance_by_source_and_depth", "acceptance_by_source_age_and_support",
                        "acceptance_ages_seen_by_source")}
    back = _policy()
    back.load_state_dict(old)
    for k in range(len(DRAFT_SOURCES)):
        np.testing.assert_array_equal(back.support_by_source[k], pol.support_by_source[PROBLEM])
    assert back.ages_seen_by_source[PROBLEM].tolist() == [True] + [False] * (AGE_BUCKETS - 1)
    assert not back.ages_seen_by_source[GLOBAL].any()
    np.testing.assert_array_equal(back.depth_by_source[HEAD], pol.depth_by_source[OTHER])
    np.testing.assert_array_equal(back.depth_by_source[OTHER], pol.depth_by_source[OTHER])
