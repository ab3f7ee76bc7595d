"""The DAS budget on measured step shapes: the cost model's per-shape table (N, K, W), the step
shape's width, the policy's preference for measured (compiled) shapes."""
from __future__ import annotations

import numpy as np
import pytest

from das_jax.speculation.cost_model import CostModel
from das_jax.speculation.das_policy import DASConfig, DASPolicy
from das_jax.engine.policy import RowView, StepRecord, padded_step_shape
from das_jax.engine.schedule import StepShape, packed_width, step_shape_fn


def test_step_shape_carries_the_width_and_compares_as_a_pair():
    shape = step_shape_fn(16, 128, (1, 4, 8))
    s = shape(np.array([3] + [0] * 15))
    assert s == (24, 2048) and s.width == 4 and isinstance(s, StepShape)
    assert shape(np.zeros(16, np.int32)).width == 1
    assert shape(np.array([7, 1])).width == 8 == packed_width([7, 1], (1, 4, 8))
    n, k = shape(np.array([5, 0]))
    assert (n, k) == (16, 2048)
    padded = padded_step_shape(4, (1, 4, 8), 64)(np.array([2, 0, 0, 0]))
    assert padded == (16, 256) and padded.width == 4 and isinstance(padded, StepShape)


def test_cost_model_prices_measured_shapes_by_their_times():
    cm = CostModel(c_base=0.05, c_tok=0.003, c_kv=0.0, table_min=2, table_window=4)
    linear = cm.predict_step(24, 2048)
    assert not cm.seen(24, 2048, 4)
    cm.observe_step(24, 2048, 0.30, width=4)
    assert cm.seen(24, 2048, 4) and not cm.seen(24, 2048, 8)
    # One observation is not enough (table_min = 2): still the linear fit.
    assert cm.predict_step(24, 2048, width=4) == pytest.approx(cm.predict_step(24, 2048))
    for t in (0.31, 0.29, 0.50):
        cm.observe_step(24, 2048, t, width=4)
    assert cm.predict_step(24, 2048, width=4) == pytest.approx(np.median([0.31, 0.29, 0.50,
                                                                          0.30]))
    # The window keeps the most recent table_window times: the machine got slower.
    for t in (0.6, 0.6, 0.6):
        cm.observe_step(24, 2048, t, width=4)
    assert cm.predict_step(24, 2048, width=4) == pytest.approx(0.6)
    # Each shape's median is its own (kept between observations of that shape).
    for t in (0.9, 0.7):
        cm.observe_step(24, 2048, t, width=16)
    assert cm.predict_step(24, 2048, width=16) == pytest.approx(0.8)
    assert cm.predict_step(24, 2048, width=4) == pytest.approx(0.6)
    cm.observe_step(24, 2048, 0.2, width=4)
    assert cm.predict_step(24, 2048, width=4) == pytest.approx(0.6)   # 0.5 fell out, 0.2 in
    cm.observe_step(24, 2048, 0.2, width=4)
    assert cm.predict_step(24, 2048, width=4) == pytest.approx(0.4)
    # Without a width, or at another width, the linear fit prices the shape.
    assert cm.predict_step(24, 2048) == pytest.approx(cm.c_base + cm.c_tok * 24)
    assert cm.predict_step(24, 2048, width=8) == cm.predict_step(24, 2048)
    assert linear != cm.predict_step(24, 2048, width=4)


def _policy(cm, explore_every=0):
    return DASPolicy(config=DASConfig(short_threshold=0, long_threshold=0,
                                      explore_every=explore_every), cost_model=cm)


def test_budget_follows_measured_cost_not_the_fit():
    # The fit says a draft slot is nearly free; the step with drafts was measured 40% dearer.
    rows = [RowView(i, "p", 5, 50) for i in range(4)]
    shape = step_shape_fn(4, 128, (1, 4, 8))
    probs = [np.array([0.5])] * 4        # +2 expected tokens for 4 rows: pays only if < 50%
    cm = CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0)
    assert _policy(cm).choose(rows, probs, shape)[0].tolist() == [1] * 4
    for _ in range(2):
        cm.observe_step(4, 512, 0.050, width=1)
        cm.observe_step(8, 512, 0.080, width=4)
    n, t = _policy(cm).choose(rows, probs, shape)
    assert n.tolist() == [0] * 4 and t == pytest.approx(0.050)
    # Measured cheap: it drafts, and predicts the measured time.
    cm2 = CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0)
    for _ in range(2):
        cm2.observe_step(4, 512, 0.050, width=1)
        cm2.observe_step(8, 512, 0.055, width=4)
    n, t = _policy(cm2).choose(rows, probs, shape)
    assert n.tolist() == [1] * 4 and t == pytest.approx(0.055)


def test_split_query_block_is_its_own_measured_shape():
    """A step where one of 16 rows drafts runs the split query block (R = 2 at W = 8): the cost
    model keys it apart from the one-block step of the same (N, K, W), the policy prices a
    choice by the shape it will run and learns its time from the step's record."""
    cm = CostModel(c_base=0.05, c_tok=1e-3, c_kv=0.0, table_min=2)
    for _ in range(2):
        cm.observe_step(24, 2048, 0.200, width=8)                 # one [16, 8] block
        cm.observe_step(24, 2048, 0.150, width=8, wide_rows=2)    # [16, 1] + [2, 8]
        cm.observe_step(16, 2048, 0.120, width=1)
    assert cm.seen(24, 2048, 8) and cm.seen(24, 2048, 8, 2) and not cm.seen(24, 2048, 8, 4)
    assert cm.predict_step(24, 2048, width=8) == pytest.approx(0.200)
    assert cm.predict_step(24, 2048, width=8, wide_rows=2) == pytest.approx(0.150)
    rows = [RowView(i, "p", 5, 500) for i in range(16)]
    probs = [np.full(7, 0.9)] + [np.zeros(0)] * 15
    one = step_shape_fn(16, 128, (1, 8))
    split = step_shape_fn(16, 128, (1, 8), wide_buckets=(2, 4))
    pol = _policy(cm)
    n, t = pol.choose(rows, probs, split)
    assert n[0] == 7 and t == pytest.approx(0.150)
    n1, t1 = _policy(cm).choose(rows, probs, one)
    assert t1 in (pytest.approx(0.200), pytest.approx(0.120))
    s = split(n)
    pol.observe(StepRecord(batch=16, active=16, width=s.width, kv_len=128, drafted=7,
                           accepted=7, emitted=23, seconds=0.140, num_tokens=s[0],
                           attended_kv=2048, wide_rows=s.wide_rows))
    assert len(cm.table[(24, 2048, 8, 2)]) == 3 and len(cm.table[(24, 2048, 8)]) == 2


def _record(shape, n, seconds, compile_s=0.0):
    s = shape(n)
    return StepRecord(batch=4, active=4, width=s.width, kv_len=128, drafted=int(n.sum()),
                      accepted=0, emitted=4, seconds=seconds, num_tokens=s[0],
                      attended_kv=512, accepted_per_row=(0,) * 4, compile_s=compile_s)


def _steps_until_bought(compile_s, steps=60, explore_every=0, measured=()):
    """(chosen draft totals per step, the unmeasured shapes' accounts after step 1): 4 rows whose
    7-token drafts the fit says pay, where only the plain step (and `measured`: (N, W, seconds)
    shapes) was measured."""
    rows = [RowView(i, "p", 5, 50) for i in range(4)]
    shape = step_shape_fn(4, 128, (1, 4, 8))
    probs = [np.full(7, 0.95)] * 4
    cm = CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0, compile_s=compile_s)
    for _ in range(2):
        cm.observe_step(4, 512, 0.050, width=1)
        for N, W, t in measured:
            cm.observe_step(N, 512, t, width=W)
    pol = _policy(cm, explore_every=explore_every)
    chosen, account = [], None
    for step in range(steps):
        n, _ = pol.choose(rows, probs, shape)
        chosen.append(int(n.sum()))
        if step == 0:
            account = dict(pol._regret)
        pol.observe(_record(shape, n, 0.05))
        if n.sum():
            assert cm.seen(shape(n)[0], 512, shape(n).width)
    return chosen, account


def test_an_unmeasured_shape_is_compiled_once_its_forgone_savings_reach_the_compile_time():
    # Ski rental: each step the drafting shape would have beaten the measured plain step adds
    # the predicted seconds it would have saved (the same g every step here); it is compiled
    # (run) on the first step its account reaches compile_s, and not before.
    chosen, account = _steps_until_bought(compile_s=0.1)
    # Every unmeasured shape that would have beaten it has an account; the best (all drafts:
    # N = 4 + 28 slots, width 8) gains most per step.
    key, g = max(account.items(), key=lambda kv: kv[1])
    assert key == (32, 512, 8) and g > 0 and len(account) > 1
    k = int(np.ceil(0.1 / g - 1e-9))
    assert 1 < k < 60
    assert chosen[:k - 1] == [0] * (k - 1)
    assert chosen[k - 1] == 28
    # Twice the price, about twice the wait; free compiles are bought at once.
    chosen2, _ = _steps_until_bought(compile_s=0.2)
    k2 = chosen2.index(28) + 1
    assert k2 == int(np.ceil(0.2 / g - 1e-9))
    assert _steps_until_bought(compile_s=0.0)[0][0] == 28
    # A compile dearer than anything the run would save is never paid.
    assert set(_steps_until_bought(compile_s=1e6)[0]) == {0}


def test_exploration_runs_an_unmeasured_shape_only_while_no_drafting_shape_is_measured():
    # Cold start (no calibration): the 4th step explores the best drafting choice, measured
    # as cheap as the plain step, so every later step drafts.
    chosen, _ = _steps_until_bought(compile_s=1e6, steps=8, explore_every=4)
    assert chosen[:3] == [0, 0, 0] and chosen[3:] == [28] * 5
    # With a drafting shape measured (slow: one draft per row, 0.2 s), exploration steps run
    # that one, never an unmeasured shape whose compile has not paid.
    chosen, _ = _steps_until_bought(compile_s=1e6, steps=12, explore_every=4,
                                    measured=((8, 4, 0.2),))
    assert chosen == [0, 0, 0, 4] * 3


def test_a_shape_that_would_pay_once_is_not_compiled_and_measured_shapes_need_no_account():
    rows = [RowView(i, "p", 5, 50) for i in range(4)]
    shape = step_shape_fn(4, 128, (1, 4, 8))
    cm = CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0, compile_s=0.1)
    for _ in range(2):
        cm.observe_step(4, 512, 0.050, width=1)
    pol = _policy(cm, explore_every=2)
    chosen = []
    for step in range(12):
        probs = [np.full(7, 0.95)] * 4 if step == 0 else [np.zeros(0)] * 4
        n, _ = pol.choose(rows, probs, shape)
        chosen.append(int(n.sum()))
        pol.observe(_record(shape, n, 0.05))
    assert chosen == [0] * 12
    assert 0 < pol._regret[(32, 512, 8)] < 0.1
    # Once the shape is measured (by any route: calibration, another policy), its account is
    # closed and its measured time prices it.
    for _ in range(2):
        pol.observe(_record(shape, np.full(4, 7), 0.05))
    assert (32, 512, 8) not in pol._regret
    n, t = pol.choose(rows, [np.full(7, 0.95)] * 4, shape)
    assert n.sum() == 28 and t == pytest.approx(0.05)


def test_the_compile_time_is_learned_from_the_steps_that_compiled():
    cm = CostModel(c_base=0.05, c_tok=1e-4, c_kv=0.0, compile_s=1.0)
    pol = _policy(cm)
    shape = step_shape_fn(4, 128, (1, 4, 8))
    pol.observe(_record(shape, np.zeros(4, np.int32), 0.05))      # compiled nothing
    assert cm.compile_s == 1.0 and cm.compile_count == 0
    pol.observe(_record(shape, np.full(4, 3), 0.06, compile_s=2.0))
    assert cm.compile_s == pytest.approx(2.0) and cm.compile_count == 1   # the prior is dropped
    pol.observe(_record(shape, np.full(4, 7), 0.07, compile_s=3.0))
    assert cm.compile_s == pytest.approx(2.5) and cm.compile_count == 2
    # It is part of the checkpointed state.
    state = pol.state_dict()
    fresh = _policy(CostModel())
    fresh.load_state_dict(state)
    assert fresh.cost_model.compile_s == pytest.approx(2.5)
    assert fresh.cost_model.compile_count == 2 and isinstance(fresh.cost_model.compile_count, int)
    # The compile time does not make records unequal (a program compiled by an earlier run of
    # the process is not compiled again), and a frozen cost model ignores it.
    assert _record(shape, np.full(4, 3), 0.06, compile_s=2.0) == _record(shape, np.full(4, 3),
                                                                          0.06)
    from das_jax.bench.replay import FrozenCostModel
    frozen = FrozenCostModel.of({"c_base": 0.05, "c_tok": 1e-4})
    frozen.observe_compile(5.0)
    assert frozen.compile_s == 1.0 and frozen.compile_count == 0
    # From the config (das.cost_model.compile_s), checked there.
    from das_jax.speculation.cost_model import CostModelConfig
    assert CostModel.from_config(CostModelConfig(compile_s=0.25)).compile_s == 0.25
    # A fitted model's to_dict is config keys (the rollout benchmark hands its fit to every
    # drafter through `dataclasses.replace(das.cost_model, **coef)`), compile time included.
    import dataclasses
    fitted = dataclasses.replace(CostModelConfig(), calibrate=False, **cm.to_dict())
    assert fitted.compile_s == pytest.approx(2.5) and fitted.c_tok == cm.c_tok
    with pytest.raises(ValueError, match="compile_s must be >= 0"):
        CostModelConfig(compile_s=-1.0)


# ---------------------------------------------------------------------- a paged cache's KV term
def test_pages_read_counts_each_rows_own_pages():
    from das_jax.engine.schedule import pages_read_kv
    assert pages_read_kv([0, 1, 16, 17], 16) == 16 * (0 + 1 + 1 + 2)
    assert pages_read_kv([], 16) == 0
    assert pages_read_kv(np.array([5, 5, 5], np.int32), 4) == 4 * 6
    shape = step_shape_fn(4, 128, (1, 4), read_kv=96)
    s = shape(np.array([3, 0]))
    assert s == (8, 512) and s.width == 4 and s.read_kv == 96 and shape.read_kv == 96
    assert step_shape_fn(4, 128, (1,))(np.zeros(4)).read_kv == 512    # default: the bucket


def test_cost_model_prices_a_paged_step_by_the_positions_it_reads():
    cm = CostModel(c_base=0.01, c_tok=1e-3, c_kv=1e-5)
    # the linear fit: the KV term of the positions read, not of the bucket
    assert cm.predict_step(8, 4096, read_kv=1024) == pytest.approx(0.01 + 8e-3 + 1024e-5)
    assert cm.predict_step(8, 4096) == pytest.approx(0.01 + 8e-3 + 4096e-5)
    # a measured program (keyed by its bucket) read 1,000 positions: the median is shifted by
    # c_kv per position read more or less
    for _ in range(2):
        cm.observe_step(8, 4096, 0.05, width=4, read_kv=1000)
    assert cm.seen(8, 4096, 4)
    assert cm.predict_step(8, 4096, width=4, read_kv=1000) == pytest.approx(0.05)
    assert cm.predict_step(8, 4096, width=4, read_kv=3000) == pytest.approx(
        0.05 + cm.c_kv * 2000)
    assert cm.predict_step(8, 4096, width=4) == pytest.approx(0.05)   # not paged: no shift
    # the fit sees the positions read
    assert {k for _, k, _ in cm.observations} == {1000}


def test_das_budget_prices_rows_by_the_pages_they_read():
    """The fixed cost a row bears (its share of the step's KV reads) follows the pages the
    live rows hold: with the bucket's reads priced, a row's tokens are worth more and the
    budget drafts where it would not at the rows' real reads."""
    rows = [RowView(i, "p", 5, 50) for i in range(4)]
    probs = [np.array([0.3])] * 4
    cm = CostModel(c_base=1e-3, c_tok=2e-3, c_kv=1e-5)
    bucket = step_shape_fn(4, 1024, (1, 4))
    paged = step_shape_fn(4, 1024, (1, 4), read_kv=4 * 16)
    assert _policy(cm).choose(rows, probs, bucket)[0].tolist() == [1] * 4
    n, t = _policy(cm).choose(rows, probs, paged)
    assert n.tolist() == [0] * 4
    assert t == pytest.approx(cm.predict_step(4, 4096, read_kv=64))


def _fit_from_scratch(observations) -> tuple[float, float, float]:
    """The refit's coefficients computed from the whole window (one point per shape, its
    median time; non-negative least squares)."""
    by_shape: dict = {}
    for n, k, t in observations:
        by_shape.setdefault((n, k), []).append(t)
    obs = np.array([(n, k, np.median(ts)) for (n, k), ts in by_shape.items()])
    from scipy.optimize import nnls
    coef, _ = nnls(np.stack([np.ones(len(obs)), obs[:, 0], obs[:, 1]], axis=1), obs[:, 2])
    return tuple(float(c) for c in coef)


def test_the_refit_keeps_its_points_as_the_window_moves():
    """`observe_step` refits from per-shape medians kept as the window slides (the shapes an
    observation joins and leaves, not the whole window): the coefficients equal a fit from
    scratch at every step, shapes leaving the window drop out, and a window replaced or
    shortened outside `observe_step` is rebuilt."""
    rng = np.random.default_rng(0)
    cm = CostModel(history=40)
    for i in range(200):
        n, k = int(rng.choice([16, 32, 48, 64, 96])), int(rng.choice([1024, 2048, 4096]))
        if i > 120:
            n = int(rng.choice([128, 160]))     # the early shapes leave the window
        cm.observe_step(n, k, 0.02 + 1e-4 * n + 2e-6 * k + 1e-3 * rng.random(), width=4)
        if i >= 2:
            ref = _fit_from_scratch(cm.observations)
            np.testing.assert_allclose((cm.c_base, cm.c_tok, cm.c_kv), ref, rtol=1e-9,
                                       atol=1e-15)
    assert {n for n, _ in cm._window_points()} == {128, 160}
    assert sum(len(ts) for ts, _ in cm._window_points().values()) == 40
    cm.observations.popleft()               # changed outside observe_step: rebuilt
    assert sum(len(ts) for ts, _ in cm._window_points().values()) == 39
    cm.observations = type(cm.observations)(list(cm.observations)[:10])
    cm.fit()
    np.testing.assert_allclose((cm.c_base, cm.c_tok, cm.c_kv),
                               _fit_from_scratch(cm.observations), rtol=1e-9, atol=1e-15)
